"""Transparent mode's configuration and the rules of its return path (rendered, not run)."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest
import yaml

from kube_userspace_proxy.cluster.objects import parse_node
from kube_userspace_proxy.cluster.sources.manifests import ManifestSource
from kube_userspace_proxy.cluster.state import ClusterState
from kube_userspace_proxy.config.settings import TRANSPARENT_MARK, TRANSPARENT_TABLE, ProxyConfig
from kube_userspace_proxy.model import SourcePolicy
from kube_userspace_proxy.portals.restore import parse_save
from kube_userspace_proxy.portals.returnpath import (
    CHAIN,
    jump_rule,
    mark_rule,
    removal_text,
    restore_text,
)
from tests.unit.test_state import HTTP, endpoint_slice, service


def test_the_mark_rule_sets_only_its_bit_on_replies_to_transparent_sockets() -> None:
    assert mark_rule(0x1000) == (
        f"-A {CHAIN} -m socket --transparent -m comment --comment"
        ' "transparent proxy replies" -j MARK --set-xmark 0x1000/0x1000'
    )
    text = restore_text(0x1000, jump=True)
    assert text.splitlines() == [
        "*mangle",
        f":{CHAIN} - [0:0]",
        f"-F {CHAIN}",
        mark_rule(0x1000),
        f"-I PREROUTING 1 -j {CHAIN}",
        "COMMIT",
    ]
    assert f"-I PREROUTING 1 -j {CHAIN}" not in restore_text(0x1000, jump=False)
    # What iptables-save prints back is what the check compares with.
    chains, _ = parse_save(
        f"*mangle\n:{CHAIN} - [0:0]\n{jump_rule()}\n{mark_rule(0x20)}\n", "mangle"
    )
    assert CHAIN in chains


def test_removal_takes_every_jump_then_the_chain() -> None:
    assert removal_text(2).splitlines() == [
        "*mangle",
        f"-D PREROUTING -j {CHAIN}",
        f"-D PREROUTING -j {CHAIN}",
        f"-F {CHAIN}",
        f"-X {CHAIN}",
        "COMMIT",
    ]


def test_defaults_collide_with_no_known_mark_or_table() -> None:
    taken_marks = 0x4000 | 0x8000 | 0x2000 | 0xFFFF0000 | 0x0F00 | 0x60000 | 0x539 | 0x80 | 0x3F0
    assert TRANSPARENT_MARK & taken_marks == 0
    assert TRANSPARENT_TABLE not in {*range(1, 256), 2004, 2005, 2006, *range(2050, 2100)}
    config = ProxyConfig()
    assert not config.preserve_source_ip
    assert (config.transparent_mark, config.transparent_table) == (0x1000, 4040)


@pytest.mark.parametrize("mark", [0, 0x3000, 0x4000, 0x8000, 1 << 32])
def test_a_mark_must_be_one_bit_and_not_kube_proxys(mark: int) -> None:
    with pytest.raises(pydantic.ValidationError):
        ProxyConfig(transparent_mark=mark)


@pytest.mark.parametrize("table", [0, 253, 254, 255, 1 << 32])
def test_a_table_must_not_be_the_kernels(table: int) -> None:
    with pytest.raises(pydantic.ValidationError):
        ProxyConfig(transparent_table=table)


def test_the_local_clients_are_the_nodes_pod_cidrs() -> None:
    assert ProxyConfig().source_policy(("10.244.1.0/24",)) is None  # the flag is off
    on = ProxyConfig(preserve_source_ip=True, cluster_cidr="10.244.0.0/16")
    assert on.source_policy(("10.244.1.0/24",)) == SourcePolicy(("10.244.1.0/24",))
    # No podCIDRs: only endpoints on this node keep the address ...
    assert on.source_policy(()) == SourcePolicy()
    # ... unless kube-proxy's detectLocalMode says the cluster CIDR is local.
    cluster = ProxyConfig(
        preserve_source_ip=True,
        cluster_cidr="10.244.0.0/16",
        kube_proxy_config={"detectLocalMode": "ClusterCIDR"},
    )
    assert cluster.source_policy(()) == SourcePolicy(("10.244.0.0/16",))
    assert cluster.source_policy(("10.244.1.0/24",)) == SourcePolicy(("10.244.1.0/24",))


def test_the_nodes_pod_cidrs_reach_the_snapshot() -> None:
    node = {
        "metadata": {"name": "n1"},
        "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24", "fd00:1::/64"]},
    }
    assert parse_node(node).pod_cidrs == ("10.244.1.0/24", "fd00:1::/64")
    assert parse_node({"spec": {"podCIDR": "10.244.2.0/24"}}).pod_cidrs == ("10.244.2.0/24",)
    assert parse_node({"spec": {"podCIDRs": ["nonsense"]}}).pod_cidrs == ()
    changes = []
    state = ClusterState(node_name="n1", on_change=lambda: changes.append(1))
    state.set_node(node)
    assert changes and state.view().pod_cidrs == ("10.244.1.0/24", "fd00:1::/64")
    state.set_node(None)
    assert state.view().pod_cidrs == ()


def test_a_pod_cidr_change_reaches_every_service_port_in_the_next_partial_sync() -> None:
    state = ClusterState(node_name="n1")
    state.replace("Service", [service()])
    state.replace("EndpointSlice", [endpoint_slice()])
    state.set_node({"metadata": {"name": "n1"}, "spec": {"podCIDR": "10.244.1.0/24"}})
    state.snapshot()
    state.set_node({"metadata": {"name": "n1"}, "spec": {"podCIDR": "10.244.7.0/24"}})
    partial = state.changes()
    assert partial.pod_cidrs == ("10.244.7.0/24",)
    assert partial.changed == {HTTP} and HTTP in partial.endpoints


async def test_a_manifest_may_hold_this_nodes_node(tmp_path: Path) -> None:
    manifest = tmp_path / "m.yaml"
    nodes = [
        {"kind": "Node", "metadata": {"name": "other"}, "spec": {"podCIDR": "10.244.9.0/24"}},
        {"kind": "Node", "metadata": {"name": "n1"}, "spec": {"podCIDR": "10.244.1.0/24"}},
    ]
    manifest.write_text(yaml.safe_dump_all(nodes))
    state = ClusterState(node_name="n1")
    source = ManifestSource([str(manifest)], state)
    await source.load_once()
    assert state.view().pod_cidrs == ("10.244.1.0/24",)
