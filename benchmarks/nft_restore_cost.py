"""What one small change costs `iptables-nft-restore --noflush` beside big chains.

In a network namespace created for the run (and deleted after), a nat chain gets `--rules`
REDIRECT rules (one per service port, as the portal chains held them before the shards), and
as many again are spread over 256 shard chains behind an entry chain (as they are held now).
Then each kind of one-change input is timed (`--repeat` runs, median): an append to the big
chain, a delete by text and by number in it, a delete and an append in a shard, an append to a
shard, an insert at a shard's head (`-I CHAIN 1`, how a moved port's new rule shadows the
old one), a flush of / an append to a small chain, and adding and removing a chain with its jump.
It shows why the rules live in shards: a delete in the 10,000-rule chain costs hundreds of
milliseconds (iptables-nft loads the whole chain to find the rule), one in a shard tens.

    sudo .venv/bin/python benchmarks/nft_restore_cost.py [--rules 10000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

BIG = "KUBE-PORTALS-CONTAINER"


def restore(text: str) -> float:
    started = time.perf_counter()
    subprocess.run(["iptables-nft-restore", "--noflush"], input=text, text=True, check=True)
    return time.perf_counter() - started


def rule(i: int, port: int) -> str:
    return (
        f"{BIG} -d 10.96.{i // 250}.{i % 250 + 1}/32 -p tcp -m comment --comment"
        f' "ns/svc{i}:p" -m tcp --dport 80 -j REDIRECT --to-ports {port}'
    )


SHARDS = 256


def shard_rule(i: int, port: int) -> str:
    """Rule `i` in its shard of the entry chain KUBE-ENTRY (i % 256), as the proxy lays out."""
    return rule(i, port).replace(BIG, f"KUBE-ENTRY-{i % SHARDS:02X}", 1)


def inside(rules: int, repeat: int) -> None:
    shards = [f"KUBE-ENTRY-{k:02X}" for k in range(SHARDS)]
    lines = ["*nat", f":{BIG} - [0:0]", ":KUBE-SMALL - [0:0]", ":KUBE-ENTRY - [0:0]"]
    lines += [f":{chain} - [0:0]" for chain in shards]
    lines += [f"-A {rule(i, 20000 + i)}" for i in range(rules)]
    lines += ["-A KUBE-SMALL -d 10.97.0.1/32 -p tcp -j REDIRECT --to-ports 1"]
    lines += [f"-A KUBE-ENTRY -j {chain}" for chain in shards]
    lines += [f"-A {shard_rule(i, 20000 + i)}" for i in range(rules)]
    lines += ["COMMIT", ""]
    print(
        f"| {rules:,} rules in one chain and {rules:,} in {SHARDS} shards, from scratch"
        f" | {1000 * restore(chr(10).join(lines)):.0f} ms |"
    )
    times: dict[str, list[float]] = {}
    for k in range(repeat):
        i = 100 + k * SHARDS
        cases = {
            f"append one rule to the {rules:,}-rule chain": f"-A {rule(rules + k, 1)}",
            "insert one rule at the head of that chain (`-I CHAIN 1`)": (
                f"-I {rule(rules + repeat + k, 1).replace(' ', ' 1 ', 1)}"
            ),
            "`-D` one rule (by its text) and append one, in that chain": (
                f"-D {rule(i, 20000 + i)}\n-A {rule(i, 40000 + i)}"
            ),
            "`-D` one rule by number in that chain": f"-D {BIG} {200 + k}",
            f"`-D` one rule (by its text) and append one, in a {rules // SHARDS}-rule shard": (
                f"-D {shard_rule(i, 20000 + i)}\n-A {shard_rule(i, 40000 + i)}"
            ),
            "append one rule to a shard": f"-A {shard_rule(rules + k, 1)}",
            "insert one rule at the head of a shard (`-I CHAIN 1`)": (
                f"-I {shard_rule(rules + 2 * repeat + k, 1).replace(' ', ' 1 ', 1)}"
            ),
            "`-I` a rule at a shard's head and append one to another shard": (
                f"-I {shard_rule(rules + 3 * repeat + k, 2).replace(' ', ' 1 ', 1)}\n"
                f"-A {shard_rule(rules + 4 * repeat + k + 1, 2)}"
            ),
            "flush a one-rule chain and append to it": (
                ":KUBE-SMALL - [0:0]\n"
                f"-A KUBE-SMALL -d 10.97.0.1/32 -p tcp -j REDIRECT --to-ports {k + 2}"
            ),
            f"declare a chain, one rule in it, a jump to it in the {SHARDS}-jump entry chain": (
                f":KUBE-NEW{k} - [0:0]\n-A KUBE-NEW{k} -p tcp -j REDIRECT --to-ports 5\n"
                f"-A KUBE-ENTRY -j KUBE-NEW{k}"
            ),
            "delete that jump, flush and delete that chain (`-D`, `-F`, `-X`)": (
                f"-D KUBE-ENTRY -j KUBE-NEW{k}\n-F KUBE-NEW{k}\n-X KUBE-NEW{k}"
            ),
        }
        for name, body in cases.items():
            times.setdefault(name, []).append(restore(f"*nat\n{body}\nCOMMIT\n"))
    for name, values in times.items():
        print(f"| {name} | {1000 * statistics.median(values):.0f} ms |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rules", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        inside(args.rules, args.repeat)
        return 0
    if os.geteuid() != 0:
        print("needs root (it creates a network namespace)", file=sys.stderr)
        return 2
    ns = f"kupnftcost{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        print("| restore input | time |\n|---|---:|", flush=True)
        command = [sys.executable, __file__, "--inside", "--rules", str(args.rules)]
        subprocess.run(
            ["ip", "netns", "exec", ns, *command, "--repeat", str(args.repeat)],
            check=True,
            timeout=600,
        )
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
