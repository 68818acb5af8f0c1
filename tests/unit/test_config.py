"""ProxyConfig: Go durations, the KubeProxyConfiguration file, precedence and errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from kube_userspace_proxy.config.settings import (
    ProxyConfig,
    build_config,
    config_from_document,
    format_duration,
    parse_duration,
    read_config_file,
)
from kube_userspace_proxy.errors import ConfigError

# A kube-proxy ConfigMap's config.conf as kubeadm writes it, switched to userspace mode.
KUBEADM_CONFIG = """\
apiVersion: kubeproxy.config.k8s.io/v1alpha1
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection:
  acceptContentTypes: ""
  burst: 0
  contentType: ""
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 0
clusterCIDR: 10.244.0.0/16
configSyncPeriod: 0s
conntrack:
  maxPerCore: null
  min: null
  tcpCloseWaitTimeout: null
  tcpEstablishedTimeout: null
detectLocal:
  bridgeInterface: ""
  interfaceNamePrefix: ""
detectLocalMode: ""
enableProfiling: false
healthzBindAddress: ""
hostnameOverride: ""
iptables:
  localhostNodePorts: null
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 2s
  syncPeriod: 45s
ipvs:
  excludeCIDRs: null
  minSyncPeriod: 0s
  scheduler: ""
  strictARP: false
  syncPeriod: 0s
  tcpFinTimeout: 0s
  tcpTimeout: 0s
  udpTimeout: 0s
kind: KubeProxyConfiguration
logging:
  flushFrequency: 0
  options:
    json:
      infoBufferSize: "0"
  verbosity: 0
metricsBindAddress: ""
mode: userspace
nodePortAddresses: null
oomScoreAdj: null
portRange: ""
showHiddenMetricsForVersion: ""
winkernel:
  enableDSR: false
  forwardHealthCheckVip: false
  networkName: ""
  rootHnsEndpointName: ""
  sourceVip: ""
"""


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("250ms", 0.25), ("30s", 30.0), ("1m30s", 90.0), ("1h", 3600.0), ("0", 0.0), ("1.5s", 1.5)],
)
def test_go_durations_parse_to_seconds(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["5x", "s", "1m-3s", "ten seconds", "-1s"])
def test_bad_durations_are_rejected(text: str) -> None:
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration(text)


def test_durations_print_the_go_way() -> None:
    assert [format_duration(s) for s in (0.25, 30, 900, 1)] == ["250ms", "30s", "15m0s", "1s"]


def test_a_kubeadm_kube_proxy_configmap_in_userspace_mode_loads(tmp_path: Path) -> None:
    path = tmp_path / "config.conf"
    path.write_text(KUBEADM_CONFIG)
    config = build_config(read_config_file(path), {})
    assert config.sync_period == 45.0
    assert config.min_sync_period == 2.0
    assert config.kubeconfig == "/var/lib/kube-proxy/kubeconfig.conf"
    assert config.cluster_cidr == "10.244.0.0/16"
    # Empty strings in the file mean "default", as in kube-proxy.
    assert config.healthz_bind_address == "0.0.0.0:10256"


def test_flags_override_the_file_which_overrides_defaults() -> None:
    file_values = config_from_document(
        {"kind": "KubeProxyConfiguration", "udpIdleTimeout": "1s", "portRange": "30000-30100"}
    )
    config = build_config(file_values, {"proxy_port_range": "40000+10", "udp_idle_timeout": None})
    assert config.proxy_port_range == "40000+10"  # the flag wins
    assert config.udp_idle_timeout == 1.0  # the file wins over the default
    assert config.sync_period == ProxyConfig().sync_period  # default


def test_another_kind_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"field kind: expected KubeProxyConfiguration"):
        config_from_document({"kind": "KubeletConfiguration"})


def test_a_bad_value_names_the_field_and_reason() -> None:
    file_values = config_from_document({"iptables": {"syncPeriod": "soon"}})
    with pytest.raises(
        ConfigError,
        match=r'^--config f.yaml: KubeProxyConfiguration.iptables.syncPeriod: Invalid value: "soon"'
        r": invalid duration",
    ):
        build_config(file_values, {}, source="--config f.yaml")


def test_a_bad_bind_address_is_refused() -> None:
    with pytest.raises(
        ConfigError,
        match=r'^--healthz-bind-address: Invalid value: "localhost": must be a valid IP',
    ):
        build_config({}, {"healthz_bind_address": "localhost:x"})


def test_a_bad_port_range_is_refused() -> None:
    with pytest.raises(ConfigError, match="invalid port range"):
        build_config({}, {"proxy_port_range": "300-200"})


def test_invalid_yaml_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("kind: KubeProxyConfiguration\nmode: [userspace\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: line 3: not valid YAML"):
        read_config_file(path)


def test_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="No such file"):
        read_config_file(tmp_path / "absent.yaml")


def test_an_ipvs_mode_configmap_keeps_its_scheduler() -> None:
    file_values = config_from_document(
        {"kind": "KubeProxyConfiguration", "mode": "ipvs", "ipvs": {"scheduler": "lc"}}
    )
    assert build_config(file_values, {}).balancing.scheduler == "lc"


def test_the_scheduler_flag_wins_over_the_file() -> None:
    file_values = config_from_document(
        {"kind": "KubeProxyConfiguration", "ipvs": {"scheduler": "lc"}}
    )
    assert build_config(file_values, {"scheduler": "sh"}).scheduler == "sh"


def test_ejection_is_on_by_default_with_envoys_numbers() -> None:
    balancing = ProxyConfig().balancing
    assert (balancing.scheduler, balancing.outlier_failures) == ("rr", 5)
    assert balancing.outlier_base_ejection == 30.0
