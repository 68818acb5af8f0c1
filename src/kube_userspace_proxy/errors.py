"""Typed, operator-facing errors. Each message names the thing at fault and what to do."""

from __future__ import annotations


class ProxyError(Exception):
    """Base class of every error the proxy reports to an operator."""


class ConfigError(ProxyError):
    """A flag, a config file field or an environment value is invalid (exit code 2)."""


class InvalidConfigError(ConfigError):
    """A value kube-proxy's validation refuses, named as kube-proxy names it (exit code 1)."""


class PortExhaustedError(ProxyError):
    """No free port is left in `--proxy-port-range` for a service port."""


class DescriptorBudgetError(ProxyError):
    """Opening one more proxy port would eat into the descriptors kept in reserve."""


class PortInUseError(ProxyError):
    """A fixed port (a NodePort, a health or metrics address) is taken by someone else."""


class ManifestError(ProxyError):
    """A manifest file could not be read or parsed; names the file and the line."""


class PortalsError(ProxyError):
    """iptables rules could not be read or applied."""


class PrerequisiteError(ProxyError):
    """The node or the process lacks what a requested mode needs; names it (exit code 1)."""
