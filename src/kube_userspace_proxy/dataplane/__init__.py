"""The data plane: per-service-port TCP and UDP listeners that splice clients to endpoints."""

from __future__ import annotations

from kube_userspace_proxy.dataplane.stats import ConnStats, Picker
from kube_userspace_proxy.dataplane.tcp import TcpListener
from kube_userspace_proxy.dataplane.udp import UdpListener

__all__ = ["ConnStats", "Picker", "TcpListener", "UdpListener"]
