"""Rule rendering, explanations, the diff planner and the iptables-restore text (no root)."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
from collections.abc import Hashable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kube_userspace_proxy.addresses import Family
from kube_userspace_proxy.errors import PortalsError
from kube_userspace_proxy.model import Protocol, ProxiedPort, ServicePortInfo, ServicePortName
from kube_userspace_proxy.portals import Portals, plan
from kube_userspace_proxy.portals.desired import Desired, explain, render
from kube_userspace_proxy.portals.restore import predict, restore_text, view_of
from kube_userspace_proxy.portals.rules import (
    CHAINS,
    CONTAINER_NODEPORTS,
    CONTAINER_PORTALS,
    HOST_NODEPORTS,
    HOST_PORTALS,
    NON_LOCAL_NODEPORTS,
    PROXY_PORTS,
    Rule,
    base_chain,
    claimed,
    is_ours,
)
from kube_userspace_proxy.portals.settings import Settings

NODE = Settings(node_ips=("10.244.0.1",))
WEB = ServicePortName("default", "web", "http")


def port(
    *,
    name: ServicePortName = WEB,
    cluster_ips: tuple[str, ...] = ("10.96.0.10",),
    node_port: int = 0,
    external_ips: tuple[str, ...] = (),
    lb_ips: tuple[str, ...] = (),
    cluster_port: int = 40001,
    external_port: int | None = None,
    svc_port: int = 80,
) -> ProxiedPort:
    info = ServicePortInfo(
        name,
        svc_port,
        cluster_ips,
        node_port=node_port,
        external_ips=external_ips,
        load_balancer_ips=lb_ips,
    )
    return ProxiedPort(info, cluster_port, cluster_port if external_port is None else external_port)


def services_rules(ports: Sequence[ProxiedPort], s: Settings = NODE) -> list[Rule]:
    """The rendered rules of the service ports: no jumps into our chains or to the shards."""
    return [r for r in render(ports, s) if not r.to_chain]


def lines(ports: Sequence[ProxiedPort], s: Settings = NODE, chain: str | None = None) -> list[str]:
    """The service ports' rules, written as if in their entry chains rather than its shards
    (all of them, or those of `chain`)."""
    return [
        f"-A {base_chain(r.chain)} {r.spec}"
        for r in services_rules(ports, s)
        if chain is None or base_chain(r.chain) == chain
    ]


def test_cluster_ip_from_pods_is_redirected_to_the_proxy_port() -> None:
    assert lines([port()], chain=CONTAINER_PORTALS) == [
        '-A KUBE-PORTALS-CONTAINER -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http"'
        " -m tcp --dport 80 -j REDIRECT --to-ports 40001"
    ]


def test_cluster_ip_from_the_node_is_dnated_to_the_node_ip() -> None:
    assert lines([port()], chain=HOST_PORTALS) == [
        '-A KUBE-PORTALS-HOST -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http"'
        " -m tcp --dport 80 -j DNAT --to-destination 10.244.0.1:40001"
    ]


def test_specific_bind_address_gets_dnat_for_pods_and_node() -> None:
    s = Settings(node_ips=("10.244.0.1",), bind_address="10.244.0.7")
    container = lines([port()], s, CONTAINER_PORTALS)
    host = lines([port()], s, HOST_PORTALS)
    assert container[0].endswith("-j DNAT --to-destination 10.244.0.7:40001")
    assert host[0].endswith("-j DNAT --to-destination 10.244.0.7:40001")


def test_udp_ports_match_udp() -> None:
    dns = ServicePortName("kube-system", "dns", "dns", Protocol.UDP)
    (line,) = lines([port(name=dns, svc_port=53)], chain=CONTAINER_PORTALS)
    assert "-p udp -m comment" in line and "-m udp --dport 53" in line


def test_every_rule_carries_the_service_port_name_as_comment() -> None:
    ports = [port(node_port=30080, external_ips=("192.0.2.5",), lb_ips=("198.51.100.7",))]
    for rule in services_rules(ports):
        assert '--comment "default/web:http"' in rule.line


def test_port_without_a_proxy_port_gets_no_rules() -> None:
    rules = render([port(cluster_port=0, external_port=0, node_port=30080)], NODE)
    assert all(r.is_jump for r in rules)


def test_external_paths_go_to_the_external_port() -> None:
    p = port(node_port=30080, external_ips=("192.0.2.5",), lb_ips=("198.51.100.7",))
    p = ProxiedPort(p.info, 40001, 40002)
    for rule in services_rules([p]):
        if base_chain(rule.chain) == PROXY_PORTS:  # the guard covers both ports
            continue
        cluster = rule.dst == "10.96.0.10/32"
        expected = 40001 if cluster else 40002
        assert (rule.to_port if rule.table == "nat" else rule.dport) == expected, rule.line


def test_load_balancer_ips_are_treated_like_cluster_ips() -> None:
    rules = lines([port(lb_ips=("198.51.100.7",))])
    lb = [line for line in rules if "198.51.100.7" in line]
    assert len(lb) == 2
    assert "-A KUBE-PORTALS-CONTAINER" in lb[0] and "REDIRECT --to-ports 40001" in lb[0]
    assert "-A KUBE-PORTALS-HOST" in lb[1] and "physdev" not in lb[1] and "addrtype" not in lb[1]


def test_external_ips_get_the_physdev_and_local_variants() -> None:
    ext = [line for line in lines([port(external_ips=("192.0.2.5",))]) if "192.0.2.5" in line]
    assert ext == [
        '-A KUBE-PORTALS-CONTAINER -d 192.0.2.5/32 -p tcp -m comment --comment "default/web:http"'
        " -m tcp --dport 80 -m physdev ! --physdev-is-in -j REDIRECT --to-ports 40001",
        '-A KUBE-PORTALS-CONTAINER -d 192.0.2.5/32 -p tcp -m comment --comment "default/web:http"'
        " -m tcp --dport 80 -m addrtype --dst-type LOCAL -j REDIRECT --to-ports 40001",
        '-A KUBE-PORTALS-HOST -d 192.0.2.5/32 -p tcp -m comment --comment "default/web:http"'
        " -m tcp --dport 80 -m addrtype --dst-type LOCAL -j DNAT --to-destination"
        " 10.244.0.1:40001",
    ]


def test_without_physdev_external_ips_are_captured_unconditionally() -> None:
    s = Settings(node_ips=("10.244.0.1",), physdev=False)
    ext = [line for line in lines([port(external_ips=("192.0.2.5",))], s) if "192.0.2.5" in line]
    assert len(ext) == 3
    assert not any("physdev" in line for line in ext)
    assert ext[0].endswith("--dport 80 -j REDIRECT --to-ports 40001")


def test_node_port_rules_match_the_node_port_on_any_local_address() -> None:
    rules = lines([port(node_port=30080)])
    assert [line for line in rules if CONTAINER_NODEPORTS in line.split()[1]] == [
        '-A KUBE-NODEPORT-CONTAINER -p tcp -m comment --comment "default/web:http"'
        " -m tcp --dport 30080 -j REDIRECT --to-ports 40001"
    ]
    assert [line for line in rules if line.startswith(f"-A {HOST_NODEPORTS} ")] == [
        '-A KUBE-NODEPORT-HOST -p tcp -m comment --comment "default/web:http"'
        " -m tcp --dport 30080 -j DNAT --to-destination 10.244.0.1:40001"
    ]
    assert [line for line in rules if line.startswith(f"-A {NON_LOCAL_NODEPORTS} ")] == [
        '-A KUBE-NODEPORT-NON-LOCAL -p tcp -m comment --comment "default/web:http"'
        " -m tcp --dport 40001 -m state --state NEW -m conntrack --ctstate DNAT -j ACCEPT"
    ]


def test_nodeport_addresses_restrict_node_ports_to_matching_local_addresses() -> None:
    s = Settings(node_ips=("10.244.0.1",), nodeport_addresses=("10.244.0.0/24", "fd00::/64"))
    container = lines([port(node_port=30080)], s, CONTAINER_NODEPORTS)
    assert container == [
        "-A KUBE-NODEPORT-CONTAINER -d 10.244.0.0/24 -p tcp -m comment --comment"
        ' "default/web:http" -m tcp --dport 30080 -j REDIRECT --to-ports 40001'
    ]


def test_nodeport_addresses_of_the_other_family_only_leave_no_node_port_rules() -> None:
    s = Settings(node_ips=("10.244.0.1",), nodeport_addresses=("fd00::/64",))
    rules = render([port(node_port=30080)], s)
    assert not [r for r in rules if r.chain in (CONTAINER_NODEPORTS, NON_LOCAL_NODEPORTS)]


def test_jumps_lead_into_our_chains_in_kube_proxy_order() -> None:
    jumps = [r for r in render([], NODE) if r.is_jump]
    assert [(r.table, r.chain, r.target, r.prepend) for r in jumps] == [
        ("nat", "PREROUTING", CONTAINER_PORTALS, True),
        ("nat", "OUTPUT", HOST_PORTALS, True),
        ("nat", "PREROUTING", CONTAINER_NODEPORTS, False),
        ("nat", "OUTPUT", HOST_NODEPORTS, False),
        ("filter", "INPUT", NON_LOCAL_NODEPORTS, True),
        ("filter", "INPUT", PROXY_PORTS, True),
    ]
    assert jumps[2].line == (
        '-A PREROUTING -m comment --comment "handle service NodePorts; NOTE: this must be the'
        ' last rule in the chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORT-CONTAINER'
    )


def test_ipv6_cluster_ips_render_for_ip6tables() -> None:
    s = Settings(node_ips=("10.244.0.1", "fd00::1"), bind_address="::")
    rules = list(render([port(cluster_ips=("10.96.0.10", "fd00:96::10"))], s))
    v6 = [
        f"-A {base_chain(r.chain)} {r.spec}"
        for r in rules
        if r.family == 6 and not r.to_chain and r.table == "nat"
    ]
    assert v6 == [
        "-A KUBE-PORTALS-CONTAINER -d fd00:96::10/128 -p tcp -m comment --comment"
        ' "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 40001',
        '-A KUBE-PORTALS-HOST -d fd00:96::10/128 -p tcp -m comment --comment "default/web:http"'
        " -m tcp --dport 80 -j DNAT --to-destination [fd00::1]:40001",
    ]
    assert {r.family for r in rules if r.is_jump} == {4, 6}


def test_default_bind_address_renders_no_ipv6_rules() -> None:
    # 0.0.0.0 is an IPv4 socket: IPv6 clients redirected to it would be refused.
    s = Settings(node_ips=("10.244.0.1", "fd00::1"), bind_address="0.0.0.0")
    dual = port(cluster_ips=("10.96.0.10", "fd00:96::10"), node_port=30080)
    rules = render([dual], s, families={4, 6})
    assert {r.family for r in rules} == {4}
    assert [r for r in rules if r.dst == "10.96.0.10/32"]


def test_unspecified_ipv6_bind_address_serves_both_families() -> None:
    s = Settings(node_ips=("10.244.0.1", "fd00::1"), bind_address="::")
    rules = render([port(cluster_ips=("10.96.0.10", "fd00:96::10"), node_port=30080)], s)
    for family in (4, 6):
        mine = [r for r in rules if r.family == family and not r.to_chain]
        assert {base_chain(r.chain) for r in mine} == {
            *CHAINS["nat"][:4],
            NON_LOCAL_NODEPORTS,
            PROXY_PORTS,
        }
        assert all(r.target != "DNAT" or r.to_addr in s.node_ips for r in mine)
        assert all(
            r.target != "REDIRECT" or base_chain(r.chain).endswith("-CONTAINER") for r in mine
        )


def test_specific_ipv6_bind_address_serves_ipv6_only() -> None:
    s = Settings(node_ips=("10.244.0.1", "fd00::1"), bind_address="fd00::7")
    rules = render([port(cluster_ips=("10.96.0.10", "fd00:96::10"))], s, families={4, 6})
    assert {r.family for r in rules} == {6}
    assert lines([port(cluster_ips=("10.96.0.10", "fd00:96::10"))], s, CONTAINER_PORTALS) == [
        "-A KUBE-PORTALS-CONTAINER -d fd00:96::10/128 -p tcp -m comment --comment"
        ' "default/web:http" -m tcp --dport 80 -j DNAT --to-destination [fd00::7]:40001'
    ]


def nat_families(rules: list[Rule]) -> set[int]:
    return {r.family for r in rules if r.table == "nat" and not r.is_jump}


def test_unspecified_bind_address_follows_the_node_families() -> None:
    # As kube-proxy: the families the node has addresses in, whatever the sockets take.
    dual = [port(cluster_ips=("10.96.0.10", "fd00:96::10"), node_port=30080)]
    both = Settings(("10.244.0.1", "fd00::1"), "::", node_families=frozenset({4}))
    assert nat_families(render(dual, both)) == {4, 6}  # the node IPs, once known
    v4_node = Settings(("10.244.0.1",), "::", node_families=frozenset({4, 6}))
    assert nat_families(render(dual, v4_node, families={4, 6})) == {4}
    assert v4_node.left_out(6) == (
        "the node has no IPv6 address (node IPs: 10.244.0.1; see --node-ip)"
    )
    assert v4_node.left_out(4) == ""
    v6_node = Settings(("fd00::1",), "::", node_families=frozenset({4, 6}))
    assert nat_families(render(dual, v6_node, families={4, 6})) == {6}
    # No node IP known yet: the families the host had addresses in at start.
    unknown = Settings((), "0.0.0.0", node_families=frozenset({4}))
    assert nat_families(render(dual, unknown, families={4, 6})) == {4}
    assert "none known" in unknown.left_out(6)
    # The node has IPv6 but the sockets do not take it (0.0.0.0): said, not rendered.
    late = Settings(("10.244.0.1", "fd00::1"), "0.0.0.0", node_families=frozenset({4}))
    assert nat_families(render(dual, late, families={4, 6})) == {4}
    assert late.left_out(6).startswith("the proxy ports listen on 0.0.0.0 (IPv4 only)")
    # An explicit bind address keeps its meaning and its advice.
    explicit = Settings(("10.244.0.1", "fd00::1"), "0.0.0.0")
    assert explicit.left_out(6).endswith("use --bind-address :: for dual stack")


def test_proxy_ports_are_guarded_in_every_family_their_sockets_take() -> None:
    # A v4-only node whose ports are dual-stack sockets still refuses IPv6 to them.
    v4_node = Settings(("10.244.0.1",), "::", node_families=frozenset({4, 6}))
    guards = render([port(cluster_ips=("10.96.0.10",))], v4_node)
    assert {r.family for r in guards if base_chain(r.chain) == PROXY_PORTS} == {4, 6}


def test_cluster_ips_of_an_unserved_family_are_reported_once_rendered() -> None:
    dual = port(cluster_ips=("10.96.0.10", "fd00:96::10"))
    desired = Desired(NODE)
    desired.update([dual, port(name=ServicePortName("default", "v4"))])
    assert desired.skipped == [(WEB, "fd00:96::10")]
    desired.update([ProxiedPort(dual.info, dual.cluster_port, dual.external_port)])
    assert desired.skipped == []  # not rendered again: the caller has been told already


def test_external_ips_of_a_family_the_service_lacks_are_ignored() -> None:
    rules = lines([port(external_ips=("2001:db8::5",))])
    assert not [line for line in rules if "2001:db8" in line]


def test_no_node_ip_means_no_host_rules() -> None:
    rules = render([port(node_port=30080)], Settings())
    assert not [r for r in rules if r.chain in (HOST_PORTALS, HOST_NODEPORTS)]
    assert [r for r in rules if r.chain == CONTAINER_PORTALS]


def test_duplicate_rules_are_rendered_once() -> None:
    a = port(external_ips=("192.0.2.5",))
    b = port(name=ServicePortName("default", "web"), external_ips=("192.0.2.5",))
    rules = render([a, a, b], NODE)
    assert len(set(rules)) == len(rules)


def test_explain_pairs_each_save_line_with_an_explanation() -> None:
    pairs = explain([port(node_port=30080)], node_ips=("10.244.0.1",))
    assert all(line.startswith("-A ") and why for line, why in pairs)
    whys = dict(pairs)
    redirect = next(line for line, _ in pairs if "REDIRECT" in line and "10.96.0.10" in line)
    assert "from pods" in whys[redirect] and "40001" in whys[redirect]
    accept = next(line for line, _ in pairs if "ACCEPT" in line)
    assert whys[accept].startswith("filter table: ")


@pytest.mark.parametrize(
    "s",
    [NODE, replace(NODE, bind_address="10.244.0.1"), replace(NODE, physdev=False)],
    ids=["redirect", "bind-address", "no-physdev"],
)
def test_the_rules_a_sync_keeps_are_the_explained_ones_without_their_explanations(
    s: Settings,
) -> None:
    # A sync renders no explanations (they were megabytes at 10,000 Services); what it
    # commits must still be, rule for rule, what `explain` shows.
    ports = [
        port(node_port=30080, external_ips=("192.0.2.5",), lb_ips=("198.51.100.7",)),
        port(name=ServicePortName("default", "dns", "dns", Protocol.UDP), cluster_port=40002),
        port(name=ServicePortName("default", "split"), cluster_port=40003, external_port=40004,
             node_port=30081, cluster_ips=("10.96.0.11",)),
    ]  # fmt: skip
    kept = render(ports, s)
    explained = render(ports, s, explained=True)
    assert [(r.family, r.table, r.line) for r in kept] == [
        (r.family, r.table, r.line) for r in explained
    ]
    ours = [r for r in explained if not r.to_chain]
    assert len(ours) > 12 and all(r.why for r in ours)
    # The guards, merged into a few ranges, keep theirs.
    assert not [r for r in kept if not r.to_chain and r.why and r.target != "REJECT"]


# ---- planning ---------------------------------------------------------------------------


class FakeTable:
    """Executes plan ops like a kernel table would; fingerprints are the rules themselves."""

    def __init__(self, table: str) -> None:
        self.table = table
        self.chains: dict[str, list[Rule]] = {"PREROUTING": [], "OUTPUT": [], "INPUT": []}

    def view(self) -> plan.TableView:
        fps: dict[str, Hashable] = {
            c: tuple(rules) for c, rules in self.chains.items() if is_ours(self.table, c)
        }
        jumps = tuple(
            plan.Found(c, r.target, i, r.spec)
            for c in ("PREROUTING", "OUTPUT", "INPUT")
            for i, r in enumerate(self.chains[c])
            if is_ours(self.table, r.target)
        )
        return plan.TableView(fps, jumps)

    def run(self, ops: Sequence[plan.Op]) -> None:
        for op in ops:
            if isinstance(op, plan.ResetChain):
                self.chains[op.chain] = []
            elif isinstance(op, plan.DropChain):
                del self.chains[op.chain]
            elif isinstance(op, plan.Append):
                self.chains[op.rule.chain].append(op.rule)
            elif isinstance(op, plan.Prepend):
                self.chains[op.rule.chain].insert(0, op.rule)
            else:
                removed = self.chains[op.chain].pop(op.index)
                assert removed.spec == op.spec


def sync(
    table: FakeTable,
    want: plan.TableRules,
    state: dict[str, object] | None,
    *,
    defer: bool = False,
) -> tuple[plan.Plan, dict[str, object]]:
    view = table.view()
    if state is None:
        step = plan.replace_all(want, view)
    else:
        applied, fps = state["chains"], state["fps"]
        step = plan.update(want, view, applied, fps, defer=defer)  # type: ignore[arg-type]
    table.run(step.ops)
    return step, {"chains": step.chains, "fps": dict(table.view().chains)}


def nat(ports: Sequence[ProxiedPort]) -> plan.TableRules:
    return plan.group(render(ports, NODE))[(4, "nat")]


def filter_table(ports: Sequence[ProxiedPort]) -> plan.TableRules:
    return plan.group(render(ports, NODE))[(4, "filter")]


def match(rule: Rule) -> str:
    """The rule's text before its target: which packets it takes."""
    return rule.spec.rpartition(" -j ")[0]


def takes_as_wanted(table: FakeTable, want: plan.TableRules) -> bool:
    """Every packet meets the rule `want` has for it: in each chain, the first rule with a
    wanted rule's match is that rule, and (nat) every other rule is behind a wanted one with
    its match (shadowed). Filter may keep rules of released ports (`plan._can_wait`), and a
    guard shard only has to refuse every port a wanted guard range refuses (the halves of a
    split range wait with the old range's delete: `plan._covered_guards`)."""
    for chain, rules in want.chains.items():
        if base_chain(chain) == PROXY_PORTS:
            if not refused(rules) <= refused(table.chains[chain]):
                return False
            continue
        first: dict[str, Rule] = {}
        for r in table.chains[chain]:
            first.setdefault(match(r), r)
        if any(first.get(match(r)) != r for r in rules):
            return False
        wanted = set(rules)
        if table.table == "nat" and any(first[match(r)] not in wanted for r in first.values()):
            return False
    return True


def refused(rules: Iterable[Rule]) -> set[tuple[str, int]]:
    """(protocol, port) of every port the guard rules among `rules` refuse."""
    return {
        (r.protocol, p)
        for r in rules
        if r.target == "REJECT"
        for p in range(r.dport, (r.dport_hi or r.dport) + 1)
    }


def services(indexes: Sequence[int], proxy_base: int = 40000) -> list[ProxiedPort]:
    return [
        port(
            name=ServicePortName("ns", f"svc{i}", "p"),
            cluster_ips=(f"10.96.0.{i + 1}",),
            node_port=30000 + i if i % 3 == 0 else 0,
            cluster_port=proxy_base + i,
        )
        for i in indexes
    ]


def holds(table: FakeTable, want: plan.TableRules) -> bool:
    for chain, rules in want.chains.items():
        if sorted(table.chains[chain], key=lambda r: r.line) != sorted(rules, key=lambda r: r.line):
            return False
    jumps = [(c, r.target) for c in ("PREROUTING", "OUTPUT", "INPUT") for r in table.chains[c]]
    return sorted(jumps) == sorted((j.chain, j.target) for j in want.jumps)


@settings(max_examples=60, deadline=None)
@given(
    st.sets(st.integers(0, 40), max_size=25),
    st.sets(st.integers(0, 40), max_size=25),
    st.integers(0, 2),
)
def test_update_from_a_to_b_leaves_exactly_b(a: set[int], b: set[int], shift: int) -> None:
    table = FakeTable("nat")
    _, state = sync(table, nat(services(sorted(a))), None)
    want = nat(services(sorted(b), proxy_base=40000 + shift))
    step, state = sync(table, want, state)
    assert holds(table, want)
    assert step.repaired == []
    assert step.deferred == 0
    assert {c: list(r) for c, r in step.chains.items()} == {
        c: rules for c, rules in table.chains.items() if is_ours("nat", c)
    }


@settings(max_examples=80, deadline=None)
@given(
    st.sets(st.integers(0, 40), max_size=25),
    st.sets(st.integers(0, 40), max_size=25),
    st.sets(st.integers(0, 40), max_size=10),
    st.sampled_from(["nat", "filter"]),
)
def test_a_deferred_update_is_live_at_once_and_its_second_commit_leaves_exactly_b(
    a: set[int], b: set[int], moved: set[int], name: str
) -> None:
    def rules(indexes: set[int]) -> plan.TableRules:
        ports = [services([i], proxy_base=41000 if i in moved else 40000)[0] for i in indexes]
        return (nat if name == "nat" else filter_table)(sorted(ports, key=lambda p: p.info.name))

    table = FakeTable(name)
    _, state = sync(table, rules(a), None)
    want = rules(b)
    step, state = sync(table, want, state, defer=True)
    # The first commit: every packet already meets the wanted rules, and what the plan
    # recorded is what the table holds, stale rules in their places.
    assert takes_as_wanted(table, want)
    assert step.repaired == []
    assert {c: list(r) for c, r in step.chains.items()} == {
        c: rules for c, rules in table.chains.items() if is_ours(name, c)
    }
    # The second, without deferral: only deletes (and the halves of split guard ranges, which
    # the deleted ranges covered until now), and then exactly b.
    second, _ = sync(table, want, state)
    assert all(
        isinstance(op, plan.Delete)
        or (isinstance(op, plan.Append) and base_chain(op.rule.chain) == PROXY_PORTS)
        for op in second.ops
    )
    assert len(second.ops) == step.deferred
    assert second.deferred == 0
    assert holds(table, want)
    assert {c: list(r) for c, r in second.chains.items()} == {
        c: rules for c, rules in table.chains.items() if is_ours(name, c)
    }


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sets(st.integers(0, 30), max_size=15), min_size=2, max_size=5))
def test_deferred_deletes_left_behind_by_failed_second_commits_go_with_a_later_one(
    states: list[set[int]],
) -> None:
    # Each state moves every port to the proxy ports of its round; no second commit runs
    # until the end: the stale rules pile up, and one commit without deferral removes them.
    table = FakeTable("nat")
    _, state = sync(table, nat(services(sorted(states[0]))), None)
    want = nat([])
    for round_, indexes in enumerate(states[1:], 1):
        want = nat(services(sorted(indexes), proxy_base=40000 + 100 * round_))
        _, state = sync(table, want, state, defer=True)
        assert takes_as_wanted(table, want)
    sync(table, want, state)
    assert holds(table, want)


def test_an_unchanged_state_plans_nothing() -> None:
    table = FakeTable("nat")
    want = nat(services(range(5)))
    _, state = sync(table, want, None)
    step, _ = sync(table, want, state)
    assert step.ops == []


def test_one_moved_port_plans_its_new_rules_at_the_head_of_their_chains() -> None:
    table = FakeTable("nat")
    _, state = sync(table, nat(services(range(50))), None)
    changed = services(range(49)) + services([49], proxy_base=41000)
    step, _ = sync(table, nat(changed), state)
    kinds = sorted(type(op).__name__ for op in step.ops)
    assert kinds == ["Delete", "Delete", "Prepend", "Prepend"]
    for op in step.ops:
        if isinstance(op, plan.Prepend):
            assert table.chains[op.rule.chain][0] == op.rule


def test_a_deferred_move_commits_its_inserts_first_and_its_deletes_second() -> None:
    table = FakeTable("nat")
    _, state = sync(table, nat(services(range(50))), None)
    changed = services(range(49)) + services([49], proxy_base=41000)
    step, state = sync(table, nat(changed), state, defer=True)
    assert [type(op).__name__ for op in step.ops] == ["Prepend", "Prepend"]
    assert step.deferred == 2
    old = [r for r in services_rules(services([49])) if r.table == "nat"]
    new = [r for r in services_rules(changed[-1:]) if r.table == "nat"]
    for stale, replacement in zip(old, new, strict=True):  # each still held, shadowed
        assert table.chains[stale.chain][:1] == [replacement]
        assert stale in table.chains[stale.chain]
    second, _ = sync(table, nat(changed), state)
    assert sorted((type(op).__name__, op.spec) for op in second.ops) == sorted(  # type: ignore[union-attr]
        ("Delete", r.spec) for r in old
    )


def test_a_removed_service_port_is_deleted_at_once_from_nat_and_later_from_filter() -> None:
    with_node_port = services(range(4))  # 0 and 3 have NodePorts: an ACCEPT in filter too
    kept = with_node_port[1:]
    tables = {"nat": FakeTable("nat"), "filter": FakeTable("filter")}
    for name, table in tables.items():
        pick = nat if name == "nat" else filter_table
        _, state = sync(table, pick(with_node_port), None)
        step, _ = sync(table, pick(kept), state, defer=True)
        if name == "nat":  # nothing shadows them: a removed Service's rules go at once
            assert step.deferred == 0
            assert sum(isinstance(op, plan.Delete) for op in step.ops) == 4
        else:  # its guard and its NodePort ACCEPT harm nothing until the second commit
            assert step.ops == []
            # The ACCEPT's delete, and the guard range 40000-40003's delete with the add of
            # 40001-40003 that replaces it (the old range refuses those ports until then).
            assert step.deferred == 3
            held = step.chains[f"{PROXY_PORTS}-9C"]
            assert [r.spec.split(" -j ")[0].split()[-1] for r in held] == ["40000:40003"]


def test_a_moved_port_sharing_its_address_and_port_with_another_service_is_appended() -> None:
    # Two Services claim 10.96.0.9:80: the first in name order takes the packets. Moving the
    # second must not put its rules ahead of the first's.
    a = port(name=ServicePortName("ns", "a", "p"), cluster_ips=("10.96.0.9",), cluster_port=40001)
    b = port(name=ServicePortName("ns", "b", "p"), cluster_ips=("10.96.0.9",), cluster_port=40002)
    table = FakeTable("nat")
    _, state = sync(table, nat([a, b]), None)
    step, _ = sync(table, nat([a, replace(b, cluster_port=40003)]), state, defer=True)
    assert step.deferred == 0
    assert sorted(type(op).__name__ for op in step.ops) == ["Append", "Append", "Delete", "Delete"]
    for chain in (c for c in table.chains if c.startswith(f"{CONTAINER_PORTALS}-")):
        assert [r.comment for r in table.chains[chain]] == ["ns/a:p", "ns/b:p"]


def test_the_first_sync_replaces_rules_an_earlier_run_left() -> None:
    table = FakeTable("nat")
    sync(table, nat(services(range(5))), None)
    table.chains["PREROUTING"].append(table.chains["PREROUTING"][0])  # a duplicated jump
    want = nat(services([7]))
    sync(table, want, None)
    assert holds(table, want)


def test_a_flushed_chain_is_rewritten_and_reported() -> None:
    table = FakeTable("nat")
    want = nat(services(range(5)))
    _, state = sync(table, want, None)
    table.chains[HOST_PORTALS] = []
    step, _ = sync(table, want, state)
    assert step.repaired == [HOST_PORTALS]
    assert holds(table, want)


def test_a_deleted_jump_is_put_back_at_the_head() -> None:
    table = FakeTable("nat")
    want = nat(services(range(2)))
    _, state = sync(table, want, None)
    foreign = Rule(4, "nat", "PREROUTING", "ACCEPT", "someone else")
    table.chains["PREROUTING"] = [foreign, *table.chains["PREROUTING"][1:]]
    step, _ = sync(table, want, state)
    assert step.repaired == ["PREROUTING -> KUBE-PORTALS-CONTAINER"]
    assert [r.target for r in table.chains["PREROUTING"]] == [
        CONTAINER_PORTALS,
        "ACCEPT",
        CONTAINER_NODEPORTS,
    ]


def test_node_port_jump_before_portal_jump_is_reordered() -> None:
    table = FakeTable("nat")
    want = nat(services(range(2)))
    _, state = sync(table, want, None)
    table.chains["PREROUTING"].reverse()
    sync(table, want, state)
    assert [r.target for r in table.chains["PREROUTING"]] == [
        CONTAINER_PORTALS,
        CONTAINER_NODEPORTS,
    ]


def test_cleanup_removes_jumps_then_chains() -> None:
    table = FakeTable("nat")
    sync(table, nat(services(range(3))), None)
    foreign = Rule(4, "nat", "PREROUTING", "ACCEPT", "someone else")
    table.chains["PREROUTING"].insert(1, foreign)
    table.run(plan.cleanup("nat", table.view()))
    assert table.chains == {"PREROUTING": [foreign], "OUTPUT": [], "INPUT": []}


def test_cleanup_keeps_a_chain_that_a_foreign_chain_jumps_to() -> None:
    view = plan.TableView({CONTAINER_PORTALS: ()}, (), frozenset({CONTAINER_PORTALS}))
    assert plan.cleanup("nat", view) == [plan.ResetChain(CONTAINER_PORTALS)]


class MemoryBackend:
    """A Backend whose tables are FakeTables: Portals' own logic without a kernel."""

    name = mode = "memory"
    defers_deletes = True

    def __init__(self) -> None:
        self.held: dict[tuple[Family, str], FakeTable] = {}
        self.reads = self.glances = 0
        self.inputs: list[str] = []
        """What each commit would have handed to iptables-restore."""

    def locked(self, family: Family) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def tables(self, family: Family) -> frozenset[str]:
        return frozenset(t for f, t in self.held if f == family)

    def read(self, family: Family, table: str) -> plan.TableView:
        self.reads += 1
        return self.held.setdefault((family, table), FakeTable(table)).view()

    def glance(self, family: Family, table: str, believed: plan.TableView) -> plan.TableView:
        self.glances += 1
        seen = self.held.setdefault((family, table), FakeTable(table)).view()
        chains = {c: fp for c, fp in believed.chains.items() if c not in CHAINS[table]}
        chains.update({c: fp for c, fp in seen.chains.items() if c in CHAINS[table]})
        return plan.TableView(chains, seen.jumps, believed.referenced)

    def saved(self, family: Family, table: str) -> dict[str, tuple[str, ...]]:
        held = self.held.get((family, table))
        if held is None:
            return {}
        return {
            c: tuple(r.spec for r in rules) for c, rules in held.chains.items() if is_ours(table, c)
        }

    def commit(
        self,
        family: Family,
        table: str,
        ops: Sequence[plan.Op],
        base: plan.TableView | None = None,
    ) -> None:
        self.inputs.append(restore_text(table, ops))
        self.held.setdefault((family, table), FakeTable(table)).run(ops)


def test_skipped_ipv6_cluster_ip_is_warned_about_once_per_service_port(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("kube_userspace_proxy")
    logger.addHandler(caplog.handler)
    try:
        portals = Portals(MemoryBackend(), node_ips=("10.244.0.1", "fd00::1"), physdev=True)
        dual = port(cluster_ips=("10.96.0.10", "fd00:96::10"))
        portals.apply([dual])
        portals.apply([dual, port(name=ServicePortName("default", "v4"))])
        portals.apply([replace(dual, cluster_port=40002, external_port=40002)])
    finally:
        logger.removeHandler(caplog.handler)
    warnings = {(id(r), r.getMessage()) for r in caplog.records if r.levelno == logging.WARNING}
    assert [m for _, m in warnings] == [
        "default/web:http: no rules for its IPv6 ClusterIP fd00:96::10: the proxy ports listen"
        " on 0.0.0.0 (IPv4 only); use --bind-address :: for dual stack"
    ]


def test_ipv6_rules_of_a_run_with_bind_address_any6_go_when_restarted_with_0_0_0_0() -> None:
    backend = MemoryBackend()
    dual = port(cluster_ips=("10.96.0.10", "fd00:96::10"), node_port=30080)
    for bind in ("::", "0.0.0.0"):
        portals = Portals(
            backend, node_ips=("10.244.0.1", "fd00::1"), bind_address=bind, physdev=True
        )
        portals.apply([dual])
        held = {key: [r for c in t.chains.values() for r in c] for key, t in backend.held.items()}
        assert held[(4, "nat")] and held[(4, "filter")]
        assert bool(held[(6, "nat")]) == bool(held[(6, "filter")]) == (bind == "::")


def held_rules(backend: MemoryBackend) -> dict[tuple[Family, str, str], list[str]]:
    """Each chain's rules, sorted (a moved port's rules lead their chains; order within a
    chain changes no packet's fate unless two Services claim one address and port)."""
    return {
        (family, table, chain): sorted(r.line for r in rules)
        for (family, table), held in backend.held.items()
        for chain, rules in held.chains.items()
        if rules
    }


def test_a_move_goes_live_with_inserts_alone_and_commit_deferred_deletes_the_rest() -> None:
    backend = MemoryBackend()
    portals = Portals(backend, node_ips=("10.244.0.1",), physdev=True, verify_period=0.0)
    before = services(range(30))
    portals.apply(before)
    # 29 (no NodePort) moves to 40129, in the filter shard of its old port 40029.
    moved = [*before[:29], services([29], proxy_base=40100)[0]]
    first = len(backend.inputs)
    portals.apply(moved)
    inserts = [line for text in backend.inputs[first:] for line in text.splitlines()]
    # nat: the ClusterIP's two rules, inserted; filter: the new port's guard, appended.
    assert sorted(line.split()[0] for line in inserts if line.startswith("-")) == [
        "-A",
        "-I",
        "-I",
    ]
    assert all("40129" in line for line in inserts if line.startswith("-"))
    # The stale rules are what the last commit left: a full read sees no tampering.
    portals.apply(moved)
    assert portals.repairs == 0
    first = len(backend.inputs)
    portals.commit_deferred()
    deletes = [line for text in backend.inputs[first:] for line in text.splitlines()]
    # nat: the two old rules; filter: the guard range 40000-40029 gives way to 40000-40028
    # (until this commit, the old range refused its ports).
    assert sorted(line.split()[0] for line in deletes if line.startswith("-")) == [
        "-A",
        *["-D"] * 3,
    ]
    assert all("40029" in line for line in deletes if line.startswith("-D"))
    assert [line for line in deletes if line.startswith("-A")] == [
        '-A KUBE-PROXY-PORTS-9C -p tcp -m comment --comment "proxy ports 40000-40028" -m tcp'
        " --dport 40000:40028 -j REJECT --reject-with tcp-reset"
    ]
    assert "*filter" in deletes  # the released port's guard, left for this commit
    commits = portals.commits
    portals.commit_deferred()  # nothing waits any more
    assert portals.commits == commits
    fresh = MemoryBackend()
    Portals(fresh, node_ips=("10.244.0.1",), physdev=True).apply(moved)
    assert held_rules(backend) == held_rules(fresh)


def test_a_failed_deferred_commit_is_replaced_and_leaves_exactly_the_wanted_rules() -> None:
    class FailingOnce(MemoryBackend):
        failures = 1

        def commit(
            self,
            family: Family,
            table: str,
            ops: Sequence[plan.Op],
            base: plan.TableView | None = None,
        ) -> None:
            if self.failures and all(isinstance(op, plan.Delete) for op in ops):
                self.failures -= 1
                raise PortalsError("iptables-restore: injected")
            super().commit(family, table, ops, base)

    backend = FailingOnce()
    portals = Portals(backend, node_ips=("10.244.0.1",), physdev=True)
    before = services(range(10))
    portals.apply(before)
    moved = [*before[:9], services([9], proxy_base=41000)[0]]
    portals.apply(moved)
    portals.commit_deferred()
    assert backend.failures == 0
    fresh = MemoryBackend()
    Portals(fresh, node_ips=("10.244.0.1",), physdev=True).apply(moved)
    assert held_rules(backend) == held_rules(fresh)


# ---- proxy ports claimed by installed rules -----------------------------------------------


def saved(rules: Sequence[Rule]) -> list[tuple[str, str]]:
    """(chain, spec) of our chains' rules, as a backend's `saved` gives them."""
    return [(r.chain, r.spec) for r in rules if not r.to_chain]


def test_claimed_ports_are_read_back_from_rendered_rules() -> None:
    dns = ServicePortName("kube-system", "dns", "dns", Protocol.UDP)
    ports = [
        port(),
        port(name=dns, cluster_ips=("10.96.0.53",), cluster_port=40010, svc_port=53),
        port(name=ServicePortName("default", "np"), node_port=30080, cluster_port=40020),
        port(
            name=ServicePortName("default", "split", "https"),
            cluster_ips=("10.96.0.30", "fd00:96::30"),
            node_port=30443,
            external_ips=("192.0.2.30",),
            lb_ips=("198.51.100.30", "2001:db8::30"),
            cluster_port=40030,
            external_port=40031,
        ),
    ]
    s = Settings(node_ips=("10.244.0.1", "fd00::1"), bind_address="::")
    assert claimed(saved(render(ports, s))) == {
        ("default/web:http", "TCP", "cluster"): 40001,
        ("kube-system/dns:dns", "UDP", "cluster"): 40010,
        ("default/np", "TCP", "cluster"): 40020,
        ("default/np", "TCP", "external"): 40020,
        ("default/split:https", "TCP", "cluster"): 40030,
        ("default/split:https", "TCP", "external"): 40031,
    }


def test_claimed_ports_of_dnat_rules_to_a_bind_address() -> None:
    split = port(node_port=30080, cluster_port=40001, external_port=40002)
    for bind, ips in (("10.244.0.7", ("10.96.0.10",)), ("fd00::7", ("fd00:96::10",))):
        rules = render(
            [replace(split, info=replace(split.info, cluster_ips=ips))], Settings((), bind)
        )
        assert {r.target for r in rules if base_chain(r.chain) == CONTAINER_PORTALS} >= {"DNAT"}
        assert {r.target for r in rules if r.chain.startswith(CONTAINER_PORTALS + "-")} == {"DNAT"}
        assert claimed(saved(rules)) == {
            ("default/web:http", "TCP", "cluster"): 40001,
            ("default/web:http", "TCP", "external"): 40002,
        }


def test_external_port_is_known_by_its_rule_kind_not_its_position() -> None:
    # An incremental sync appends changed rules: the ClusterIP rule may come last.
    split = port(external_ips=("192.0.2.5",), lb_ips=("198.51.100.7",), external_port=40002)
    rules = list(reversed(saved(render([split], NODE))))
    assert claimed(rules) == {
        ("default/web:http", "TCP", "cluster"): 40001,
        ("default/web:http", "TCP", "external"): 40002,
    }


def test_a_load_balancer_without_node_port_takes_the_first_port_as_the_cluster_port() -> None:
    # Nothing in the rules tells a LoadBalancer IP's from a ClusterIP's: the first in kernel
    # order (the lower shard, here the ClusterIP's .10 before the LoadBalancer's .70) wins.
    split = port(lb_ips=("198.51.100.70",), external_port=40002)
    assert claimed(saved(render([split], NODE))) == {
        ("default/web:http", "TCP", "cluster"): 40001,
        ("default/web:http", "TCP", "external"): 40002,
    }


def test_claimed_ports_ignore_foreign_rules_and_read_unquoted_comments() -> None:
    rules = [
        (CONTAINER_PORTALS, "-p tcp -m tcp --dport 9999 -m comment --comment foreign -j RETURN"),
        (HOST_PORTALS, '-d 10.96.0.9/32 -p tcp -m comment --comment "a/b" -j DNAT'
         " --to-destination 10.244.0.1:40005"),
        (CONTAINER_PORTALS, "-d 10.96.0.9/32 -p udp -m comment --comment ns_x -m udp"
         " --dport 53 -j REDIRECT --to-ports 40009"),
    ]  # fmt: skip
    assert claimed(rules) == {("ns_x", "UDP", "cluster"): 40009}


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(list(Protocol)),
            st.booleans(),  # dual stack
            st.sampled_from(["none", "nodeport", "external ip", "load balancer"]),
            st.booleans(),  # paths differ
        ),
        max_size=12,
    )
)
def test_claimed_ports_invert_rendering(
    specs: list[tuple[Protocol, bool, str, bool]],
) -> None:
    ports, expected = [], {}
    for i, (protocol, dual, external, differ) in enumerate(specs):
        name = ServicePortName("ns", f"svc{i}", "p", protocol)
        cluster, ext = 40000 + 2 * i, 40000 + 2 * i + (1 if differ else 0)
        ips = (f"10.96.0.{i + 1}", f"fd00:96::{i + 1}") if dual else (f"10.96.0.{i + 1}",)
        ports.append(
            port(
                name=name,
                cluster_ips=ips,
                node_port=30000 + i if external == "nodeport" else 0,
                external_ips=(f"192.0.2.{i + 1}",) if external == "external ip" else (),
                lb_ips=(f"198.51.100.{i + 1}",) if external == "load balancer" else (),
                cluster_port=cluster,
                external_port=ext,
            )
        )
        expected[(str(name), str(protocol), "cluster")] = cluster
        if external != "none" and (differ or external != "load balancer"):
            expected[(str(name), str(protocol), "external")] = ext
    s = Settings(node_ips=("10.244.0.1", "fd00::1"), bind_address="::")
    assert claimed(saved(render(ports, s))) == expected


def test_a_new_portals_reads_the_ports_an_earlier_one_installed() -> None:
    backend = MemoryBackend()
    split = port(cluster_ips=("10.96.0.10", "fd00:96::10"), node_port=30080, external_port=40002)

    def portals() -> Portals:
        return Portals(backend, node_ips=("10.244.0.1", "fd00::1"), bind_address="::", physdev=True)

    portals().apply([split])
    assert portals().claimed_ports() == {
        ("default/web:http", "TCP", "cluster"): 40001,
        ("default/web:http", "TCP", "external"): 40002,
    }


def test_claimed_ports_are_empty_when_the_tables_cannot_be_read() -> None:
    class Unreadable(MemoryBackend):
        def saved(self, family: Family, table: str) -> dict[str, tuple[str, ...]]:
            raise PortalsError("iptables-save: permission denied")

    assert Portals(Unreadable(), physdev=True).claimed_ports() == {}


# ---- iptables-restore text ----------------------------------------------------------------

SAVED = """# Generated by iptables-save v1.8.9
*nat
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:KUBE-PORTALS-CONTAINER - [0:0]
:FOREIGN - [0:0]
-A PREROUTING -j FOREIGN
-A PREROUTING -m comment --comment "handle ClusterIPs; x" -j KUBE-PORTALS-CONTAINER
-A FOREIGN -m comment --comment "-j KUBE-PORTALS-HOST" -j KUBE-PORTALS-CONTAINER
-A KUBE-PORTALS-CONTAINER -d 10.96.0.10/32 -p tcp -j REDIRECT --to-ports 40001
COMMIT
*filter
:INPUT ACCEPT [0:0]
-A INPUT -j KUBE-PORTALS-CONTAINER
COMMIT
"""


def test_saved_text_is_read_into_fingerprints_jumps_and_references() -> None:
    view = view_of(SAVED, "nat")
    assert view.chains == {
        CONTAINER_PORTALS: ("-d 10.96.0.10/32 -p tcp -j REDIRECT --to-ports 40001",)
    }
    assert view.jumps == (
        plan.Found(
            "PREROUTING",
            CONTAINER_PORTALS,
            1,
            '-m comment --comment "handle ClusterIPs; x" -j KUBE-PORTALS-CONTAINER',
        ),
    )
    assert view.referenced == {CONTAINER_PORTALS}


def test_restore_text_declares_resets_first_and_prepends_with_insert() -> None:
    jump = next(r for r in render([], NODE) if r.target == CONTAINER_PORTALS)
    rule = render([port()], NODE)[-1]
    text = restore_text(
        "nat",
        [
            plan.Delete("PREROUTING", 3, "-j KUBE-PORTALS-CONTAINER"),
            plan.ResetChain(HOST_PORTALS),
            plan.Append(rule),
            plan.Prepend(jump),
            plan.DropChain(HOST_NODEPORTS),
        ],
    )
    assert text.splitlines() == [
        "*nat",
        ":KUBE-PORTALS-HOST - [0:0]",
        "-D PREROUTING -j KUBE-PORTALS-CONTAINER",
        rule.line,
        f"-I PREROUTING 1 {jump.spec}",
        "-F KUBE-NODEPORT-HOST",
        "-X KUBE-NODEPORT-HOST",
        "COMMIT",
    ]


def test_predicted_table_follows_appends_deletes_and_resets() -> None:
    two = [port(), port(name=ServicePortName("default", "b"), cluster_ips=("10.96.0.20",))]
    a, b = (r for r in services_rules(two) if base_chain(r.chain) == CONTAINER_PORTALS)
    view = plan.TableView({CONTAINER_PORTALS: (a.spec, "x"), HOST_PORTALS: ("y",)})
    after = predict(
        view,
        [
            plan.Delete(CONTAINER_PORTALS, 0, a.spec),
            plan.Append(replace(a, chain=CONTAINER_PORTALS)),
            plan.ResetChain(HOST_PORTALS),
            plan.Append(replace(b, chain=HOST_PORTALS)),
        ],
    )
    assert after is not None
    assert after.chains == {CONTAINER_PORTALS: ("x", a.spec), HOST_PORTALS: (b.spec,)}


def test_predicted_table_puts_an_inserted_rule_at_the_head_of_its_chain() -> None:
    a = services_rules([port()])[0]
    view = plan.TableView({a.chain: ("x", "y")})
    moved = replace(a, to_port=40009)
    after = predict(view, [plan.Prepend(moved), plan.Prepend(a)])
    assert after is not None
    assert after.chains == {a.chain: (a.spec, moved.spec, "x", "y")}


def test_prediction_follows_jumps_and_gives_up_when_a_delete_misses() -> None:
    jump = next(r for r in render([], NODE) if r.is_jump)
    view = plan.TableView({CONTAINER_PORTALS: ("x",)})
    after = predict(view, [plan.Prepend(jump)])
    assert after is not None
    assert after.jumps == (plan.Found(jump.chain, jump.target, 0, jump.spec),)
    assert predict(view, [plan.Delete(CONTAINER_PORTALS, 0, "not there")]) is None
    rule = services_rules([port()])[0]
    assert predict(view, [plan.Append(replace(rule, chain="KUBE-NOT-THERE"))]) is None


def test_one_change_restore_input_holds_only_the_changed_rules() -> None:
    table = FakeTable("nat")
    before = services(range(240))
    _, state = sync(table, nat(before), None)
    moved = services([100], proxy_base=41000)[0]
    after = [*before[:100], moved, *before[101:]]
    step, state = sync(table, nat(after), state, defer=True)
    text = restore_text("nat", step.ops).splitlines()
    old = [r for r in services_rules([before[100]]) if r.table == "nat"]
    new = [r for r in services_rules([moved]) if r.table == "nat"]
    assert len(old) == len(new) == 2  # a container and a host rule
    assert text[0] == "*nat"
    assert text[-1] == "COMMIT"
    assert sorted(text[1:-1]) == sorted(f"-I {r.chain} 1 {r.spec}" for r in new)
    second, _ = sync(table, nat(after), state)
    text = restore_text("nat", second.ops).splitlines()
    assert sorted(text[1:-1]) == sorted(f"-D {r.chain} {r.spec}" for r in old)


def test_every_proxy_port_is_guarded_against_direct_connections() -> None:
    p = ProxiedPort(port(node_port=30080).info, 40001, 40002)
    dns = ServicePortName("default", "dns", "", Protocol.UDP)
    udp = port(name=dns, cluster_ips=("10.96.0.11",), cluster_port=40003)
    api = port(name=ServicePortName("default", "api", "https"), cluster_ips=("10.96.0.12",),
               cluster_port=40005)  # fmt: skip
    rules = lines([p, udp, api], chain=PROXY_PORTS)
    # Consecutive ports of one protocol share a rule with a port range; a port alone keeps
    # its own, named after its service port.
    assert sorted(rules) == sorted(
        [
            '-A KUBE-PROXY-PORTS -p udp -m comment --comment "default/dns" -m udp --dport 40003'
            " -j REJECT --reject-with icmp-port-unreachable",
            '-A KUBE-PROXY-PORTS -p tcp -m comment --comment "proxy ports 40001-40002" -m tcp'
            " --dport 40001:40002 -j REJECT --reject-with tcp-reset",
            '-A KUBE-PROXY-PORTS -p tcp -m comment --comment "default/api:https" -m tcp'
            " --dport 40005 -j REJECT --reject-with tcp-reset",
        ]
    )
    (jump,) = [r for r in render([p], NODE) if r.is_jump and r.target == PROXY_PORTS]
    assert jump.prepend and jump.chain == "INPUT"
    assert jump.line.endswith(
        "-m state --state NEW -m conntrack ! --ctstate DNAT -j KUBE-PROXY-PORTS"
    )


@settings(max_examples=80, deadline=None)
@given(
    st.sets(st.integers(40000, 40300), max_size=60),
    st.sets(st.integers(40000, 40300), max_size=20),
)
def test_guard_ranges_refuse_exactly_the_proxy_ports_in_the_fewest_rules(
    tcp: set[int], udp: set[int]
) -> None:
    ports = [
        port(name=ServicePortName("ns", f"t{p}", "p"), cluster_ips=("10.96.0.1",), cluster_port=p)
        for p in tcp
    ] + [
        port(name=ServicePortName("ns", f"u{p}", "", Protocol.UDP), cluster_ips=("10.96.0.2",),
             cluster_port=p)
        for p in udp
    ]  # fmt: skip
    guards = [r for r in render(ports, NODE) if base_chain(r.chain) == PROXY_PORTS and r.dport]
    guards = [r for r in guards if r.target == "REJECT"]
    assert refused(guards) == {("tcp", p) for p in tcp} | {("udp", p) for p in udp}
    for r in guards:  # each in the shard of its ports, never across shards
        assert r.chain == f"{PROXY_PORTS}-{r.dport // 256:02X}"
        assert (r.dport_hi or r.dport) // 256 == r.dport // 256

    # The fewest: one rule per run of consecutive ports within a shard.
    def runs(ps: set[int]) -> int:
        return sum(1 for p in ps if p - 1 not in ps or (p % 256 == 0))

    assert len(guards) == runs(tcp) + runs(udp)


def test_the_guard_can_be_turned_off() -> None:
    s = replace(NODE, guard=False)
    assert not [r for r in render([port(node_port=30080)], s) if r.chain.startswith(PROXY_PORTS)]


def test_only_changed_service_ports_are_rendered_and_their_shards_rebuilt() -> None:
    desired = Desired(NODE)
    before = services(range(200))
    assert desired.update(before) == 200
    chains = dict(desired.tables([4])[(4, "nat")].chains)
    assert desired.update(before) == 0
    assert desired.update(list(before)) == 0  # the same objects in a new list
    moved = services([7], proxy_base=41000)[0]
    assert desired.update([*before[:7], moved, *before[8:]]) == 1
    after = desired.tables([4])[(4, "nat")].chains
    changed = {c for c in after if after[c] is not chains.get(c)}
    # Only the moved port's shard of each nat chain it has rules in: the others are the
    # very same tuples, which the planner passes over by identity.
    assert changed == {r.chain for r in services_rules([moved]) if r.table == "nat"}


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sets(st.integers(0, 40), max_size=30), st.sets(st.integers(0, 40))),
        min_size=1,
        max_size=6,
    )
)
def test_updates_leave_the_rules_a_fresh_render_gives(
    states: list[tuple[set[int], set[int]]],
) -> None:
    # Service ports come and go and move proxy ports (guard runs grow, split and merge).
    desired = Desired(NODE)
    for present, moved in states:
        ports = [
            services([i], proxy_base=40300 if i in moved else 40000)[0] for i in sorted(present)
        ]
        desired.update(ports)
        assert [r.line for r in desired.rules([4])] == [r.line for r in render(ports, NODE)]


def test_a_shard_that_empties_is_dropped_with_its_jump() -> None:
    table = FakeTable("nat")
    ports = services(range(3))
    _, state = sync(table, nat(ports), None)
    gone = ports[1]
    shards = {r.chain for r in services_rules([gone]) if r.table == "nat"}
    assert shards and not shards & {r.chain for r in services_rules([ports[0], ports[2]])}
    step, _ = sync(table, nat([ports[0], ports[2]]), state)
    assert {op.chain for op in step.ops if isinstance(op, plan.DropChain)} == shards
    assert not shards & set(table.chains)
    assert holds(table, nat([ports[0], ports[2]]))


def shard_jumps_of(rules: Sequence[Rule]) -> dict[str, list[Rule]]:
    """The entry chains' jumps to their shards, by the shard they lead to."""
    out: dict[str, list[Rule]] = {}
    for r in rules:
        if r.to_chain and not r.is_jump:
            out.setdefault(r.target, []).append(r)
    return out


def passes(jump: Rule, rule: Rule) -> bool:
    """True when a packet that `rule` matches also matches the jump's own match."""
    if jump.dst:
        addr, mask = jump.dst.split("/")
        dst = rule.dst.split("/")[0]
        want = ipaddress.ip_address(addr).packed
        bits = zip(ipaddress.ip_address(dst).packed, ipaddress.ip_address(mask).packed, strict=True)
        return bytes(a & m for a, m in bits) == want
    return jump.protocol == rule.protocol and jump.dport <= rule.dport <= jump.dport_hi


def test_each_rule_sits_in_the_one_shard_whose_jump_its_packets_pass() -> None:
    ports = [
        port(name=ServicePortName("ns", f"s{i}", "p", Protocol.UDP if i % 3 == 0 else Protocol.TCP),
             cluster_ips=(f"10.96.{i}.{i * 37 % 256}",), node_port=30000 + 97 * i if i % 2 else 0,
             cluster_port=32768 + 211 * i, external_ips=(f"192.0.2.{i}",) if i % 4 == 0 else ())
        for i in range(40)
    ]  # fmt: skip
    rules = render(ports, NODE)
    jumps = shard_jumps_of(rules)
    served = [r for r in rules if not r.to_chain]
    assert served
    for rule in served:
        # The jump into the rule's shard lets its packets through, and no other jump does.
        into = [j for j in jumps[rule.chain] if passes(j, rule)]
        others = [j for c, js in jumps.items() if c != rule.chain for j in js]
        assert into, rule.line
        assert not [j for j in others if j.chain == into[0].chain and passes(j, rule)], rule.line


def test_cluster_ip_shards_are_the_last_byte_of_the_address() -> None:
    dual = port(cluster_ips=("10.96.3.201", "fd00::1:2ab"))
    rules = render([dual], replace(NODE, bind_address="::"), families={4, 6})
    shards = {
        (r.family, r.chain)
        for r in rules
        if base_chain(r.chain) == CONTAINER_PORTALS and r.chain != CONTAINER_PORTALS
    }
    assert shards == {(4, f"{CONTAINER_PORTALS}-C9"), (6, f"{CONTAINER_PORTALS}-AB")}
    lines_ = {r.line for r in rules if r.chain == CONTAINER_PORTALS}
    c = CONTAINER_PORTALS
    assert lines_ == {
        f'-A {c} -d 0.0.0.201/0.0.0.255 -m comment --comment "shard C9: destinations ending in'
        f' C9" -j {c}-C9',
        f'-A {c} -d ::ab/::ff -m comment --comment "shard AB: destinations ending in AB" -j {c}-AB',
    }


def test_port_shards_jump_once_per_protocol_in_them() -> None:
    desired = Desired(NODE)
    web = port(name=ServicePortName("ns", "web", "p"), node_port=30001)
    dns = port(name=ServicePortName("ns", "dns", "p", Protocol.UDP), node_port=30002,
               cluster_ips=("10.96.0.11",), cluster_port=40007)  # fmt: skip
    desired.update([web, dns])
    entry = desired.tables([4])[(4, "nat")].chains[CONTAINER_NODEPORTS]
    assert [r.spec for r in entry] == [
        f'-p {p} -m comment --comment "shard 75: ports 29952-30207" -m {p} --dport 29952:30207'
        f" -j {CONTAINER_NODEPORTS}-75"
        for p in ("tcp", "udp")
    ]
    desired.update([web])
    entry = desired.tables([4])[(4, "nat")].chains[CONTAINER_NODEPORTS]
    assert [r.protocol for r in entry] == ["tcp"]


def test_a_service_ports_rules_span_the_shards_of_their_destinations() -> None:
    desired = Desired(NODE)
    others = services(range(20))
    web = port(cluster_ips=("10.96.7.10",), external_ips=("192.0.2.99",), node_port=31000)
    desired.update([*others, web])
    before = dict(desired.tables([4])[(4, "nat")].chains)
    moved = ProxiedPort(web.info, 45000, 45000)
    assert desired.update([*others, moved]) == 1
    after = desired.tables([4])[(4, "nat")].chains
    changed = {c for c in after if after[c] is not before.get(c)}
    assert changed == {
        f"{CONTAINER_PORTALS}-0A", f"{HOST_PORTALS}-0A", f"{CONTAINER_PORTALS}-63",
        f"{HOST_PORTALS}-63", f"{CONTAINER_NODEPORTS}-79", f"{HOST_NODEPORTS}-79",
    }  # fmt: skip
