"""kubeadm's kube-proxy ConfigMap (1.25 and 1.32) read as kube-proxy reads it.

The fixtures hold every field kubeadm writes, unset ones as zero values; the proxy must take
kube-proxy's defaults for them, accept every known field, and only warn about the rest.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from kube_userspace_proxy.config.kubeproxy import SCHEMA, set_defaults
from kube_userspace_proxy.config.settings import (
    build_config,
    config_from_document,
    effective_document,
)

FIXTURES = Path(__file__).parent.parent / "fixtures" / "kubeadm"
RELEASES = ["1.25", "1.32"]


def configmap(release: str) -> dict[str, str]:
    """The `data` of kubeadm's kube-proxy ConfigMap for `release`."""
    doc = yaml.safe_load((FIXTURES / f"kube-proxy-configmap-{release}.yaml").read_text())
    data: dict[str, str] = doc["data"]
    return data


def config_document(release: str) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(configmap(release)["config.conf"])
    return document


@pytest.mark.parametrize("release", RELEASES)
def test_kubeadm_config_yields_kube_proxys_effective_values(release: str) -> None:
    config = build_config(config_from_document(config_document(release)), {})
    assert config.sync_period == 30.0
    assert config.min_sync_period == 1.0
    assert config.udp_idle_timeout == 0.25
    assert config.kube_api_qps == 5
    assert config.kube_api_burst == 10
    assert config.config_sync_period == 15 * 60
    assert config.healthz_bind_address == "0.0.0.0:10256"
    assert config.metrics_bind_address == "127.0.0.1:10249"
    assert config.oom_score_adj == -999
    assert config.kubeconfig == "/var/lib/kube-proxy/kubeconfig.conf"
    assert config.cluster_cidr == "10.244.0.0/16"
    assert config.nodeport_addresses == ()
    assert config.verbosity == 0
    assert config.log_format == "text"


@pytest.mark.parametrize("release", RELEASES)
def test_kubeadm_config_loads_without_a_warning(
    release: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        config_from_document(config_document(release), source="config.conf")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO] == []


@pytest.mark.parametrize("release", RELEASES)
def test_every_field_kubeadm_writes_is_a_known_field(release: str) -> None:
    for key, value in config_document(release).items():
        assert key in SCHEMA
        if isinstance(value, dict) and isinstance(SCHEMA[key], dict):
            assert set(value) <= set(SCHEMA[key]), key


@pytest.mark.parametrize("release", RELEASES)
def test_configz_document_is_kube_proxys_camel_case_shape(release: str) -> None:
    config = build_config(config_from_document(config_document(release)), {"verbosity": 2})
    doc = effective_document(config)
    assert doc["apiVersion"] == "kubeproxy.config.k8s.io/v1alpha1"
    assert doc["kind"] == "KubeProxyConfiguration"
    assert doc["iptables"]["syncPeriod"] == "30s"
    assert doc["iptables"]["minSyncPeriod"] == "1s"
    assert doc["iptables"]["masqueradeBit"] == 14
    assert doc["clientConnection"] == {
        "acceptContentTypes": "",
        "burst": 10,
        "contentType": "application/vnd.kubernetes.protobuf",
        "kubeconfig": "/var/lib/kube-proxy/kubeconfig.conf",
        "qps": 5.0,
    }
    assert doc["configSyncPeriod"] == "15m0s"
    assert doc["udpIdleTimeout"] == "250ms"
    assert doc["oomScoreAdj"] == -999
    assert doc["conntrack"]["min"] == 131072
    assert doc["logging"]["verbosity"] == 2  # a flag wins over the file
    assert doc["mode"] == "userspace"
    # The same shape as the file: the document reads back to the same configuration.
    assert build_config(config_from_document(doc), {}) == config.model_copy(
        update={"kube_proxy_config": config_from_document(doc)["kube_proxy_config"]}
    )


def test_zero_means_default_only_where_kube_proxy_defaults() -> None:
    # Pointer fields: null is "unset", an explicit 0 is a value (as in Go).
    doc = set_defaults({"oomScoreAdj": 0, "iptables": {"masqueradeBit": 0}, "ipvs": {}})
    assert doc["oomScoreAdj"] == 0
    assert doc["iptables"]["masqueradeBit"] == 0
    # No default in kube-proxy: the zero value stays.
    assert doc["ipvs"].get("tcpTimeout") is None
    config = build_config(config_from_document({"oomScoreAdj": 0}), {})
    assert config.oom_score_adj == 0


def test_a_bare_ip_bind_address_gets_the_default_port() -> None:
    values = config_from_document({"healthzBindAddress": "10.0.0.1", "metricsBindAddress": "::1"})
    config = build_config(values, {})
    assert config.healthz_bind_address == "10.0.0.1:10256"
    assert config.metrics_bind_address == "[::1]:10249"


def test_an_ipv6_bind_address_moves_the_default_sites_to_ipv6() -> None:
    config = build_config(config_from_document({"bindAddress": "::"}), {})
    assert config.healthz_bind_address == "[::]:10256"
    assert config.metrics_bind_address == "[::1]:10249"


def test_an_unknown_field_is_one_warning_not_an_error(caplog: pytest.LogCaptureFixture) -> None:
    doc = {"kind": "KubeProxyConfiguration", "iptables": {"syncPeriodd": "1s"}, "extra": 1}
    with caplog.at_level(logging.WARNING):
        config = build_config(config_from_document(doc, source="f.yaml"), {})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "extra, iptables.syncPeriodd" in warnings[0]
    assert config.sync_period == 30.0


def test_another_mode_is_one_warning_saying_this_is_userspace(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        config_from_document({"mode": "iptables"}, source="f.yaml")
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "mode 'iptables' ignored" in warning
    assert "userspace mode" in warning


def test_fields_that_mean_nothing_here_are_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    doc = {"ipvs": {"strictARP": True}, "conntrack": {"maxPerCore": 0}, "enableProfiling": True}
    with caplog.at_level(logging.INFO):
        config_from_document(doc, source="f.yaml")
    [line] = [r.getMessage() for r in caplog.records]
    assert line.endswith(
        "not applicable in userspace mode, ignored: enableProfiling, ipvs.strictARP"
    )


def test_node_port_address_keywords_expand() -> None:
    config = build_config(config_from_document({"nodePortAddresses": ["localhost"]}), {})
    assert config.nodeport_addresses == ("127.0.0.0/8", "::1/128")
    config = build_config(config_from_document({"nodePortAddresses": ["10.0.0.0/8", "all"]}), {})
    assert config.nodeport_addresses == ()


def test_logging_section_is_applied() -> None:
    config = build_config(config_from_document({"logging": {"format": "json", "verbosity": 4}}), {})
    assert (config.log_format, config.verbosity) == ("json", 4)


def test_kubeadms_bind_address_leaves_it_unspecified_and_the_flag_does_not() -> None:
    # kubeadm writes bindAddress 0.0.0.0: kube-proxy then serves the node's families, and so
    # does this proxy (an empty bind_address). The flag keeps its literal meaning.
    from_file = config_from_document({"bindAddress": "0.0.0.0"})
    assert build_config(from_file, {}).bind_address == ""
    assert build_config({}, {}).bind_address == ""
    assert build_config(from_file, {"bind_address": "0.0.0.0"}).bind_address == "0.0.0.0"
    assert build_config(config_from_document({"bindAddress": "::"}), {}).bind_address == "::"
    # Written back as kube-proxy's own default, and read back the same.
    written = effective_document(build_config(from_file, {}))
    assert written["bindAddress"] == "0.0.0.0"
    assert build_config(config_from_document(written), {}).bind_address == ""
