"""The Helm chart: schema, template references, RBAC, flags and config; with helm, renders.

Checked everywhere: values.yaml validates against values.schema.json; every `.Values.*` path
in the templates exists in values.yaml; the ClusterRole grants every API call the code makes;
the DaemonSet's flags and the ConfigMap's KubeProxyConfiguration are accepted by the proxy's
own CLI and config loader. Checked where helm is available (the `helm` binary on PATH, or the
`helm_python` package, which embeds Helm's Go SDK): `helm lint --strict` and `helm template`
with default, kind and monitoring values.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kube_userspace_proxy import cli
from kube_userspace_proxy.config.settings import config_from_document

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kube-userspace-proxy"
TEMPLATES = CHART / "templates"
SRC = ROOT / "src" / "kube_userspace_proxy"

VALUES: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
SCHEMA: dict[str, Any] = json.loads((CHART / "values.schema.json").read_text())


def validate(values: Mapping[str, Any]) -> None:
    jsonschema.validate(values, SCHEMA, cls=jsonschema.Draft7Validator)


def template_texts() -> Iterator[tuple[str, str]]:
    for path in sorted(TEMPLATES.iterdir()):
        yield path.name, path.read_text()


def lookup(values: Mapping[str, Any], dotted: str) -> Any:
    node: Any = values
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise KeyError(dotted)
        node = node[part]
    return node


def simple_render(text: str, values: Mapping[str, Any] = VALUES) -> str:
    """Just enough of Helm for flat templates: drop control lines, fill `{{ .Values.x }}`."""
    control = re.compile(
        r"^\s*\{\{-?\s*(if|end|with|range|else|include|toYaml|fail|\$)\b.*\}\}\s*$"
    )
    lines = [line for line in text.splitlines() if not control.match(line)]
    out = "\n".join(lines)
    out = re.sub(
        r"\{\{-?\s*\.Values\.([\w.]+)\s*(\|\s*quote\s*)?-?\}\}",
        lambda m: str(lookup(values, m.group(1))),
        out,
    )
    return re.sub(r"\{\{.*?\}\}", "placeholder", out)


# -- values and schema ---------------------------------------------------------------------


def test_schema_is_valid_draft7() -> None:
    jsonschema.Draft7Validator.check_schema(SCHEMA)


def test_values_yaml_validates_against_the_schema() -> None:
    validate(VALUES)


def with_value(dotted: str, value: Any) -> dict[str, Any]:
    values = json.loads(json.dumps(VALUES))
    node = values
    *parents, last = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return values


@pytest.mark.parametrize(
    ("dotted", "bad"),
    [
        ("config.mode", "iptables"),  # the chart sets mode: userspace itself
        ("config.syncPeriod", "30s"),  # belongs under config.iptables, as in kube-proxy
        ("config.iptables.syncPeriod", "30"),  # durations carry a unit
        ("config.metricsBindAddress", "10249"),
        ("image.pullPolicy", "Sometimes"),
        ("iptablesBackend", "nft"),
        ("logFormat", "xml"),
        ("extraArgs", ["v=4"]),
        ("livenessProbe.path", "/metrics"),
        ("typo", True),
        ("preserveSourceIP.mark", "0x3000"),  # one bit only
        ("preserveSourceIP.table", 254),  # the kernel's main table
        ("preserveSourceIP.enabled", "yes"),
    ],
)
def test_schema_rejects_bad_values(dotted: str, bad: Any) -> None:
    with pytest.raises(jsonschema.ValidationError):
        validate(with_value(dotted, bad))


@pytest.mark.parametrize(
    ("dotted", "good"),
    [
        ("config.metricsBindAddress", "0.0.0.0:10249"),
        ("config.metricsBindAddress", "[::]:10249"),
        ("config.healthzBindAddress", ""),
        ("config.iptables.syncPeriod", "1m30s"),
        ("config.portRange", "30000-30100"),
        ("apiServer.host", "kind-control-plane"),
        ("preserveSourceIP.mark", "0x20000000"),
        ("preserveSourceIP.table", 7000),
    ],
)
def test_schema_accepts_good_values(dotted: str, good: Any) -> None:
    validate(with_value(dotted, good))


# -- templates -----------------------------------------------------------------------------


def test_every_values_path_in_the_templates_exists_in_values_yaml() -> None:
    missing = []
    for name, text in template_texts():
        for dotted in re.findall(r"\.Values\.([A-Za-z_][\w.]*)", text):
            try:
                lookup(VALUES, dotted.rstrip("."))
            except KeyError:
                missing.append(f"{name}: .Values.{dotted}")
    assert missing == []


def test_every_object_carries_the_standard_labels() -> None:
    for name, text in template_texts():
        if name.endswith(".yaml"):
            assert 'include "kup.labels"' in text, name
    helpers = (TEMPLATES / "_helpers.tpl").read_text()
    for label in ("name", "instance", "version", "component", "part-of", "managed-by"):
        assert f"app.kubernetes.io/{label}:" in helpers


def api_calls_in_code() -> set[tuple[str, str]]:
    """(resource, verb) of every kubernetes_asyncio API method the proxy refers to."""
    calls: set[tuple[str, str]] = set()
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        # `core = kclient.CoreV1Api(api)` ... `core.list_service_for_all_namespaces`
        for api in set(re.findall(r"\b(\w+)\s*=\s*\w+\.\w+V\d\w*Api\(", text)):
            pattern = (
                rf"\b{api}\.(list|read|create|patch|replace|delete)_(?:namespaced_)?"
                r"([a-z_]+?)(?:_for_all_namespaces)?\b"
            )
            for verb, resource in re.findall(pattern, text):
                if verb == "list":
                    # Every list is followed by a watch of the same resource (KubeSource).
                    calls |= {(resource, "list"), (resource, "watch")}
                else:
                    calls.add((resource, {"read": "get"}.get(verb, verb)))
    return calls


# Resource (kubernetes_asyncio's snake_case) -> (API groups, plural) as RBAC names it.
RESOURCES = {
    "service": ([""], "services"),
    "endpoint_slice": (["discovery.k8s.io"], "endpointslices"),
    "node": ([""], "nodes"),
    "event": (["", "events.k8s.io"], "events"),
}


def granted(role: Mapping[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_cluster_role_grants_every_api_call_the_code_makes() -> None:
    role = yaml.safe_load(simple_render((TEMPLATES / "clusterrole.yaml").read_text()))
    assert role["kind"] == "ClusterRole"
    have = granted(role)
    calls = api_calls_in_code()
    # The scan itself still finds the proxy's watches.
    assert {("service", "watch"), ("endpoint_slice", "watch"), ("node", "list")} <= calls
    for resource, verb in calls:
        assert resource in RESOURCES, f"unknown API resource {resource!r}: map it and grant it"
        groups, plural = RESOURCES[resource]
        assert any((g, plural, verb) in have for g in groups), f"{plural} {verb} not granted"
    # And nothing is granted that the code never uses.
    used = {RESOURCES[resource][1] for resource, _ in calls}
    assert {resource for _, resource, _ in have} <= used


def test_cluster_role_matches_node_proxier_for_what_this_proxy_uses() -> None:
    have = granted(yaml.safe_load(simple_render((TEMPLATES / "clusterrole.yaml").read_text())))
    for group, resource in (("", "services"), ("discovery.k8s.io", "endpointslices")):
        assert {(group, resource, v) for v in ("list", "watch")} <= have
    assert {("", "nodes", v) for v in ("list", "watch")} <= have
    # No `get`: the proxy lists and watches (tests/control/test_rbac.py proves it on a run).
    assert not any(verb == "get" for _, _, verb in have)
    assert not any(resource == "events" for _, resource, _ in have)  # no Events are emitted
    assert not any(verb in {"delete", "deletecollection", "*"} for _, _, verb in have)


def config_document(values: Mapping[str, Any] = VALUES) -> dict[str, Any]:
    """The ConfigMap's KubeProxyConfiguration as templates/configmap.yaml builds it."""
    template = (TEMPLATES / "configmap.yaml").read_text()
    assert "mode: userspace" in template and "toYaml .Values.config" in template
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "userspace",
        **values["config"],
    }


def daemonset_args(values: Mapping[str, Any] = VALUES) -> list[str]:
    text = simple_render((TEMPLATES / "daemonset.yaml").read_text(), values)
    block = text.split("args:", 1)[1].split("env:", 1)[0]
    return [line.strip()[2:] for line in block.splitlines() if line.strip().startswith("- --")]


def test_daemonset_flags_and_config_file_are_accepted_by_the_proxy(tmp_path: Path) -> None:
    config_file = tmp_path / "config.conf"
    config_file.write_text(yaml.safe_dump(config_document()))
    args = [f"--config={config_file}" if a.startswith("--config=") else a for a in daemonset_args()]
    assert f"--config={config_file}" in args
    parsed = cli.make_parser().parse_args(["run", *args])
    config = cli.parse_config(parsed)
    assert config.healthz_bind_address == VALUES["config"]["healthzBindAddress"]
    assert config.sync_period == 30.0
    assert config.hostname_override == "$(NODE_NAME)"  # expanded by the kubelet
    assert config.verbosity == VALUES["verbosity"]


def test_config_file_maps_every_chart_field() -> None:
    mapped = config_from_document(
        with_value("config.portRange", "30000-30100")["config"]
        | {"clusterCIDR": "10.244.0.0/16", "nodePortAddresses": ["10.0.0.0/8"]}
    )
    assert mapped["proxy_port_range"] == "30000-30100"
    assert mapped["cluster_cidr"] == "10.244.0.0/16"
    assert mapped["nodeport_addresses"] == ("10.0.0.0/8",)
    assert mapped["sync_period"] == "30s"
    assert mapped["kube_api_qps"] == 5


# -- with helm -----------------------------------------------------------------------------


Render = Callable[[dict[str, Any]], list[str]]


def helm_backend() -> tuple[Render, Callable[[], str], Callable[[dict[str, Any]], str]] | None:
    """(template(values) -> rendered docs, lint() -> problems, notes(values) -> NOTES.txt as
    rendered) from helm or helm_python."""
    if shutil.which("helm"):

        def template_cli(values: dict[str, Any]) -> list[str]:
            proc = subprocess.run(
                ["helm", "template", "kup", str(CHART), "-n", "kube-system", "-f", "-"],
                input=json.dumps(values),
                capture_output=True,
                text=True,
                check=False,
            )
            if proc.returncode:
                raise RuntimeError(proc.stderr)
            return [doc for doc in proc.stdout.split("\n---") if doc.strip()]

        def lint_cli() -> str:
            proc = subprocess.run(
                ["helm", "lint", "--strict", str(CHART)],
                capture_output=True,
                text=True,
                check=False,
            )
            return "" if proc.returncode == 0 else proc.stdout + proc.stderr

        def notes_cli(values: dict[str, Any]) -> str:
            # `helm template` leaves NOTES.txt out; a client-side dry run prints it last.
            install = ["helm", "install", "kup", str(CHART), "-n", "kube-system"]
            proc = subprocess.run(
                [*install, "--dry-run=client", "-f", "-"],
                input=json.dumps(values),
                capture_output=True,
                text=True,
                check=False,
            )
            if proc.returncode:
                raise RuntimeError(proc.stderr)
            return proc.stdout.split("\nNOTES:\n", 1)[1]

        return template_cli, lint_cli, notes_cli
    try:
        import helm_python
    except ImportError:
        return None

    def template_sdk(values: dict[str, Any]) -> list[str]:
        with helm_python.Chart.load(str(CHART)) as chart:
            try:
                rendered = chart.render(values, name="kup", namespace="kube-system")
            except helm_python.HelmError as exc:
                raise RuntimeError(str(exc)) from exc
        return [
            doc
            for name, text in rendered.items()
            if name.endswith(".yaml")
            for doc in text.split("\n---")
            if doc.strip()
        ]

    def lint_sdk() -> str:
        report = helm_python.lint(str(CHART), strict=True)
        problems = [m["error"] for m in report["messages"] if m["severity"] >= 2]
        return "\n".join(problems + report["errors"])

    def notes_sdk(values: dict[str, Any]) -> str:
        with helm_python.Chart.load(str(CHART)) as chart:
            rendered = chart.render(values, name="kup", namespace="kube-system")
        (notes,) = [text for name, text in rendered.items() if name.endswith("/NOTES.txt")]
        return notes

    return template_sdk, lint_sdk, notes_sdk


HELM = helm_backend()
needs_helm = pytest.mark.skipif(
    HELM is None, reason="neither the helm binary nor the helm_python package is installed"
)
KIND_VALUES = {"apiServer": {"host": "kind-control-plane"}}
MONITORING_VALUES = {
    "config": {"metricsBindAddress": "0.0.0.0:10249"},
    "serviceMonitor": {"enabled": True},
    "podMonitor": {"enabled": True},
    # A PodMonitor needs declared container ports: no surge (see values.yaml).
    "updateStrategy": {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    },
}


def render(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    assert HELM is not None
    if not values.get("apiServer", {}).get("host") and not values.get("kubeconfig"):
        values = {**values, **KIND_VALUES}  # the chart needs one way to the API server
    objects = [yaml.safe_load(doc) for doc in HELM[0](values)]
    return {obj["kind"]: obj for obj in objects if obj}


@needs_helm
def test_helm_lint_strict_passes() -> None:
    assert HELM is not None
    assert HELM[1]() == ""


@needs_helm
def test_helm_template_renders_the_node_proxy() -> None:
    objects = render(KIND_VALUES)
    assert set(objects) == {
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",
        "DaemonSet",
    }
    for obj in objects.values():
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "kube-userspace-proxy"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
    pod = objects["DaemonSet"]["spec"]["template"]["spec"]
    strategy = objects["DaemonSet"]["spec"]["updateStrategy"]
    # The new pod starts beside the old one and takes its sockets over (no refusals).
    assert strategy == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    assert pod["hostNetwork"] is True
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert {"operator": "Exists"} in pod["tolerations"]
    (container,) = pod["containers"]
    assert "NET_ADMIN" in container["securityContext"]["capabilities"]["add"]
    assert "--hostname-override=$(NODE_NAME)" in container["args"]
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["KUBERNETES_SERVICE_HOST"]["value"] == "kind-control-plane"
    # hostNetwork container ports are host ports: a surge pod could not be scheduled.
    assert "ports" not in container
    assert "--after-handover=wait" in container["args"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": 10256}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": 10256}
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/run/xtables.lock", "/var/lib/kube-userspace-proxy"} <= mounts
    binding = objects["ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == objects["ClusterRole"]["metadata"]["name"]
    assert binding["subjects"][0]["name"] == pod["serviceAccountName"]


@needs_helm
def test_rendered_config_map_is_a_config_the_proxy_accepts() -> None:
    config_map = render({})["ConfigMap"]
    document = yaml.safe_load(config_map["data"]["config.conf"])
    assert document["mode"] == "userspace"
    assert document == config_document()
    assert config_from_document(document)["healthz_bind_address"] == "0.0.0.0:10256"


@needs_helm
def test_rendered_cluster_role_equals_the_simply_substituted_one() -> None:
    rendered = render({})["ClusterRole"]
    simple = yaml.safe_load(simple_render((TEMPLATES / "clusterrole.yaml").read_text()))
    assert rendered["rules"] == simple["rules"]


@needs_helm
def test_monitoring_adds_service_monitor_pod_monitor_and_headless_service() -> None:
    objects = render(MONITORING_VALUES)
    assert {"ServiceMonitor", "PodMonitor", "Service"} <= set(objects)
    assert objects["Service"]["spec"]["clusterIP"] == "None"
    assert objects["Service"]["spec"]["ports"][0]["port"] == 10249
    assert objects["ServiceMonitor"]["spec"]["endpoints"][0]["port"] == "metrics"
    container = objects["DaemonSet"]["spec"]["template"]["spec"]["containers"][0]
    assert {p["name"] for p in container["ports"]} == {"healthz", "metrics"}


@needs_helm
def test_pod_monitor_with_a_surge_update_fails_with_a_clear_message() -> None:
    values = {**MONITORING_VALUES, "updateStrategy": {"type": "RollingUpdate"}}
    values["updateStrategy"]["rollingUpdate"] = {"maxSurge": 1, "maxUnavailable": 0}
    with pytest.raises(RuntimeError, match="use serviceMonitor, or set maxSurge: 0"):
        render(values)


@needs_helm
def test_monitoring_with_loopback_metrics_fails_with_a_clear_message() -> None:
    values = {**MONITORING_VALUES, "config": {"metricsBindAddress": "127.0.0.1:10249"}}
    with pytest.raises(RuntimeError, match="metricsBindAddress off loopback"):
        render(values)


@needs_helm
def test_helm_enforces_the_schema() -> None:
    with pytest.raises(RuntimeError, match="typo"):
        render({"typo": True})


@needs_helm
def test_disabled_health_address_drops_the_probes() -> None:
    no_surge = {"rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    values = {"config": {"healthzBindAddress": ""}, "updateStrategy": no_surge}
    pod = render(values)["DaemonSet"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert "livenessProbe" not in container and "readinessProbe" not in container
    assert [p["name"] for p in container["ports"]] == ["metrics"]


# -- image and kind walkthrough files -------------------------------------------------------


def test_image_entrypoint_is_the_installed_command_the_chart_runs() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r"^kube-userspace-proxy = ", pyproject, re.M)
    assert 'ENTRYPOINT ["kube-userspace-proxy"]' in dockerfile
    assert 'command: ["kube-userspace-proxy"]' in (TEMPLATES / "daemonset.yaml").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", dockerfile, re.M)
    assert "apt-get install -y --no-install-recommends iptables" in dockerfile


def in_build_context(path: str) -> bool:
    """Whether .dockerignore lets `path` into the image's build context (Docker's rules:
    the last matching pattern wins, `!` lets in, a matched directory takes its contents)."""
    parts = path.split("/")
    inside = True
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pattern = line.removeprefix("!").rstrip("/")
        if pattern.startswith("**/"):
            hit = any(fnmatch.fnmatchcase(part, pattern[3:]) for part in parts)
        else:  # the path itself or the directory holding it, at the pattern's depth
            depth = pattern.count("/") + 1
            hit = len(parts) >= depth and fnmatch.fnmatchcase("/".join(parts[:depth]), pattern)
        if hit:
            inside = line.startswith("!")
    return inside


def test_build_context_holds_what_the_dockerfile_copies_and_no_virtualenv() -> None:
    copied = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not words[1].startswith("--from"):
            copied += words[1:-1]
    assert {"pyproject.toml", "README.md", "LICENSE", "src"} <= set(copied)
    for source in copied:
        assert (ROOT / source).exists(), source
        assert in_build_context(source), f"{source} is copied but .dockerignore leaves it out"
    assert in_build_context("src/kube_userspace_proxy/ops/static/debug-ui.html")
    for left_out in (
        ".venv/bin/python",
        ".venv-floors/bin/python",
        ".git/HEAD",
        ".site/index.html",
        ".mypy_cache/3.11/x.json",
        ".ruff_cache/CACHEDIR.TAG",
        ".pytest_cache/README.md",
        "tests/unit/test_chart.py",
        "benchmarks/results/peers.json",
        "src/kube_userspace_proxy/__pycache__/cli.cpython-311.pyc",
    ):
        assert not in_build_context(left_out), left_out


def test_image_healthcheck_asks_the_default_health_address() -> None:
    port = VALUES["config"]["healthzBindAddress"].rsplit(":", 1)[1]
    healthcheck = re.search(r"HEALTHCHECK.*?\n(?:.*\\\n)*.*", (ROOT / "Dockerfile").read_text())
    assert healthcheck is not None
    assert f"127.0.0.1:{port}/healthz" in healthcheck.group(0)


def test_kind_cluster_has_no_kube_proxy() -> None:
    cluster = yaml.safe_load((ROOT / "deploy" / "kind.yaml").read_text())
    assert cluster["networking"]["kubeProxyMode"] == "none"
    assert "name" not in cluster  # "kind": the control plane is kind-control-plane


def test_myapp_is_three_replicas_behind_a_cluster_ip_service() -> None:
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "myapp.yaml").read_text()))
    objects = {doc["kind"]: doc for doc in docs}
    deployment, service = objects["Deployment"], objects["Service"]
    assert deployment["apiVersion"] == "apps/v1"
    assert deployment["spec"]["replicas"] == 3
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"].startswith("nginx")
    assert service["spec"]["ports"][0]["targetPort"] == container["ports"][0]["containerPort"]


@needs_helm
def test_helm_refuses_to_render_without_a_way_to_the_api_server() -> None:
    assert HELM is not None
    with pytest.raises(RuntimeError, match=r"set apiServer\.host .* or kubeconfig\.configMap"):
        HELM[0]({})


@needs_helm
def test_helm_renders_extra_volumes_and_kubeadms_kubeconfig() -> None:
    values = {
        "kubeconfig": {"configMap": "kube-proxy"},
        "extraVolumes": [{"name": "certs", "hostPath": {"path": "/etc/pki"}}],
        "extraVolumeMounts": [{"name": "certs", "mountPath": "/etc/pki", "readOnly": True}],
        "extraArgs": ["--metrics-per-service-port=false"],
    }
    pod = render(values)["DaemonSet"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert {"name": "certs", "hostPath": {"path": "/etc/pki"}} in pod["volumes"]
    assert {"name": "certs", "mountPath": "/etc/pki", "readOnly": True} in container["volumeMounts"]
    assert "--kubeconfig=/var/lib/kube-proxy/kubeconfig.conf" in container["args"]
    assert "--metrics-per-service-port=false" in container["args"]


def notes(values: dict[str, Any]) -> str:
    assert HELM is not None
    return " ".join(HELM[2](values).split())  # one line: the template wraps its sentences


@needs_helm
def test_notes_with_kubeadms_kubeconfig_name_its_server_not_the_cluster_ip() -> None:
    # The migration guide's path: the proxy reads kubeadm's kubeconfig, which names the
    # control plane; neither the ClusterIP nor apiServer.host is involved.
    text = notes({"kubeconfig": {"configMap": "kube-proxy"}})
    assert "ConfigMap kube-system/kube-proxy (key kubeconfig.conf), passed as --kubeconfig" in text
    assert "get configmap kube-proxy -o jsonpath='{.data.kubeconfig\\.conf}'" in text
    assert "apiServer.host is empty" not in text and "set apiServer.host" not in text
    assert "directly at" not in text


@needs_helm
def test_notes_with_an_api_server_host_name_that_address() -> None:
    text = notes({"apiServer": {"host": "kind-control-plane", "port": 6443}})
    assert "directly at https://kind-control-plane:6443" in text
    assert "--kubeconfig" not in text


@needs_helm
def test_notes_say_which_way_wins_when_several_are_given() -> None:
    text = notes(
        {
            "apiServer": {"host": "10.0.0.5"},
            "kubeconfig": {"configMap": "kube-proxy"},
            "extraArgs": ["--master=https://10.0.0.9:6443"],
        }
    )
    assert "passed as --kubeconfig" in text and "directly at" not in text
    assert "apiServer.host (10.0.0.5) is not used: the kubeconfig takes precedence" in text
    assert "extraArgs' --master=https://10.0.0.9:6443 overrides that server" in text


def test_security_context_defaults_runtime_seccomp_and_no_net_raw() -> None:
    context = VALUES["securityContext"]
    assert context["seccompProfile"] == {"type": "RuntimeDefault"}
    assert context["capabilities"] == {"add": ["NET_ADMIN"], "drop": ["ALL"]}
    daemonset = (TEMPLATES / "daemonset.yaml").read_text()
    # NET_RAW is added by the template, for the backends that may use the legacy tables only.
    assert 'has .Values.iptablesBackend (list "iptc" "auto")' in daemonset
    assert '"NET_RAW"' in daemonset


def test_state_directory_is_a_host_path() -> None:
    assert VALUES["stateDir"] == "/var/lib/kube-userspace-proxy"
    daemonset = (TEMPLATES / "daemonset.yaml").read_text()
    assert "mountPath: {{ .Values.stateDir }}" in daemonset
    assert "path: {{ .Values.stateDir }}\n            type: DirectoryOrCreate" in daemonset


@needs_helm
@pytest.mark.parametrize(("backend", "raw"), [("auto", True), ("iptc", True), ("restore", False)])
def test_net_raw_only_for_backends_that_may_use_the_legacy_tables(backend: str, raw: bool) -> None:
    objects = render({**KIND_VALUES, "iptablesBackend": backend})
    pod = objects["DaemonSet"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    context = container["securityContext"]
    assert context["seccompProfile"] == {"type": "RuntimeDefault"}
    assert ("NET_RAW" in context["capabilities"]["add"]) is raw
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["state"]["hostPath"] == {
        "path": "/var/lib/kube-userspace-proxy",
        "type": "DirectoryOrCreate",
    }


@needs_helm
def test_a_node_proxy_without_rules_is_refused_by_the_schema() -> None:
    # `--iptables-backend none` is for the demo and manifests on a laptop; a DaemonSet that
    # installs no rules would proxy nothing, so the chart's schema refuses it at render time.
    with pytest.raises(RuntimeError, match="iptablesBackend"):
        render({**KIND_VALUES, "iptablesBackend": "none"})


def test_no_memory_limit_and_a_request_from_measured_rss() -> None:
    # An OOM kill cuts every proxied connection on the node (docs/failure-modes.md).
    assert "limits" not in VALUES["resources"]
    assert VALUES["resources"]["requests"]["memory"] == "192Mi"


def test_preserve_source_ip_passes_the_flags_the_proxy_accepts() -> None:
    values = {**KIND_VALUES, "preserveSourceIP": {"enabled": True, "mark": "0x20000", "table": 7}}
    pod = render(values)["DaemonSet"]["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    flags = ["--preserve-source-ip", "--transparent-mark=0x20000", "--transparent-table=7"]
    assert all(flag in args for flag in flags)
    parsed = cli.make_parser().parse_args(["run", *flags])
    config = cli.parse_config(parsed)
    assert (config.preserve_source_ip, config.transparent_mark, config.transparent_table) == (
        True,
        0x20000,
        7,
    )
    plain = render(KIND_VALUES)["DaemonSet"]["spec"]["template"]["spec"]
    assert not any("transparent" in a or "preserve" in a for a in plain["containers"][0]["args"])
