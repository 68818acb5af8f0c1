"""The data plane: per-service-port TCP and UDP listeners that splice clients to endpoints.

`tcp` and `udp` are the listeners, `connection` one proxied TCP connection, `splice` its
zero-copy pump, `proxyproto` the PROXY protocol header, `transparent` the choice of a dial's
source address (--preserve-source-ip) and its sockets, `steering` the cBPF that steers a
client to one worker, `stats` the counters and the Picker shape.
"""

from __future__ import annotations

from kube_userspace_proxy.dataplane.stats import ConnStats, Picker
from kube_userspace_proxy.dataplane.tcp import TcpListener
from kube_userspace_proxy.dataplane.udp import UdpListener

__all__ = ["ConnStats", "Picker", "TcpListener", "UdpListener"]
