"""Command line: `run` (kube-proxy compatible flags), `demo`, `rules`, `cleanup`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import yaml

from kube_userspace_proxy import __version__, app, demo, logs
from kube_userspace_proxy.config.fields import FIELDS, KUBE_PROXY_FLAGS_APPLIED, Field
from kube_userspace_proxy.config.kubeproxy import (
    DEFAULT_HEALTHZ_PORT,
    DEFAULT_METRICS_PORT,
    with_port,
)
from kube_userspace_proxy.config.settings import (
    DEFAULTS,
    ProxyConfig,
    build_config,
    effective_document,
    field_doc,
    format_duration,
    parse_duration,
    read_config_file,
    split_host_port,
)
from kube_userspace_proxy.config.validation import mode_problem
from kube_userspace_proxy.errors import ConfigError, InvalidConfigError, ProxyError
from kube_userspace_proxy.portals import cleanup_all

log = logs.get(__name__)

PROG = "kube-userspace-proxy"
EXIT_USAGE = 2
EXIT_INVALID = 1
"""kube-proxy's exit code for a configuration its validation refuses."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag or value in one line and exits 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        raise SystemExit(EXIT_USAGE)

    def format_help(self) -> str:
        """What the command does first, then its usage and flags (as kube-proxy's --help)."""
        formatter = self._get_formatter()
        formatter.add_text(self.description)
        formatter.add_usage(self.usage, self._actions, self._mutually_exclusive_groups)
        for group in self._action_groups:
            formatter.start_section(group.title)
            formatter.add_text(group.description)
            formatter.add_arguments(group._group_actions)
            formatter.end_section()
        formatter.add_text(self.epilog)
        return formatter.format_help()


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _bool(text: str) -> bool:
    """pflag's boolean values: `--flag`, `--flag=true`, `--flag=false` (also 1/0, t/f)."""
    value = text.strip().lower()
    if value in {"true", "t", "1"}:
        return True
    if value in {"false", "f", "0"}:
        return False
    raise argparse.ArgumentTypeError(f"invalid boolean {text!r} (expected true or false)")


# Every other flag of kube-proxy 1.25 to 1.32 (bool: pflag boolean; value: takes one value).
IGNORED_FLAGS: dict[str, str] = {
    **dict.fromkeys(
        (
            "--bind-address-hard-fail",
            "--profiling",
            "--init-only",
            "--masquerade-all",
            "--iptables-localhost-nodeports",
            "--ipvs-strict-arp",
            "--conntrack-tcp-be-liberal",
            "--windows-service",
            "--log-json-split-stream",
            "--log-text-split-stream",
            "--add-dir-header",
            "--alsologtostderr",
            "--logtostderr",
            "--one-output",
            "--skip-headers",
            "--skip-log-headers",
        ),
        "bool",
    ),
    **dict.fromkeys(
        (
            "--feature-gates",
            "--kube-api-content-type",
            "--show-hidden-metrics-for-version",
            "--iptables-masquerade-bit",
            "--ipvs-sync-period",
            "--ipvs-min-sync-period",
            "--ipvs-exclude-cidrs",
            "--ipvs-tcp-timeout",
            "--ipvs-tcpfin-timeout",
            "--ipvs-udp-timeout",
            "--detect-local-mode",
            "--pod-bridge-interface",
            "--pod-interface-name-prefix",
            "--conntrack-max-per-core",
            "--conntrack-min",
            "--conntrack-tcp-timeout-established",
            "--conntrack-tcp-timeout-close-wait",
            "--conntrack-udp-timeout",
            "--conntrack-udp-timeout-stream",
            "--log-flush-frequency",
            "--log-json-info-buffer-size",
            "--log-text-info-buffer-size",
            "--vmodule",
            "--log-backtrace-at",
            "--log-dir",
            "--log-file",
            "--log-file-max-size",
            "--stderrthreshold",
            "--azure-container-registry-config",
            "--boot-id-file",
        ),
        "value",
    ),
}
# klog's flags (gone from kube-proxy after 1.25): accepted, but kept out of --help.
_UNLISTED = {
    "--add-dir-header",
    "--alsologtostderr",
    "--logtostderr",
    "--one-output",
    "--skip-headers",
    "--skip-log-headers",
    "--log-backtrace-at",
    "--log-dir",
    "--log-file",
    "--log-file-max-size",
    "--stderrthreshold",
    "--azure-container-registry-config",
    "--boot-id-file",
}


def _ignored_dest(flag: str) -> str:
    return "ignored_" + flag[2:].replace("-", "_")


TYPE_WORDS = {
    "str": "string",
    "choice": "string",
    "duration": "duration",
    "float": "float",
    "int": "int",
    "hex": "int",
    "csv": "strings",
    "bool": "",
    "ipport": "ipport",
    "port-range": "port-range",
}
"""kube-proxy's (pflag's) word for each kind of value, shown after the flag; none for a bool."""

_PARSERS: dict[str, Callable[[str], Any]] = {
    "str": str,
    "choice": str,
    "duration": _duration,
    "float": float,
    "int": int,
    "hex": lambda text: int(text, 0),  # 0x1000 or 4096
    "csv": _csv,
    "bool": _bool,
    "ipport": str,
    "port-range": str,
}

DESCRIPTIONS = {
    "run": "Run the proxy: watch Services and EndpointSlices (from the API server, or from "
    "--manifests), open a proxy port per service port, and install the iptables rules that "
    "send each ClusterIP, NodePort, externalIP and load-balancer IP there. The default "
    "command: kube-proxy's command line works as it is.",
    "rules": "Print the iptables rules `run` would install for the Services and EndpointSlices "
    "it would see, each with a one-line explanation; then, per service port, the endpoints the "
    "proxy itself would use and not use (and why), and every object it ignored and why. "
    "Installs nothing and needs no root. Without a cluster, pass --manifests (the YAML "
    "`kubectl apply -f` takes); otherwise it reads the API server as `run` does. It accepts "
    "every flag of `run`, so a node's command line can be pasted; those listed here change "
    "what it prints.",
    "demo": "Serve the bundled example Services to three local backends and show how the "
    "connections spread (round robin, session affinity, UDP), then the rules that would "
    "capture them. No cluster, no root, no rules installed.",
    "cleanup": "Remove every chain and jump this proxy installed (legacy and nft tables), then "
    "exit; needs root. `run` leaves its rules in place when it stops, so that traffic waits "
    "for the next process instead of failing; this takes them away.",
}
"""What each command does: the first thing its --help says."""


def _go_default(flag: Field) -> str:
    """The default as kube-proxy's --help spells it: `true`, `250ms`, `"auto"`, `[]`."""
    value = getattr(DEFAULTS, flag.name)
    if flag.kind == "duration":
        return format_duration(value)
    if flag.kind == "hex":
        return hex(value)
    if flag.kind == "bool":
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ",".join(value) + "]"
    if flag.kind == "float":
        return f"{value:g}"  # Go's 5, not 5.0
    if flag.kind in ("str", "choice") or value in ("", None):
        return json.dumps(value or "")  # Go's %q for these plain strings
    return str(value)


def _flag_help(flag: Field) -> str:
    unit = f"one of {'|'.join(flag.choices)}" if flag.choices else flag.unit
    if flag.kind == "duration":
        unit = "e.g. 250ms or 1m30s"
    if flag.kind == "csv":
        unit += ", comma-separated or repeated"
    extra = f"{unit}; " if unit else ""
    return f"{field_doc(flag.name)} ({extra}default {_go_default(flag)})"


def _add_field_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """The setting flags of `command`: those whose field lists it; `rules` takes all of
    `run`'s but lists only its own."""
    for flag in FIELDS:
        listed = command in flag.commands
        if not listed and command != "rules":
            continue
        parser.add_argument(
            *sorted((flag.flag, *flag.aliases), key=len),  # -v before --v
            dest=flag.name,
            # List flags take commas and may be repeated: `--node-ip A --node-ip B`.
            action="extend" if flag.kind == "csv" else "store",
            # Booleans as pflag has them: `--flag` alone means true, `--flag=false` false.
            nargs="?" if flag.kind == "bool" else None,
            const=True if flag.kind == "bool" else None,
            type=_PARSERS[flag.kind],
            choices=flag.choices or None,
            default=None,
            metavar=TYPE_WORDS[flag.kind],
            help=_flag_help(flag) if listed else argparse.SUPPRESS,
        )


def _add_run_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """`run`'s flags (and `rules`', which lists only those that change what it prints)."""
    _add_field_flags(parser, command)
    shown = command == "run"

    def add(*names: str, text: str, **kwargs: Any) -> None:
        parser.add_argument(*names, help=text if shown else argparse.SUPPRESS, **kwargs)

    parser.add_argument(
        "--manifests",
        nargs="+",
        action="extend",
        default=None,
        metavar="strings",
        help="Serve the Services and EndpointSlices in these YAML files or directories instead "
        "of a cluster; reloaded when they change (default: none, watch the API server)",
    )
    parser.add_argument(
        "--config",
        metavar="string",
        help="A KubeProxyConfiguration (kubeproxy.config.k8s.io/v1alpha1) file; flags override "
        'it (default "")',
    )
    add(
        "--proxy-mode",
        default=None,
        metavar="ProxyMode",
        text="kube-proxy's mode; this proxy is userspace mode, any other value gets a warning "
        '(default "userspace")',
    )
    add(
        "--cleanup",
        nargs="?",
        const=True,
        default=False,
        type=_bool,
        metavar="",
        text="Remove every rule and chain this proxy installs, then exit (default false)",
    )
    add(
        "--write-config-to",
        metavar="string",
        text="Write the effective KubeProxyConfiguration (defaults < --config < flags) to this "
        'file as YAML and exit (default "")',
    )
    for name, port in (("--healthz-port", DEFAULT_HEALTHZ_PORT), ("--metrics-port", 10249)):
        add(
            name,
            type=int,
            default=None,
            metavar="int",
            text=f"Deprecated in kube-proxy: the port of {name[2:-5]} bind address; 0 disables "
            f"(default {port})",
        )
    add(
        "--version",
        nargs="?",
        const="true",
        default=None,
        metavar="version[=true|raw]",
        text="Print the version and exit, as kube-proxy's --version (default false)",
    )
    ignored = (
        parser.add_argument_group(
            "kube-proxy flags accepted and ignored",
            "They mean nothing to userspace mode; each one given is named in one warning.",
        )
        if shown
        else parser
    )
    for name, takes in IGNORED_FLAGS.items():
        ignored.add_argument(
            name,
            dest=_ignored_dest(name),
            default=None,
            nargs="?" if takes == "bool" else None,
            const="true" if takes == "bool" else None,
            metavar="" if takes == "bool" else "string",
            help=argparse.SUPPRESS if name in _UNLISTED or not shown else None,
        )


class _HelpFormatter(argparse.HelpFormatter):
    """kube-proxy's look: `-v, --v int` (the type word once; none for a boolean)."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings:
            return super()._format_action_invocation(action)
        names = ", ".join(action.option_strings)
        return f"{names} {action.metavar}" if action.metavar else names


def make_parser() -> argparse.ArgumentParser:
    """The full command-line parser (subcommands run, demo, rules, cleanup)."""
    parser = _Parser(
        prog=PROG,
        description="A node-level Kubernetes Service proxy in the style of kube-proxy's "
        "userspace mode, on asyncio + uvloop.",
        epilog=_flags_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    summaries = {
        "run": "Run the proxy (the default command)",
        "demo": "Serve the bundled example Services to local backends and show the balancing "
        "(no cluster, no root, no rules installed)",
        "rules": "Print the iptables rules the proxy would install for the current sources, "
        "each explained, and what it would ignore and why (installs nothing)",
        "cleanup": "Remove every chain and jump this proxy installed (legacy and nft tables)",
    }
    commands = {
        name: sub.add_parser(
            name,
            help=summary,
            description=DESCRIPTIONS[name],
            usage=f"{PROG} {name} [flags]",
            formatter_class=_HelpFormatter,
            add_help=False,
        )
        for name, summary in summaries.items()
    }
    for command in commands.values():
        command._optionals.title = "flags"
        command.add_argument("-h", "--help", action="help", help="Show this help and exit")
    _add_run_flags(commands["run"], "run")
    _add_run_flags(commands["rules"], "rules")
    demo = commands["demo"]
    demo.add_argument(
        "--serve",
        action="store_true",
        help="Keep serving with a trickle of demo traffic; print commands to try and the"
        " /debug/ui URL (default false)",
    )
    demo.add_argument(
        "--requests",
        type=int,
        default=30,
        metavar="int",
        help="Requests sent through each demo Service (count; default 30)",
    )
    _add_field_flags(demo, "demo")
    _add_field_flags(commands["cleanup"], "cleanup")
    return parser


def _flags_epilog() -> str:
    """`--help`'s list of kube-proxy flags: applied here, or accepted and ignored."""
    applied = [*KUBE_PROXY_FLAGS_APPLIED, "--proxy-mode (userspace)"]
    listed = [f for f in IGNORED_FLAGS if f not in _UNLISTED]
    return (
        "kube-proxy's command line works unchanged (`kube-userspace-proxy --config=FILE "
        "--hostname-override=NAME`, pflag syntax).\n"
        f"kube-proxy flags applied here:\n{_wrap(sorted(applied))}\n"
        "kube-proxy flags accepted and ignored (one warning each):\n"
        f"{_wrap(sorted(listed))}\n"
        "See `kube-userspace-proxy run --help` for each flag."
    )


def _wrap(words: list[str]) -> str:
    lines, line = [], " "
    for word in words:
        if len(line) + len(word) > 98:
            lines.append(line)
            line = " "
        line += f" {word}"
    return "\n".join([*lines, line])


def _warn_ignored(args: argparse.Namespace) -> None:
    for flag in IGNORED_FLAGS:
        if getattr(args, _ignored_dest(flag), None) is not None:
            log.warning(
                "%s is a kube-proxy flag that does not apply to userspace mode; ignored", flag
            )
    refused = mode_problem(args.proxy_mode or "", "--proxy-mode")
    if refused:
        raise InvalidConfigError(refused)
    if args.proxy_mode not in (None, "", "userspace"):
        log.warning(
            "--proxy-mode=%s ignored: this proxy implements kube-proxy's userspace mode",
            args.proxy_mode,
        )


def parse_config(args: argparse.Namespace) -> ProxyConfig:
    """Defaults < --config file < flags; raises ConfigError naming the field."""
    _warn_ignored(args)
    file_values = read_config_file(args.config) if args.config else {}
    flags = {flag.name: getattr(args, flag.name) for flag in FIELDS}
    # A bare IP gets the default port, as kube-proxy's AppendPortIfNeeded does.
    for key, port, deprecated in (
        ("healthz_bind_address", DEFAULT_HEALTHZ_PORT, args.healthz_port),
        ("metrics_bind_address", DEFAULT_METRICS_PORT, args.metrics_port),
    ):
        if flags[key]:
            flags[key] = with_port(flags[key], port)
        if deprecated is not None:
            host, _ = split_host_port(flags[key] or file_values.get(key) or getattr(DEFAULTS, key))
            flags[key] = "" if deprecated == 0 else with_port(host, deprecated)
    if args.manifests:
        flags["manifests"] = tuple(args.manifests)
    for key in ("nodeport_addresses", "node_ips"):
        if flags[key] is not None:
            flags[key] = tuple(flags[key])
    source = f"--config {args.config}" if args.config else "flags"
    return build_config(file_values, flags, source=source)


def pflag_spelling(argv: Sequence[str]) -> list[str]:
    """Flags as pflag normalizes kube-proxy's: `_` in a flag's name is `-` (`--log_dir`);
    values, and everything after `--`, are left as given."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + list(argv[i:])
        name, eq, value = arg.partition("=")
        if arg.startswith("--") and "_" in name:
            out.append(name.replace("_", "-") + eq + value)
        else:
            out.append(arg)
    return out


def _argv_with_default_command(argv: Sequence[str]) -> list[str]:
    commands = {"run", "demo", "rules", "cleanup"}
    if not argv or argv[0] in commands or argv[0] in {"-h", "--help", "--version"}:
        return list(argv)
    return ["run", *argv]  # kube-proxy style: flags alone mean `run`


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kube-userspace-proxy` command; returns the exit code."""
    parser = make_parser()
    given = pflag_spelling(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(_argv_with_default_command(given))
    command = args.command or "run"
    if command in ("run", "rules") and args.version not in (None, "false", "f", "0"):
        print(f"{PROG} {__version__}")  # kube-proxy's `--version` (and `=raw`): then exit
        return 0
    logs.setup(args.verbosity or 0, args.log_format or "text")
    try:
        if command == "demo":
            loop = args.event_loop or DEFAULTS.event_loop
            return demo.main(serve=args.serve, requests=args.requests, event_loop=loop)
        if command == "cleanup":
            return _cleanup()
        config = parse_config(args)
        if command == "rules":
            return _print_rules(config)
        if args.cleanup:
            return _cleanup()
        if args.write_config_to:
            return _write_config(config, args.write_config_to)
        set_oom_score_adj(config.oom_score_adj)
        serves_native = app.serves_native(config)
        return app.run_loop(app.serve(config), config.event_loop, serves_native=serves_native)
    except InvalidConfigError as exc:
        sys.stderr.write(f"{PROG}: error: {exc}\n")
        return EXIT_INVALID
    except ConfigError as exc:
        sys.stderr.write(f"{PROG}: error: {exc}\n")
        return EXIT_USAGE
    except ProxyError as exc:
        sys.stderr.write(f"{PROG}: {exc}\n")
        return 1
    except KeyboardInterrupt:
        return 130


def set_oom_score_adj(value: int | None, path: str = "/proc/self/oom_score_adj") -> bool:
    """Write kube-proxy's oom_score_adj for this process (None: leave it); False on failure."""
    if value is None:
        return True
    try:
        with open(path, "w") as handle:
            handle.write(f"{value}\n")
    except OSError as exc:
        # Lowering it needs CAP_SYS_RESOURCE; kube-proxy also only logs this.
        log.warning("cannot set oom_score_adj to %d (%s); continuing", value, exc.strerror)
        return False
    return True


def _write_config(config: ProxyConfig, path: str) -> int:
    document = yaml.safe_dump(effective_document(config), sort_keys=True)
    try:
        with open(path, "w") as handle:
            handle.write(document)
    except OSError as exc:
        raise ConfigError(f"--write-config-to {path}: {exc.strerror}") from exc
    log.info("wrote the effective configuration to %s", path)
    return 0


def _cleanup() -> int:
    removed = cleanup_all()
    print(f"removed {removed} chain(s) and jump(s) of kube-userspace-proxy")
    return 0


def _print_rules(config: ProxyConfig) -> int:
    try:
        text = app.run_loop(app.rules_text(config), config.event_loop)
    except ConfigError as exc:
        if config.manifests:
            raise
        # Without --manifests, `rules` reads the API server as `run` does: say the other way.
        raise type(exc)(
            f"{exc}\n  without a cluster, read Services and EndpointSlices from YAML: "
            f"{PROG} rules --manifests FILE_OR_DIR"
        ) from exc
    print(text)
    return 0
