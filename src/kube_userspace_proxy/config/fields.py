"""The table of settings: per ProxyConfig field, its flag and whether kube-proxy's value applies.

Each row says where a setting's value may come from: this proxy's `run` flag; kube-proxy's
flag of the same meaning, when kube-proxy has one and its value applies here; the dotted path
in a KubeProxyConfiguration file whose value applies here. kube-proxy's other fields and flags
are accepted and ignored with a warning (`kubeproxy.not_applicable`, `cli.IGNORED_FLAGS`).
Help texts are the docstrings under the ProxyConfig fields (`settings.field_doc`).
"""

from __future__ import annotations

from dataclasses import dataclass

RUN = frozenset({"run"})
RUN_AND_RULES = frozenset({"run", "rules"})
EVERY_COMMAND = frozenset({"run", "rules", "demo", "cleanup"})


@dataclass(frozen=True, slots=True)
class Field:
    """One setting: the ProxyConfig field `name`, set by `flag` and, if given, a file's `path`."""

    flag: str
    """This proxy's command-line flag."""
    name: str
    """The ProxyConfig field it sets; the docstring under that field is the flag's help."""
    kind: str
    """How the flag's value is read: str, duration, float, int, hex (0x1000 or 4096), csv,
    choice, bool, ipport (host:port) or port-range. --help shows it as kube-proxy's type word
    (`string`, `duration`, `strings`, ...) and the default in Go's spelling."""
    unit: str = ""
    """The unit --help names when the type word does not say it."""
    choices: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    """Other spellings of the flag."""
    path: str = ""
    """The KubeProxyConfiguration path (dotted) whose value applies here; "": none does."""
    kube_proxy_flag: str = ""
    """kube-proxy's flag of the same meaning, whose value applies here; "": this proxy's own."""
    commands: frozenset[str] = RUN
    """The subcommands whose --help lists the flag. `rules` accepts every flag of `run` (a
    node's command line pastes in), but lists only those that change what it prints."""


RUN_FIELDS: tuple[Field, ...] = (
    Field(
        "--bind-address",
        "bind_address",
        "str",
        "IP",
        path="bindAddress",
        kube_proxy_flag="--bind-address",
        commands=RUN_AND_RULES,
    ),
    Field(
        "--proxy-port-range",
        "proxy_port_range",
        "port-range",
        path="portRange",
        kube_proxy_flag="--proxy-port-range",
        commands=RUN_AND_RULES,
    ),
    Field(
        "--udp-timeout",
        "udp_idle_timeout",
        "duration",
        path="udpIdleTimeout",
        kube_proxy_flag="--udp-timeout",
    ),
    Field("--tcp-keepalive", "tcp_keepalive", "duration"),
    Field(
        "--iptables-sync-period",
        "sync_period",
        "duration",
        path="iptables.syncPeriod",
        kube_proxy_flag="--iptables-sync-period",
    ),
    Field(
        "--iptables-min-sync-period",
        "min_sync_period",
        "duration",
        path="iptables.minSyncPeriod",
        kube_proxy_flag="--iptables-min-sync-period",
    ),
    Field("--iptables-verify-period", "verify_period", "duration"),
    Field(
        "--config-sync-period",
        "config_sync_period",
        "duration",
        path="configSyncPeriod",
        kube_proxy_flag="--config-sync-period",
    ),
    Field(
        "--healthz-bind-address",
        "healthz_bind_address",
        "ipport",
        path="healthzBindAddress",
        kube_proxy_flag="--healthz-bind-address",
    ),
    Field(
        "--metrics-bind-address",
        "metrics_bind_address",
        "ipport",
        path="metricsBindAddress",
        kube_proxy_flag="--metrics-bind-address",
    ),
    Field("--metrics-allowed-hosts", "metrics_allowed_hosts", "csv", "name list"),
    Field(
        "--hostname-override",
        "hostname_override",
        "str",
        "name",
        path="hostnameOverride",
        kube_proxy_flag="--hostname-override",
        commands=RUN_AND_RULES,
    ),
    Field(
        "--kubeconfig",
        "kubeconfig",
        "str",
        "path",
        path="clientConnection.kubeconfig",
        kube_proxy_flag="--kubeconfig",
        commands=RUN_AND_RULES,
    ),
    Field("--master", "master", "str", "URL", kube_proxy_flag="--master", commands=RUN_AND_RULES),
    Field(
        "--kube-api-qps",
        "kube_api_qps",
        "float",
        "requests/s",
        path="clientConnection.qps",
        kube_proxy_flag="--kube-api-qps",
    ),
    Field(
        "--kube-api-burst",
        "kube_api_burst",
        "int",
        "requests",
        path="clientConnection.burst",
        kube_proxy_flag="--kube-api-burst",
    ),
    Field(
        "--nodeport-addresses",
        "nodeport_addresses",
        "csv",
        "CIDR list",
        path="nodePortAddresses",
        kube_proxy_flag="--nodeport-addresses",
        commands=RUN_AND_RULES,
    ),
    Field(
        "--cluster-cidr",
        "cluster_cidr",
        "str",
        "CIDR",
        path="clusterCIDR",
        kube_proxy_flag="--cluster-cidr",
    ),
    Field("--service-proxy-name", "service_proxy_name", "str", "name", commands=RUN_AND_RULES),
    Field(
        "--iptables-backend", "iptables_backend", "choice", "", ("auto", "iptc", "restore", "none")
    ),
    Field("--node-ip", "node_ips", "csv", "IP list", commands=RUN_AND_RULES),
    Field(
        "--event-loop",
        "event_loop",
        "choice",
        "",
        ("auto", "native", "uvloop", "asyncio"),
        commands=frozenset({"run", "demo"}),
    ),
    Field(
        "--log-format",
        "log_format",
        "choice",
        "",
        ("text", "json"),
        ("--logging-format",),
        path="logging.format",
        kube_proxy_flag="--logging-format",
        commands=EVERY_COMMAND,
    ),
    Field(
        "--oom-score-adj",
        "oom_score_adj",
        "int",
        "-1000..1000",
        path="oomScoreAdj",
        kube_proxy_flag="--oom-score-adj",
    ),
    Field("--metrics-per-service-port", "metrics_per_service_port", "bool"),
    Field("--shutdown-grace", "shutdown_grace", "duration"),
    Field("--workers", "workers", "str", "count or auto"),
    Field(
        "--dataplane",
        "dataplane",
        "choice",
        "",
        ("auto", "native", "python"),
        commands=frozenset({"run", "demo"}),
    ),
    Field("--guard-proxy-ports", "guard_proxy_ports", "bool", commands=RUN_AND_RULES),
    Field("--state-dir", "state_dir", "str", "path"),
    Field("--after-handover", "after_handover", "choice", "", ("exit", "wait")),
    Field(
        "--loopback-endpoints",
        "loopback_endpoints",
        "choice",
        "",
        ("auto", "allow", "deny"),
        commands=RUN_AND_RULES,
    ),
    Field("--preserve-source-ip", "preserve_source_ip", "bool"),
    Field("--transparent-mark", "transparent_mark", "hex", "one bit, e.g. 0x1000"),
    Field("--transparent-table", "transparent_table", "int", "table number"),
    Field(
        "--ipvs-scheduler",
        "scheduler",
        "str",
        "rr, lc or sh",
        path="ipvs.scheduler",
        kube_proxy_flag="--ipvs-scheduler",
        commands=RUN_AND_RULES,
    ),
    Field("--outlier-consecutive-failures", "outlier_consecutive_failures", "int", "dials"),
    Field("--outlier-base-ejection-time", "outlier_base_ejection_time", "duration"),
)
"""The `run` command's setting flags, in --help order (each lists the other commands that
take it)."""

VERBOSITY = Field(
    "--v",
    "verbosity",
    "int",
    "count",
    aliases=("-v",),
    path="logging.verbosity",
    kube_proxy_flag="--v",
    commands=EVERY_COMMAND,
)
"""-v/--v: after the other flags in --help, as kube-proxy lists it."""

FIELDS: tuple[Field, ...] = (*RUN_FIELDS, VERBOSITY)
"""Every setting a flag or a KubeProxyConfiguration file sets."""

FILE_FIELDS: dict[str, Field] = {field.path: field for field in FIELDS if field.path}
"""KubeProxyConfiguration paths whose values apply here -> their settings."""

APPLIED_PATHS = frozenset({"apiVersion", "kind", "mode", *FILE_FIELDS})
"""Dotted field paths that mean something to this proxy (`mode`: only userspace is served);
every other known one is accepted and logged once as not applicable when it carries a value."""

KUBE_PROXY_COMMAND_FLAGS = (
    "--cleanup",
    "--config",
    "--healthz-port",
    "--metrics-port",
    "--write-config-to",
)
"""kube-proxy's flags applied here that set no field: actions, the file, deprecated ports."""

KUBE_PROXY_FLAGS_APPLIED: tuple[str, ...] = tuple(
    sorted(
        {field.kube_proxy_flag for field in FIELDS if field.kube_proxy_flag}
        | set(KUBE_PROXY_COMMAND_FLAGS)
    )
)
"""kube-proxy's flags that this proxy applies (the rest of RUN_FIELDS are its own)."""
