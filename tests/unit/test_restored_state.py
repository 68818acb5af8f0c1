"""A restored state (the state file, a handover's) is checked as the API's objects are: each
bad entry is dropped alone with one warning naming it and the field; the rest is served."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from kube_userspace_proxy.model import Endpoint, Protocol, ServicePortInfo, ServicePortName
from kube_userspace_proxy.restart import restored, statefile

NODE = "node-1"
WEB = ServicePortName("default", "web", "http")


def _entry(name: str = "web", **info: Any) -> dict[str, Any]:
    return {
        "name": ["default", name, "http", "TCP"],
        "info": {"port": 80, "cluster_ips": ["10.96.0.10"], **info},
        "endpoints": [["10.244.1.5", 8080, True, True, False, NODE]],
    }


def _document(*entries: Any, **overrides: Any) -> bytes:
    document = {
        "kind": statefile.KIND,
        "version": statefile.VERSION,
        "nodeName": NODE,
        "nodeIPs": ["192.0.2.10"],
        "servicePorts": list(entries),
        "proxyPorts": [["default/web:http", "TCP", "cluster", 40001]],
        **overrides,
    }
    return json.dumps(document).encode()


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_well_formed_state_reads_back_whole(caplog: pytest.LogCaptureFixture) -> None:
    snapshot, ports = statefile.decode(_document(_entry()), node_name=NODE)
    assert dict(snapshot.services) == {WEB: ServicePortInfo(WEB, 80, ("10.96.0.10",))}
    assert snapshot.endpoints_of(WEB) == (Endpoint("10.244.1.5", 8080, node_name=NODE),)
    assert snapshot.node_ips == ("192.0.2.10",)
    assert ports == {("default/web:http", "TCP", "cluster"): 40001}
    assert _warnings(caplog) == []


@pytest.mark.parametrize(
    ("info", "field"),
    [
        ({"cluster_ips": "10.96.0.10"}, "info.cluster_ips"),  # a string, not a list
        ({"cluster_ips": []}, "info.cluster_ips"),
        ({"cluster_ips": ["10.96.0.300"]}, "info.cluster_ips[0]"),
        ({"cluster_ips": ["127.0.0.1"]}, "info.cluster_ips[0]"),
        ({"port": 99999}, "info.port"),
        ({"port": "80"}, "info.port"),
        ({"port": True}, "info.port"),
        ({"node_port": 70000}, "info.node_port"),
        ({"health_check_node_port": -1}, "info.health_check_node_port"),
        ({"client_ip_affinity": "yes"}, "info.client_ip_affinity"),
        ({"affinity_timeout_seconds": 0}, "info.affinity_timeout_seconds"),
        ({"affinity_timeout_seconds": 86401}, "info.affinity_timeout_seconds"),
        ({"internal_traffic_local": 1}, "info.internal_traffic_local"),
        ({"proxy_protocol": 3}, "info.proxy_protocol"),
        ({"external_ips": "203.0.113.1"}, "info.external_ips"),
    ],
)
def test_a_bad_field_drops_that_service_port_alone(
    info: dict[str, Any], field: str, caplog: pytest.LogCaptureFixture
) -> None:
    snapshot, _ = statefile.decode(_document(_entry("web", **info), _entry("api")), node_name=NODE)
    assert list(snapshot.services) == [ServicePortName("default", "api", "http")]
    [warning] = _warnings(caplog)
    assert "default/web:http" in warning and field in warning, warning


@pytest.mark.parametrize(
    "name",
    [
        ["default", 'x"\nCOMMIT', "http", "TCP"],
        ["Default", "web", "http", "TCP"],
        ["default", "web", "http", "SCTP"],
        ["default", "web", 80, "TCP"],
        ["default", "web", "http"],
        "default/web:http",
    ],
)
def test_a_bad_name_drops_that_entry(name: Any, caplog: pytest.LogCaptureFixture) -> None:
    entry = {**_entry(), "name": name}
    snapshot, _ = statefile.decode(_document(entry, _entry("api")), node_name=NODE)
    assert list(snapshot.services) == [ServicePortName("default", "api", "http")]
    [warning] = _warnings(caplog)
    assert "servicePorts[0]" in warning and "name" in warning, warning


@pytest.mark.parametrize(
    ("endpoint", "field"),
    [
        (["127.0.0.1", 8080, True, True, False, None], "loopback"),
        (["169.254.169.254", 80, True, True, False, None], "link-local"),
        (["::1", 8080, True, True, False, None], "loopback"),
        (["0.0.0.0", 8080, True, True, False, None], "unspecified"),
        (["10.244.1.6", 99999, True, True, False, None], "endpoints[0][1]"),
        (["10.244.1.6", 8080, "yes", True, False, None], "endpoints[0][2]"),
        (["10.244.1.6", 8080, True, True, False, 7], "endpoints[0][5]"),
        (["not-an-ip", 8080, True, True, False, None], "endpoints[0][0]"),
        (["10.244.1.6", 8080], "endpoints[0]"),
    ],
)
def test_a_bad_or_forbidden_endpoint_is_dropped_alone(
    endpoint: list[Any], field: str, caplog: pytest.LogCaptureFixture
) -> None:
    entry = _entry()
    entry["endpoints"] = [endpoint, *entry["endpoints"]]
    snapshot, _ = statefile.decode(_document(entry), node_name=NODE)
    assert snapshot.endpoints_of(WEB) == (Endpoint("10.244.1.5", 8080, node_name=NODE),)
    [warning] = _warnings(caplog)
    assert "an endpoint of default/web:http" in warning and field in warning, warning


def test_loopback_endpoints_are_restored_only_when_the_policy_allows_them() -> None:
    entry = _entry()
    entry["endpoints"] = [["127.0.0.1", 8080, True, True, False, None]]
    denied, _ = statefile.decode(_document(entry), node_name=NODE)
    allowed, _ = statefile.decode(_document(entry), node_name=NODE, loopback=True)
    assert denied.endpoints_of(WEB) == ()
    assert allowed.endpoints_of(WEB) == (Endpoint("127.0.0.1", 8080),)
    entry["endpoints"] = [["169.254.169.254", 80, True, True, False, None]]
    metadata, _ = statefile.decode(_document(entry), node_name=NODE, loopback=True)
    assert metadata.endpoints_of(WEB) == ()


def test_forbidden_external_ips_are_dropped_and_the_service_port_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    entry = _entry(external_ips=["127.0.0.1", "203.0.113.1"], load_balancer_ips=["0.0.0.0"])
    snapshot, _ = statefile.decode(_document(entry), node_name=NODE)
    info = snapshot.services[WEB]
    assert info.external_ips == ("203.0.113.1",)
    assert info.load_balancer_ips == ()
    assert len(_warnings(caplog)) == 2


def test_bad_proxy_ports_and_node_ips_are_dropped_alone(caplog: pytest.LogCaptureFixture) -> None:
    lines = [
        ["default/web:http", "TCP", "cluster", 99999],
        ["default/web:http", "TCP", "external", "40002"],
        [1, "TCP", "cluster", 40003],
        ["default/web:http", "TCP", "cluster", 40001],
    ]
    document = _document(_entry(), proxyPorts=lines, nodeIPs=["192.0.2.10", "x", 5])
    snapshot, ports = statefile.decode(document, node_name=NODE)
    assert ports == {("default/web:http", "TCP", "cluster"): 40001}
    assert snapshot.node_ips == ("192.0.2.10",)
    warnings = _warnings(caplog)
    assert len(warnings) == 5, warnings
    assert sum("proxyPorts[" in w for w in warnings) == 3
    assert sum("nodeIPs[" in w for w in warnings) == 2


def test_the_nodes_zone_and_pod_cidrs_read_back() -> None:
    snapshot, _ = statefile.decode(_document(_entry()), node_name=NODE)
    snapshot = dataclasses.replace(
        snapshot, node_zone="zone-a", pod_cidrs=("10.244.1.0/24", "fd00:1::/64")
    )
    again, _ = statefile.decode(statefile.encode(snapshot, {}), node_name=NODE)
    assert (again.node_zone, again.pod_cidrs) == ("zone-a", ("10.244.1.0/24", "fd00:1::/64"))


def test_bad_pod_cidrs_are_dropped_alone(caplog: pytest.LogCaptureFixture) -> None:
    cidrs = ["10.244.1.0/24", "10.244.1.0/33", "nonsense", 7, "fd00:1::/64"]
    snapshot, _ = statefile.decode(_document(_entry(), podCIDRs=cidrs), node_name=NODE)
    assert snapshot.pod_cidrs == ("10.244.1.0/24", "fd00:1::/64")
    assert snapshot.services  # the rest is served
    warnings = _warnings(caplog)
    assert len(warnings) == 3, warnings
    assert all("podCIDRs[" in w for w in warnings)


@pytest.mark.parametrize(("value", "warned"), [(None, 0), ({"a": 1}, 1), ("10.0.0.0/8", 1)])
def test_pod_cidrs_that_are_absent_or_not_a_list_restore_as_none(
    value: Any, warned: int, caplog: pytest.LogCaptureFixture
) -> None:
    document = json.loads(_document(_entry(), podCIDRs=value))
    if value is None:
        del document["podCIDRs"]  # a file that predates them
    snapshot, _ = statefile.decode(json.dumps(document).encode(), node_name=NODE)
    assert snapshot.pod_cidrs == ()
    assert snapshot.services
    assert len(_warnings(caplog)) == warned


@pytest.mark.parametrize("part", ["servicePorts", "proxyPorts", "nodeIPs"])
def test_a_document_whose_lists_are_not_lists_is_refused_whole(part: str) -> None:
    with pytest.raises(statefile.StateFileError, match=part):
        statefile.decode(_document(_entry(), **{part: {"a": 1}}), node_name=NODE)


def test_udp_service_ports_never_send_a_proxy_protocol_header() -> None:
    entry = _entry(proxy_protocol=2)
    entry["name"] = ["default", "web", "http", "UDP"]
    snapshot, _ = statefile.decode(_document(entry), node_name=NODE)
    [info] = snapshot.services.values()
    assert info.protocol is Protocol.UDP and info.proxy_protocol == 0


def test_every_field_of_a_service_port_is_checked() -> None:
    fields = {f.name for f in dataclasses.fields(ServicePortInfo)} - {"name"}
    assert set(restored.INFO_CHECKS) == fields


# -- who may have written it ------------------------------------------------------------------


def _saved(directory: Path) -> Path:
    statefile.write(str(directory), _document(_entry()))
    return directory / statefile.FILE_NAME


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757, 0o1777])
def test_a_state_directory_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(mode)
    with pytest.raises(statefile.UnsafeDirectory, match=f"{state}.*mode {mode:04o}"):
        statefile.check_directory(str(state))


def test_a_private_or_missing_state_directory_passes(tmp_path: Path) -> None:
    statefile.check_directory(str(tmp_path / "missing"))
    (tmp_path / "state").mkdir(mode=0o755)
    statefile.check_directory(str(tmp_path / "state"))


def test_a_state_directory_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "state").write_text("")
    with pytest.raises(statefile.UnsafeDirectory, match="not a directory"):
        statefile.check_directory(str(tmp_path / "state"))


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_a_state_directory_or_file_of_another_user_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "state"
    path = _saved(state)
    os.chown(path, 65534, 65534)
    assert statefile.load(str(state), node_name=NODE) is None
    assert f"ignoring the state file {path}: owned by uid 65534" in _warnings(caplog)[0]
    os.chown(state, 65534, 65534)
    with pytest.raises(statefile.UnsafeDirectory, match="owned by uid 65534"):
        statefile.check_directory(str(state))


def test_a_state_file_others_can_write_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _saved(tmp_path)
    assert statefile.load(str(tmp_path), node_name=NODE) is not None
    path.chmod(0o666)
    assert statefile.load(str(tmp_path), node_name=NODE) is None
    [warning] = _warnings(caplog)
    assert f"ignoring the state file {path}: writable by its group or others" in warning
    # The next save replaces it with a private one.
    statefile.write(str(tmp_path), _document(_entry()))
    assert path.stat().st_mode & 0o777 == 0o600
    assert statefile.load(str(tmp_path), node_name=NODE) is not None


def test_a_state_file_that_is_a_symlink_is_not_followed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    target = _saved(tmp_path / "elsewhere")
    (tmp_path / statefile.FILE_NAME).symlink_to(target)
    assert statefile.load(str(tmp_path), node_name=NODE) is None
    assert "cannot read the state file" in _warnings(caplog)[0]
