"""kube-proxy's flag spellings (pflag's `_` for `-`) and its validation: a value kube-proxy
refuses exits 1 with one line naming the field as kube-proxy does, or the flag."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kube_userspace_proxy import __version__, cli

BASE = ["--manifests", "x.yaml", "--iptables-backend", "none"]


def warnings_of(argv: list[str], caplog: pytest.LogCaptureFixture) -> list[str]:
    """The warnings building the configuration of `run ARGV` logs (argv as the CLI reads it)."""
    args = cli.make_parser().parse_args(["run", *cli.pflag_spelling(argv), *BASE])
    logger = logging.getLogger("kube_userspace_proxy")
    logger.addHandler(caplog.handler)  # after cli.main's logs.setup, which removed it
    try:
        cli.parse_config(args)
    finally:
        logger.removeHandler(caplog.handler)
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def run(tmp_path: Path, *argv: str) -> int:
    """The real entry point, stopping after the configuration is built (--write-config-to)."""
    return cli.main([*argv, *BASE, "--write-config-to", str(tmp_path / "effective.yaml")])


@pytest.mark.parametrize(
    "flag",
    [
        "--log_dir=/var/log",
        "--log_file=/var/log/kube-proxy.log",
        "--add_dir_header",
        "--skip_headers=true",
        "--one_output",
        "--log_file_max_size=1800",
        "--boot-id-file=/proc/sys/kernel/random/boot_id",
        "--boot_id_file=/proc/sys/kernel/random/boot_id",
    ],
)
def test_klog_and_cadvisor_flags_parse_in_kube_proxys_spellings_with_a_warning(
    flag: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert run(tmp_path, flag) == 0
    normalized = flag.split("=", maxsplit=1)[0].replace("_", "-")
    [warning] = warnings_of([flag], caplog)
    assert warning.startswith(f"{normalized} is a kube-proxy flag that does not apply")


def test_any_flag_may_be_written_with_underscores(tmp_path: Path) -> None:
    assert run(tmp_path, "--iptables_sync_period=10s", "--hostname_override", "node_1") == 0
    doc = yaml.safe_load((tmp_path / "effective.yaml").read_text())
    assert doc["iptables"]["syncPeriod"] == "10s"
    assert doc["hostnameOverride"] == "node_1"  # a value keeps its underscores


def test_only_flag_names_are_respelled() -> None:
    argv = ["--log_dir=/a_b", "-v", "2", "x_y", "--", "--not_a_flag"]
    assert cli.pflag_spelling(argv) == ["--log-dir=/a_b", "-v", "2", "x_y", "--", "--not_a_flag"]


def test_run_version_prints_the_version_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--version"]) == 0
    assert cli.main(["--version=raw", "--manifests", "x"]) == 0
    assert capsys.readouterr().out.split("\n")[:2] == [f"kube-userspace-proxy {__version__}"] * 2


def test_a_daemonset_with_klogs_underscore_flags_starts(tmp_path: Path) -> None:
    """The process as a DaemonSet runs it: exit 0, not 2 (which crash-loops the pod)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kube_userspace_proxy",
            "--log_dir=/var/log",
            "--logtostderr=false",
            "--log_file_max_size=1800",
            *BASE,
            "--write-config-to",
            str(tmp_path / "effective.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["--proxy-mode=bogus"],
            '--proxy-mode: Invalid value: "bogus": must be iptables, ipvs, nftables, userspace',
        ),
        (
            ["--iptables-min-sync-period=1m", "--iptables-sync-period=30s"],
            '--iptables-min-sync-period: Invalid value: "1m0s": must be less than or equal to'
            " --iptables-sync-period (30s)",
        ),
        (["--kube-api-qps=-1"], "--kube-api-qps: Invalid value: -1: must be greater than or"),
        (["--kube-api-burst=-5"], "--kube-api-burst: Invalid value: -5: must be greater than or"),
        (
            ["--nodeport-addresses=10.0.0.0/8,nope"],
            '--nodeport-addresses[1]: Invalid value: "nope": must be a valid CIDR',
        ),
        (
            ["--nodeport-addresses=primary,10.0.0.0/8"],
            "--nodeport-addresses[0]: Invalid value: \"primary\": can't use both 'primary' and"
            " CIDRs",
        ),
        (
            ["--cluster-cidr=10.0.0.0/8,10.1.0.0/16"],
            '--cluster-cidr: Invalid value: "10.0.0.0/8,10.1.0.0/16": must be a valid DualStack',
        ),
        (["--cluster-cidr=10.0.0.0"], '--cluster-cidr: Invalid value: "10.0.0.0": must be a'),
        (
            ["--bind-address=nope"],
            '--bind-address: Invalid value: "nope": not a valid textual representation',
        ),
        (["--healthz-bind-address=nope"], '--healthz-bind-address: Invalid value: "nope": must'),
        (
            ["--metrics-bind-address=1.2.3.4:99999"],
            '--metrics-bind-address: Invalid value: "99999": must be a valid port',
        ),
        (["--udp-timeout=0s"], '--udp-timeout: Invalid value: "0s": must be greater than 0'),
        (["--config-sync-period=0"], '--config-sync-period: Invalid value: "0s": must be'),
        (["--oom-score-adj=5000"], "--oom-score-adj: Invalid value: 5000: must be within"),
    ],
)
def test_a_flag_kube_proxy_refuses_exits_1_naming_the_flag(
    argv: list[str], line: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(tmp_path, *argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert line in err, err
    assert not (tmp_path / "effective.yaml").exists()


@pytest.mark.parametrize(
    ("document", "line"),
    [
        (
            {"mode": "bogus"},
            'KubeProxyConfiguration.mode: Invalid value: "bogus": must be iptables',
        ),
        (
            {"iptables": {"minSyncPeriod": "1m", "syncPeriod": "10s"}},
            'KubeProxyConfiguration.iptables.minSyncPeriod: Invalid value: "1m": must be less'
            " than or equal to KubeProxyConfiguration.iptables.syncPeriod (10s)",
        ),
        (
            {"clientConnection": {"qps": -2}},
            "KubeProxyConfiguration.clientConnection.qps: Invalid value: -2: must be greater",
        ),
        (
            {"nodePortAddresses": ["10.0.0.0/8", "primary"]},
            'KubeProxyConfiguration.nodePortAddresses[1]: Invalid value: "primary": can\'t use'
            " both 'primary' and CIDRs",
        ),
        (
            {"healthzBindAddress": "nope:x"},
            'KubeProxyConfiguration.healthzBindAddress: Invalid value: "nope": must be a valid IP',
        ),
        (
            {"iptables": {"syncPeriod": "soon"}},
            'KubeProxyConfiguration.iptables.syncPeriod: Invalid value: "soon": invalid duration',
        ),
    ],
)
def test_a_config_file_kube_proxy_refuses_exits_1_naming_the_field(
    document: dict[str, object], line: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"kind": "KubeProxyConfiguration", **document}))
    assert run(tmp_path, f"--config={path}") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"--config {path}: {line}" in err, err
    assert "_" not in err.split("Invalid value")[0].replace("--config " + str(path), "")


def test_several_problems_are_one_line_as_go_aggregates_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(tmp_path, "--bind-address=x", "--kube-api-burst=-1") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert '[--bind-address: Invalid value: "x"' in err and ", --kube-api-burst: " in err


@pytest.mark.parametrize("mode", ["iptables", "ipvs", "nftables", "userspace", ""])
def test_a_mode_kube_proxy_knows_is_served_as_userspace(
    mode: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"kind": "KubeProxyConfiguration", "mode": mode}))
    assert run(tmp_path, f"--config={path}", f"--proxy-mode={mode}") == 0
    warned = warnings_of([f"--config={path}", f"--proxy-mode={mode}"], caplog)
    # One warning for the file's mode, one for the flag's: this proxy is userspace mode.
    assert len(warned) == (0 if mode in ("", "userspace") else 2), warned
