"""The chart's DaemonSet against kubeadm's kube-proxy DaemonSet, field by field.

What makes a node proxy work on every node must match: it tolerates every taint, runs at
system-node-critical priority, in the node's network namespace, shares the xtables lock with
every other iptables user, sees the node's kernel modules, rolls one node at a time, knows its
node's name, and reads its config the way kubeadm passes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.unit.test_chart import TEMPLATES, VALUES, simple_render, with_value

KUBEADM = yaml.safe_load(
    (
        Path(__file__).parent.parent / "fixtures" / "kubeadm" / "kube-proxy-daemonset.yaml"
    ).read_text()
)


def chart_daemonset(values: dict[str, Any] | None = None) -> dict[str, Any]:
    """The chart's DaemonSet; the blocks the templates copy from values are filled in here."""
    values = values or with_value("apiServer.host", "kind-control-plane")
    template = (TEMPLATES / "daemonset.yaml").read_text()
    doc: dict[str, Any] = yaml.safe_load(simple_render(template, values))
    pod = doc["spec"]["template"]["spec"]
    for key in ("tolerations", "nodeSelector"):
        assert f"with .Values.{key}" in template
        pod[key] = values[key]
    assert "toYaml .Values.updateStrategy" in template
    doc["spec"]["updateStrategy"] = values["updateStrategy"]
    return doc


def pod(doc: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = doc["spec"]["template"]["spec"]
    return spec


def container(doc: dict[str, Any]) -> dict[str, Any]:
    first: dict[str, Any] = pod(doc)["containers"][0]
    return first


def volume_of(doc: dict[str, Any], mount_path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(volumeMount, volume) of the mount at `mount_path`."""
    [mount] = [m for m in container(doc)["volumeMounts"] if m["mountPath"] == mount_path]
    [volume] = [v for v in pod(doc)["volumes"] if v["name"] == mount["name"]]
    return mount, volume


def test_tolerations_match() -> None:
    assert pod(chart_daemonset())["tolerations"] == pod(KUBEADM)["tolerations"]


def test_priority_class_matches() -> None:
    assert pod(chart_daemonset())["priorityClassName"] == pod(KUBEADM)["priorityClassName"]


def test_host_network_matches() -> None:
    assert pod(chart_daemonset())["hostNetwork"] is pod(KUBEADM)["hostNetwork"] is True


def test_node_selector_matches() -> None:
    assert pod(chart_daemonset())["nodeSelector"] == pod(KUBEADM)["nodeSelector"]


def test_xtables_lock_matches() -> None:
    ours_mount, ours = volume_of(chart_daemonset(), "/run/xtables.lock")
    theirs_mount, theirs = volume_of(KUBEADM, "/run/xtables.lock")
    assert (
        ours["hostPath"]
        == theirs["hostPath"]
        == {
            "path": "/run/xtables.lock",
            "type": "FileOrCreate",
        }
    )
    assert not ours_mount.get("readOnly") and not theirs_mount.get("readOnly")
    assert VALUES["xtablesLockPath"] == "/run/xtables.lock"


def test_kernel_modules_match() -> None:
    ours_mount, ours = volume_of(chart_daemonset(), "/lib/modules")
    theirs_mount, theirs = volume_of(KUBEADM, "/lib/modules")
    assert ours["hostPath"] == theirs["hostPath"]
    assert ours_mount["readOnly"] is theirs_mount["readOnly"] is True


def test_update_strategy_matches() -> None:
    ours = chart_daemonset()["spec"]["updateStrategy"]
    assert ours["type"] == KUBEADM["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    # kubeadm leaves maxUnavailable to its default, 1: each node's proxy is down while its pod
    # restarts. The chart surges instead: the new pod takes the old one's sockets over.
    assert "maxSurge" not in KUBEADM["spec"]["updateStrategy"].get("rollingUpdate", {})
    assert ours["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_node_name_and_command_line_match() -> None:
    ours, theirs = container(chart_daemonset()), container(KUBEADM)
    assert [e for e in ours["env"] if e["name"] == "NODE_NAME"] == theirs["env"]
    kubeadm_args = theirs["command"][1:]
    assert "--hostname-override=$(NODE_NAME)" in ours["args"]
    assert any(a.startswith("--config=") for a in ours["args"])
    assert [a.split("=")[0] for a in kubeadm_args] == ["--config", "--hostname-override"]


def test_kubeadms_kubeconfig_configmap_is_mounted_where_kubeadm_mounts_it() -> None:
    values = with_value("kubeconfig.configMap", "kube-proxy")
    doc = chart_daemonset(values)
    mount, volume = volume_of(doc, "/var/lib/kube-proxy")
    _, theirs = volume_of(KUBEADM, "/var/lib/kube-proxy")
    assert volume["configMap"]["name"] == theirs["configMap"]["name"] == "kube-proxy"
    assert mount["readOnly"] is True
    assert "--kubeconfig=/var/lib/kube-proxy/kubeconfig.conf" in container(doc)["args"]


def test_the_chart_refuses_to_render_without_a_way_to_the_api_server() -> None:
    template = (TEMPLATES / "daemonset.yaml").read_text()
    guard = template.split("\n", 2)
    assert guard[0] == "{{- if not (or .Values.apiServer.host .Values.kubeconfig.configMap) }}"
    assert (
        guard[1].startswith('{{- fail "set apiServer.host') and "kubeconfig.configMap" in guard[1]
    )
