"""Command line: `run` (kube-proxy compatible flags), `demo`, `rules`, `cleanup`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from kube_userspace_proxy import __version__, app, demo, logs
from kube_userspace_proxy.config import (
    DEFAULTS,
    ProxyConfig,
    build_config,
    field_doc,
    format_duration,
    parse_duration,
    read_config_file,
)
from kube_userspace_proxy.errors import ConfigError, ProxyError
from kube_userspace_proxy.portals import cleanup_all

PROG = "kube-userspace-proxy"
EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag or value in one line and exits 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        raise SystemExit(EXIT_USAGE)


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


@dataclass(frozen=True)
class _Flag:
    flag: str
    field: str
    kind: str  # str | duration | float | int | csv | choice
    unit: str = ""
    choices: tuple[str, ...] = ()


_RUN_FLAGS = (
    _Flag("--bind-address", "bind_address", "str", "IP"),
    _Flag("--proxy-port-range", "proxy_port_range", "str", "range"),
    _Flag("--udp-timeout", "udp_idle_timeout", "duration"),
    _Flag("--iptables-sync-period", "sync_period", "duration"),
    _Flag("--iptables-min-sync-period", "min_sync_period", "duration"),
    _Flag("--config-sync-period", "config_sync_period", "duration"),
    _Flag("--healthz-bind-address", "healthz_bind_address", "str", "host:port"),
    _Flag("--metrics-bind-address", "metrics_bind_address", "str", "host:port"),
    _Flag("--hostname-override", "hostname_override", "str", "name"),
    _Flag("--kubeconfig", "kubeconfig", "str", "path"),
    _Flag("--master", "master", "str", "URL"),
    _Flag("--kube-api-qps", "kube_api_qps", "float", "requests/s"),
    _Flag("--kube-api-burst", "kube_api_burst", "int", "requests"),
    _Flag("--nodeport-addresses", "nodeport_addresses", "csv", "CIDR list"),
    _Flag("--cluster-cidr", "cluster_cidr", "str", "CIDR"),
    _Flag("--service-proxy-name", "service_proxy_name", "str", "name"),
    _Flag(
        "--iptables-backend", "iptables_backend", "choice", "", ("auto", "iptc", "restore", "none")
    ),
    _Flag("--node-ip", "node_ips", "csv", "IP list"),
    _Flag("--event-loop", "event_loop", "choice", "", ("uvloop", "asyncio")),
    _Flag("--log-format", "log_format", "choice", "", ("text", "json")),
    _Flag("--shutdown-grace", "shutdown_grace", "duration"),
    _Flag("--workers", "workers", "str", "count or auto"),
)


def _default_text(flag: _Flag) -> str:
    value = getattr(DEFAULTS, flag.field)
    if flag.kind == "duration":
        return format_duration(value)
    if isinstance(value, tuple):
        return ",".join(value) or "none"
    return str(value) if value not in ("", None) else "none"


def _add_run_flags(parser: argparse.ArgumentParser) -> None:
    types: dict[str, Callable[[str], Any]] = {
        "str": str,
        "duration": _duration,
        "float": float,
        "int": int,
        "csv": _csv,
        "choice": str,
    }
    for flag in _RUN_FLAGS:
        unit = "duration, e.g. 250ms or 1m30s" if flag.kind == "duration" else flag.unit
        if flag.kind == "csv":
            unit += ", comma-separated or repeated"
        extra = f"{unit}; " if unit else ""
        parser.add_argument(
            flag.flag,
            dest=flag.field,
            # List flags take commas and may be repeated: `--node-ip A --node-ip B`.
            action="extend" if flag.kind == "csv" else "store",
            type=types[flag.kind],
            choices=flag.choices or None,
            default=None,
            metavar=None if flag.choices else flag.field.upper(),
            help=f"{field_doc(flag.field)} ({extra}default: {_default_text(flag)})",
        )
    parser.add_argument(
        "--manifests",
        nargs="+",
        action="extend",
        default=None,
        metavar="PATH",
        help="Serve the Services and EndpointSlices in these YAML files or directories instead "
        "of a cluster; reloaded when they change (default: none, watch the API server)",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="A KubeProxyConfiguration (kubeproxy.config.k8s.io/v1alpha1) file; flags override "
        "it (default: none)",
    )
    parser.add_argument(
        "--proxy-mode",
        default=None,
        help="Accepted for kube-proxy compatibility; only 'userspace' (or empty) is valid "
        "(default: userspace)",
    )
    parser.add_argument(
        "--cleanup",
        action="store_true",
        help="Remove every rule and chain this proxy installs, then exit (default: off)",
    )
    _add_logging_flags(parser)


def _add_logging_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-v",
        "--v",
        dest="verbosity",
        type=int,
        default=None,
        metavar="N",
        help="Log verbosity, as kube-proxy's klog levels; 4 and above logs every connection "
        "(count; default: 0)",
    )
    if not any(a.dest == "log_format" for a in parser._actions):
        parser.add_argument(
            "--log-format",
            dest="log_format",
            choices=("text", "json"),
            default=None,
            help="Log line format (default: text)",
        )


def make_parser() -> argparse.ArgumentParser:
    """The full command-line parser (subcommands run, demo, rules, cleanup)."""
    parser = _Parser(
        prog=PROG,
        description="A node-level Kubernetes Service proxy in the style of kube-proxy's "
        "userspace mode, on asyncio + uvloop.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    run = sub.add_parser("run", help="Run the proxy (the default command)")
    _add_run_flags(run)
    demo = sub.add_parser(
        "demo",
        help="Serve the bundled example Services to local backends and show the balancing "
        "(no cluster, no root, no rules installed)",
    )
    demo.add_argument(
        "--serve", action="store_true", help="Keep serving and print commands to try (default: off)"
    )
    demo.add_argument(
        "--requests",
        type=int,
        default=30,
        metavar="N",
        help="Requests sent through each demo Service (count; default: 30)",
    )
    demo.add_argument(
        "--event-loop", choices=("uvloop", "asyncio"), default="uvloop", help="(default: uvloop)"
    )
    _add_logging_flags(demo)
    rules = sub.add_parser(
        "rules",
        help="Print the iptables rules the proxy would install for the current sources, "
        "each with a one-line explanation (installs nothing)",
    )
    _add_run_flags(rules)
    cleanup = sub.add_parser(
        "cleanup", help="Remove every chain and jump this proxy installed (legacy and nft tables)"
    )
    _add_logging_flags(cleanup)
    return parser


def parse_config(args: argparse.Namespace) -> ProxyConfig:
    """Defaults < --config file < flags; raises ConfigError naming the field."""
    if args.proxy_mode not in (None, "", "userspace"):
        raise ConfigError(f"--proxy-mode={args.proxy_mode!r}: only 'userspace' is supported")
    file_values = read_config_file(args.config) if args.config else {}
    flags = {flag.field: getattr(args, flag.field) for flag in _RUN_FLAGS}
    flags["verbosity"] = args.verbosity
    if args.manifests:
        flags["manifests"] = tuple(args.manifests)
    for key in ("nodeport_addresses", "node_ips"):
        if flags[key] is not None:
            flags[key] = tuple(flags[key])
    source = f"--config {args.config}" if args.config else "flags"
    return build_config(file_values, flags, source=source)


def _argv_with_default_command(argv: Sequence[str]) -> list[str]:
    commands = {"run", "demo", "rules", "cleanup"}
    if not argv or argv[0] in commands or argv[0] in {"-h", "--help", "--version"}:
        return list(argv)
    return ["run", *argv]  # kube-proxy style: flags alone mean `run`


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kube-userspace-proxy` command; returns the exit code."""
    parser = make_parser()
    args = parser.parse_args(_argv_with_default_command(sys.argv[1:] if argv is None else argv))
    command = args.command or "run"
    logs.setup(args.verbosity or 0, args.log_format or "text")
    try:
        if command == "demo":
            return demo.main(serve=args.serve, requests=args.requests, event_loop=args.event_loop)
        if command == "cleanup":
            return _cleanup()
        config = parse_config(args)
        if command == "rules":
            return _print_rules(config)
        if args.cleanup:
            return _cleanup()
        return app.run_loop(app.serve(config), config.event_loop)
    except ConfigError as exc:
        sys.stderr.write(f"{PROG}: error: {exc}\n")
        return EXIT_USAGE
    except ProxyError as exc:
        sys.stderr.write(f"{PROG}: {exc}\n")
        return 1
    except KeyboardInterrupt:
        return 130


def _cleanup() -> int:
    removed = cleanup_all()
    print(f"removed {removed} chain(s) and jump(s) of kube-userspace-proxy")
    return 0


def _print_rules(config: ProxyConfig) -> int:
    print(app.run_loop(app.rules_text(config), config.event_loop))
    return 0
