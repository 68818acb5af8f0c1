"""kube-proxy's command line (1.25 to 1.32) in pflag syntax: applied, or accepted with a warning."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kube_userspace_proxy import cli
from kube_userspace_proxy.config.settings import build_config, config_from_document

# Every flag kube-proxy 1.25 to 1.32 registers (from its AddFlags, logs and klog flag sets),
# written down here independently of the parser, with a value each would take.
KUBE_PROXY_FLAGS = {
    "--config": "/tmp/absent-in-this-test",
    "--write-config-to": None,
    "--cleanup": "false",
    "--feature-gates": "A=true,B=false",
    "--kubeconfig": "/var/lib/kube-proxy/kubeconfig.conf",
    "--master": "https://10.0.0.1:6443",
    "--kube-api-content-type": "application/json",
    "--kube-api-burst": "20",
    "--kube-api-qps": "10",
    "--hostname-override": "node-1",
    "--bind-address": "0.0.0.0",
    "--healthz-bind-address": "0.0.0.0:10256",
    "--metrics-bind-address": "127.0.0.1:10249",
    "--bind-address-hard-fail": "true",
    "--profiling": "true",
    "--show-hidden-metrics-for-version": "1.31",
    "--init-only": "false",
    "--proxy-mode": "iptables",
    "--iptables-masquerade-bit": "14",
    "--masquerade-all": "true",
    "--iptables-localhost-nodeports": "false",
    "--iptables-sync-period": "30s",
    "--iptables-min-sync-period": "1s",
    "--ipvs-sync-period": "30s",
    "--ipvs-min-sync-period": "0s",
    "--ipvs-scheduler": "rr",
    "--ipvs-exclude-cidrs": "10.0.0.0/8",
    "--ipvs-strict-arp": "true",
    "--ipvs-tcp-timeout": "0s",
    "--ipvs-tcpfin-timeout": "0s",
    "--ipvs-udp-timeout": "0s",
    "--detect-local-mode": "ClusterCIDR",
    "--pod-bridge-interface": "cni0",
    "--pod-interface-name-prefix": "veth",
    "--cluster-cidr": "10.244.0.0/16",
    "--nodeport-addresses": "10.0.0.0/8",
    "--oom-score-adj": "-999",
    "--conntrack-max-per-core": "32768",
    "--conntrack-min": "131072",
    "--conntrack-tcp-timeout-established": "24h0m0s",
    "--conntrack-tcp-timeout-close-wait": "1h0m0s",
    "--conntrack-tcp-be-liberal": "true",
    "--conntrack-udp-timeout": "30s",
    "--conntrack-udp-timeout-stream": "300s",
    "--config-sync-period": "15m0s",
    "--healthz-port": "10256",
    "--metrics-port": "10249",
    "--proxy-port-range": "30000-30100",
    "--udp-timeout": "250ms",
    "--logging-format": "text",
    "--log-flush-frequency": "5s",
    "--log-json-info-buffer-size": "0",
    "--log-json-split-stream": "false",
    "--log-text-info-buffer-size": "0",
    "--log-text-split-stream": "false",
    "--v": "2",
    "--vmodule": "proxier=4",
    "--windows-service": "false",
    "--add-dir-header": "false",
    "--alsologtostderr": "false",
    "--log-backtrace-at": ":0",
    "--log-dir": "/tmp",
    "--log-file": "/tmp/kube-proxy.log",
    "--log-file-max-size": "1800",
    "--logtostderr": "true",
    "--one-output": "false",
    "--skip-headers": "false",
    "--skip-log-headers": "false",
    "--stderrthreshold": "2",
    "--azure-container-registry-config": "",
}


def parse(*argv: str) -> object:
    return cli.make_parser().parse_args(["run", *argv])


@pytest.mark.parametrize("flag", sorted(set(KUBE_PROXY_FLAGS) - {"--write-config-to"}))
def test_every_kube_proxy_flag_is_accepted_in_pflag_syntax(flag: str) -> None:
    parse(f"{flag}={KUBE_PROXY_FLAGS[flag]}")


def test_kubeadms_daemonset_command_line_parses_unchanged(tmp_path: Path) -> None:
    config = tmp_path / "config.conf"
    config.write_text("kind: KubeProxyConfiguration\n")
    args = parse(f"--config={config}", "--hostname-override=$(NODE_NAME)")
    proxy_config = cli.parse_config(args)  # type: ignore[arg-type]
    assert proxy_config.hostname_override == "$(NODE_NAME)"  # the kubelet expands it


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--masquerade-all"], "true"),
        (["--masquerade-all=false"], "false"),
        (["--ipvs-sync-period=30s"], "30s"),
        (["--ipvs-sync-period", "30s"], "30s"),
    ],
)
def test_an_ignored_flag_gets_one_warning_naming_it(
    argv: list[str], expected: str, caplog: pytest.LogCaptureFixture
) -> None:
    args = parse("--manifests", "x.yaml", *argv)
    with caplog.at_level(logging.WARNING):
        cli.parse_config(args)  # type: ignore[arg-type]
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith(argv[0].split("=")[0] + " is a kube-proxy flag")
    assert getattr(args, cli._ignored_dest(argv[0].split("=")[0])) == expected


@pytest.mark.parametrize(("value", "scheduler"), [("lc", "lc"), ("sh", "sh"), ("wlc", "lc")])
def test_ipvs_scheduler_flag_sets_the_default_scheduler(value: str, scheduler: str) -> None:
    config = cli.parse_config(parse("--manifests", "x", f"--ipvs-scheduler={value}"))  # type: ignore[arg-type]
    assert config.scheduler == scheduler
    assert config.balancing.scheduler == scheduler


def test_an_unknown_ipvs_scheduler_is_rr_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        config = cli.parse_config(parse("--manifests", "x", "--ipvs-scheduler=bogus"))  # type: ignore[arg-type]
    assert config.scheduler == "rr"
    warnings = [r.getMessage() for r in caplog.records if "'bogus'" in r.getMessage()]
    assert len(warnings) == 1


def test_outlier_flags_set_the_ejection_defaults() -> None:
    config = cli.parse_config(
        parse(  # type: ignore[arg-type]
            "--manifests",
            "x",
            "--outlier-consecutive-failures=3",
            "--outlier-base-ejection-time=10s",
        )
    )
    assert (config.balancing.outlier_failures, config.balancing.outlier_base_ejection) == (3, 10.0)


def test_another_proxy_mode_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        config = cli.parse_config(parse("--manifests", "x", "--proxy-mode=ipvs"))  # type: ignore[arg-type]
    assert any("--proxy-mode=ipvs ignored" in r.getMessage() for r in caplog.records)
    assert config.manifests == ("x",)


def test_a_bare_ip_bind_address_flag_gets_the_default_port() -> None:
    args = parse("--healthz-bind-address=10.1.2.3", "--metrics-bind-address=::1")
    config = cli.parse_config(args)  # type: ignore[arg-type]
    assert config.healthz_bind_address == "10.1.2.3:10256"
    assert config.metrics_bind_address == "[::1]:10249"


def test_deprecated_port_flags_move_the_port_and_zero_disables() -> None:
    config = cli.parse_config(parse("--healthz-port=10300", "--metrics-port=0"))  # type: ignore[arg-type]
    assert config.healthz_bind_address == "0.0.0.0:10300"
    assert config.metrics_bind_address == ""


@pytest.mark.parametrize(
    ("argv", "value"),
    [([], False), (["--cleanup"], True), (["--cleanup=false"], False), (["--cleanup=true"], True)],
)
def test_cleanup_takes_pflag_booleans(argv: list[str], value: bool) -> None:
    assert parse(*argv).cleanup is value  # type: ignore[attr-defined]


def test_verbosity_and_logging_format_are_applied() -> None:
    config = cli.parse_config(parse("--v=4", "--logging-format=json"))  # type: ignore[arg-type]
    assert (config.verbosity, config.log_format) == (4, "json")


def test_per_service_port_metrics_can_be_turned_off() -> None:
    assert (
        cli.parse_config(parse("--metrics-per-service-port=false")).metrics_per_service_port
        is False
    )  # type: ignore[arg-type]
    assert cli.parse_config(parse()).metrics_per_service_port is True  # type: ignore[arg-type]


def test_write_config_to_writes_the_effective_configuration(tmp_path: Path) -> None:
    target = tmp_path / "out.yaml"
    code = cli.main(["--iptables-sync-period=45s", f"--write-config-to={target}", "--manifests=x"])
    assert code == 0
    doc = yaml.safe_load(target.read_text())
    assert doc["kind"] == "KubeProxyConfiguration"
    assert doc["iptables"]["syncPeriod"] == "45s"
    assert build_config(config_from_document(doc), {}).sync_period == 45.0


def test_oom_score_adj_is_written_to_the_process() -> None:
    # In a child process, so the test runner's own score is left alone. Raising it needs no
    # privilege, so this works as any user.
    code = (
        "from kube_userspace_proxy import cli\n"
        "assert cli.set_oom_score_adj(500)\n"
        "print(open('/proc/self/oom_score_adj').read().strip())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "500"


def test_help_separates_applied_from_ignored_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    applied, ignored = text.split("kube-proxy flags applied here:")[1].split(
        "kube-proxy flags accepted and ignored"
    )
    assert "--oom-score-adj" in applied and "--hostname-override" in applied
    assert "--ipvs-sync-period" in ignored and "--oom-score-adj" not in ignored
    assert "--ipvs-scheduler" in applied
    # Only kube-proxy's own flags are listed as kube-proxy flags.
    assert {f for f in applied.split() if f.startswith("--")} <= set(KUBE_PROXY_FLAGS)
    listed = set(applied.split()) | set(ignored.split())
    for flag in KUBE_PROXY_FLAGS:
        if flag not in cli._UNLISTED:
            assert flag in listed, flag
