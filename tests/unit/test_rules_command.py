"""`rules`, the learning tool: the rules for a manifest, what the proxy decides itself (the
endpoints it uses and not, and why), every object it ignored and what to change."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kube_userspace_proxy import cli

ROOT = Path(__file__).resolve().parents[2]


def rules(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(["rules", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def write(path: Path, objects: list[dict[str, object]]) -> str:
    path.write_text(yaml.safe_dump_all(objects))
    return str(path)


def test_the_example_manifest_gives_its_service_port_a_rule(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = rules(["--manifests", str(ROOT / "deploy" / "myapp.yaml")], capsys)
    assert code == 0
    assert out.startswith("# 1 service port(s)")
    redirect = [line for line in out.splitlines() if "REDIRECT" in line]
    assert len(redirect) == 1 and '"default/myapp:http"' in redirect[0]
    assert "-d 10.96.100.80/32" in redirect[0] and "--dport 80" in redirect[0]
    # Its Deployment is named as not read, and why the port has no endpoint yet.
    assert "Deployment default/svc-deploy" in out
    assert "no EndpointSlice names Service default/myapp" in out


def test_a_service_without_cluster_ip_is_named_with_what_to_add_at_default_verbosity(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = write(
        tmp_path / "svc.yaml",
        [{"kind": "Service", "metadata": {"name": "web"}, "spec": {"ports": [{"port": 80}]}}],
    )
    code, out, _ = rules(["--manifests", manifest], capsys)
    assert code == 0
    assert out.startswith("# 0 service port(s)")
    (line,) = [line for line in out.splitlines() if "Service default/web" in line]
    assert line.startswith("#") and "no clusterIP" in line and "add spec.clusterIP" in line


def test_unused_endpoints_are_listed_with_the_reason_and_affinity_is_the_proxys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    service = {
        "kind": "Service",
        "metadata": {"name": "web", "namespace": "shop"},
        "spec": {
            "clusterIP": "10.96.0.20",
            "type": "NodePort",
            "externalTrafficPolicy": "Local",
            "sessionAffinity": "ClientIP",
            "ports": [{"name": "http", "port": 80, "nodePort": 30080}],
        },
    }
    endpoints = [
        {"addresses": ["10.244.1.5"], "nodeName": "node-a"},
        {"addresses": ["10.244.1.6"], "nodeName": "node-a", "conditions": {"ready": False}},
        {
            "addresses": ["10.244.2.7"],
            "nodeName": "node-b",
            "conditions": {"ready": False, "serving": True, "terminating": True},
        },
        {"addresses": ["169.254.1.1"], "nodeName": "node-a"},
    ]
    piece = {
        "kind": "EndpointSlice",
        "metadata": {
            "name": "web-1",
            "namespace": "shop",
            "labels": {"kubernetes.io/service-name": "web"},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080}],
        "endpoints": endpoints,
    }
    manifest = write(tmp_path / "web.yaml", [service, piece])
    code, out, _ = rules(["--manifests", manifest, "--hostname-override", "node-a"], capsys)
    assert code == 0
    assert "Decided in the proxy, not by a rule" in out
    assert "sessionAffinity ClientIP: a client keeps its endpoint for 10800s" in out
    assert "#   used by cluster traffic: 10.244.1.5:8080\n" in out
    assert "not used by cluster traffic: 10.244.1.6:8080: not ready" in out
    assert "not used by cluster traffic: 10.244.2.7:8080: terminating" in out
    assert (
        "not used by NodePort/external traffic: 10.244.2.7:8080: on node node-b, not this one,"
        " under traffic policy Local" in out
    )
    assert "not used: 169.254.1.1: a link-local address is never proxied" in out


def test_rules_without_a_cluster_or_manifests_names_manifests(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", "/nonexistent")  # no ~/.kube/config either
    code, out, err = rules([], capsys)
    assert code == 2 and out == ""
    assert "kube-userspace-proxy rules --manifests" in err


def _service(annotations: dict[str, str]) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "db", "namespace": "data", "annotations": annotations},
        "spec": {"clusterIP": "10.96.0.40", "ports": [{"name": "sql", "port": 5432}]},
    }


def test_rules_say_each_services_scheduler_and_where_it_comes_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = write(tmp_path / "db.yaml", [_service({})])
    _, out, _ = rules(["--manifests", manifest, "--ipvs-scheduler", "lc"], capsys)
    assert "#   scheduler lc (--ipvs-scheduler): least connections" in out
    manifest = write(
        tmp_path / "db.yaml",
        [
            _service(
                {
                    "kube-userspace-proxy.io/scheduler": "mh",
                    "kube-userspace-proxy.io/outlier-consecutive-failures": "0",
                }
            )
        ],
    )
    _, out, err = rules(["--manifests", manifest], capsys)
    assert "#   scheduler sh (annotation): source hashing (Maglev)" in out
    assert "#   outlier ejection: off" in out
    assert "Service data/db: annotation kube-userspace-proxy.io/scheduler: IPVS scheduler 'mh'" in (
        err
    )


def test_a_bad_ejection_annotation_is_one_warning_and_the_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    annotations = {"kube-userspace-proxy.io/outlier-base-ejection-time": "soon"}
    manifest = write(tmp_path / "db.yaml", [_service(annotations)])
    _, out, err = rules(["--manifests", manifest], capsys)
    assert "out for 30s x its ejections" in out
    assert err.count("outlier-base-ejection-time: 'soon' is not a duration") == 1


def test_a_family_the_node_lacks_is_named_as_left_out_not_listed_as_served(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def svc(name: str, ips: list[str]) -> dict[str, object]:
        return {
            "kind": "Service",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "clusterIP": ips[0],
                "clusterIPs": ips,
                "ports": [{"name": "http", "port": 80}],
            },
        }

    manifest = write(
        tmp_path / "svc.yaml",
        [svc("v6", ["fd00:10:96::10"]), svc("dual", ["10.96.0.11", "fd00:10:96::11"])],
    )
    code, out, _ = rules(["--manifests", manifest, "--node-ip", "10.0.0.1"], capsys)
    assert code == 0
    assert "fd00:10:96" not in "\n".join(line for line in out.splitlines() if line.startswith("-A"))
    why = "the node has no IPv6 address (node IPs: 10.0.0.1; see --node-ip)"
    assert f"#   default/v6:http: fd00:10:96::10: {why}" in out
    assert f"#   default/dual:http: fd00:10:96::11: {why}" in out
    assert (
        "# default/v6:http: TCP fd00:10:96::10 (left out) port 80 -> not served on this node" in out
    )
    assert (
        "# default/dual:http: TCP 10.96.0.11, fd00:10:96::11 (left out) port 80 -> proxy port"
        in out
    )
    # A dual-stack node serves both; an explicit IPv4 bind address keeps its old advice.
    code, out, _ = rules(["--manifests", manifest, "--node-ip", "10.0.0.1,fd00::1"], capsys)
    assert "-d fd00:10:96::10/128" in out and "left out" not in out
    flags = ["--manifests", manifest, "--node-ip", "10.0.0.1,fd00::1", "--bind-address", "0.0.0.0"]
    code, out, _ = rules(flags, capsys)
    assert "use --bind-address :: for dual stack" in out and "-d fd00:10:96" not in out
