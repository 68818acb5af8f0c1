#!/bin/bash
# What a new connection costs when nat OUTPUT walks 10,000 DNAT rules that do not match it:
# how the proxy's dial to a pod (and any node-local connection) pays for the Service rules.
# Two network namespaces made here (names carry this pid) and removed on exit; the rules live
# only in the first. Needs root. Usage: sudo bash benchmarks/nat_walk.sh [RULES] [CONNECTIONS]
set -euo pipefail
RULES=${1:-10000}
CONNECTIONS=${2:-3000}
A=kupnatA$$
B=kupnatB$$
SERVER=
cleanup() {
  if [ -n "$SERVER" ]; then kill "$SERVER" 2>/dev/null || true; fi
  ip netns del $A 2>/dev/null || true
  ip netns del $B 2>/dev/null || true
}
trap cleanup EXIT
ip netns add $A
ip netns add $B
ip link add va$$ netns $A type veth peer name vb$$ netns $B
ip -n $A addr add 10.250.0.1/24 dev va$$
ip -n $B addr add 10.250.0.2/24 dev vb$$
ip -n $A link set va$$ up
ip -n $B link set vb$$ up
ip netns exec $B timeout 300 python3 -c '
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("10.250.0.2", 9000))
s.listen(4096)
while True:
    s.accept()[0].close()
' &
SERVER=$!
sleep 0.5
measure() {
  ip netns exec $A python3 -c '
import socket, struct, sys, time
n = int(sys.argv[1])
linger = struct.pack("ii", 1, 0)  # close with RST: no TIME_WAIT piling up
wall, cpu = time.perf_counter(), time.process_time()
for _ in range(n):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
    s.connect(("10.250.0.2", 9000))
    s.close()
print(f"{1e6 * (time.perf_counter() - wall) / n:.1f} us per connection (wall),"
      f" {1e6 * (time.process_time() - cpu) / n:.1f} us CPU")
' "$CONNECTIONS"
}
echo -n "no rules:                         "; measure
python3 -c '
import sys
n = int(sys.argv[1])
print("*nat")
print(":KUBE-PORTALS-HOST - [0:0]")
print("-A OUTPUT -j KUBE-PORTALS-HOST")
for i in range(n):
    print(f"-A KUBE-PORTALS-HOST -d 10.96.{i // 250}.{i % 250 + 1}/32 -p tcp -m tcp --dport 80"
          f" -m comment --comment default/svc-{i}:p -j DNAT --to-destination 10.250.0.1:{20000 + i % 40000}")
print("COMMIT")' "$RULES" | ip netns exec $A iptables-nft-restore --noflush
echo -n "$RULES rules in nat OUTPUT, none match: "; measure
