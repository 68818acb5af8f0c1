"""The command line: every option with unit and default; a bad flag exits 2 and a value
kube-proxy's validation refuses exits 1, each in one line."""

from __future__ import annotations

import pytest

from kube_userspace_proxy import cli
from kube_userspace_proxy.config.fields import RUN_FIELDS


def test_help_lists_every_run_option_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag in RUN_FIELDS:
        assert flag.flag in text
    # Defaults as kube-proxy's --help spells them.
    assert "--udp-timeout duration" in text and "default 250ms)" in text
    assert "default 30s)" in text and "default 0.0.0.0:10256)" in text
    assert text.count("default ") >= len(RUN_FIELDS)


def test_help_shows_type_words_and_go_defaults_not_python_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for words in (
        "--udp-timeout duration",
        "--bind-address string",
        "--nodeport-addresses strings",
        "--kube-api-burst int",
        "--healthz-bind-address ipport",
        "--proxy-port-range port-range",
        "-v, --v int",
    ):
        assert words in text
    # A boolean takes no type word, and its default is Go's `true`.
    assert "--guard-proxy-ports REJECT" in text and "default true)" in text
    assert "default 5)" in text  # --kube-api-qps: Go prints 5, not 5.0
    for python in ("UDP_IDLE_TIMEOUT", "default: True", "None: leave it", "kube_api_qps"):
        assert python not in text
    for flag in RUN_FIELDS:
        assert f"{flag.flag} {flag.name.upper()}" not in text


@pytest.mark.parametrize("command", ["run", "rules", "demo", "cleanup"])
def test_each_command_help_starts_with_what_it_does(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    first = out.split("\n\n")[0]
    assert not first.startswith("usage") and first.rstrip().endswith(".")
    assert f"usage: kube-userspace-proxy {command} [flags]" in out


def test_rules_help_lists_only_the_flags_that_change_its_output(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        cli.main(["rules", "--help"])
    out = capsys.readouterr().out
    invocations = [line.split() for line in out.splitlines() if line.startswith("  -")]
    named = {word.rstrip(",") for words in invocations for word in words}
    listed = {flag.flag for flag in RUN_FIELDS if flag.flag in named}
    expected = {flag.flag for flag in RUN_FIELDS if "rules" in flag.commands}
    assert listed == expected
    assert "--manifests" in out and "--hostname-override" in out
    for run_only in ("--udp-timeout", "--workers", "--state-dir", "--cleanup", "--masquerade-all"):
        assert run_only not in out
    # ... yet it takes them, so a node's command line can be pasted after `rules`.
    args = cli.make_parser().parse_args(["rules", "--udp-timeout", "1s", "--masquerade-all"])
    assert args.udp_idle_timeout == 1.0


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["run", "--udp-timeout", "5x"], "--udp-timeout"),
        (["run", "--no-such-flag"], "--no-such-flag"),
        (["run", "--iptables-backend", "ipvs"], "--iptables-backend"),
        (["--kube-api-burst", "many"], "--kube-api-burst"),
    ],
)
def test_a_bad_flag_exits_2_with_one_line_naming_it(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert named in err


def test_a_bad_value_caught_by_validation_exits_1_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = cli.main(["run", "--manifests", "x.yaml", "--bind-address", "not-an-ip"])
    assert code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert '--bind-address: Invalid value: "not-an-ip"' in err and "bind_address" not in err


def test_flags_alone_mean_run() -> None:
    assert cli._argv_with_default_command(["--kubeconfig", "k"]) == ["run", "--kubeconfig", "k"]
    assert cli._argv_with_default_command(["demo"]) == ["demo"]


def test_config_file_and_flags_merge(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "kp.yaml"
    path.write_text("kind: KubeProxyConfiguration\nportRange: 30000-30010\nudpIdleTimeout: 2s\n")
    args = cli.make_parser().parse_args(
        [
            "run",
            "--config",
            str(path),
            "--udp-timeout",
            "500ms",
            "--nodeport-addresses",
            "10.0.0.0/8",
        ]
    )
    config = cli.parse_config(args)
    assert config.proxy_port_range == "30000-30010"
    assert config.udp_idle_timeout == 0.5
    assert config.nodeport_addresses == ("10.0.0.0/8",)


def test_a_missing_kubeconfig_exits_2_before_serving(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    code = cli.main(
        [
            "run",
            "--kubeconfig",
            str(tmp_path / "absent"),
            "--iptables-backend",
            "none",
            "--healthz-bind-address",
            "",
            "--metrics-bind-address",
            "",
            "--state-dir",
            str(tmp_path / "state"),
        ]
    )
    assert code == 2
    assert "absent" in capsys.readouterr().err


def test_list_flags_take_commas_and_repeats() -> None:
    args = cli.make_parser().parse_args(
        ["run", "--node-ip", "10.0.0.5", "--node-ip", "fd00::5,10.0.0.6", "--manifests", "m"]
    )
    assert cli.parse_config(args).node_ips == ("10.0.0.5", "fd00::5", "10.0.0.6")
