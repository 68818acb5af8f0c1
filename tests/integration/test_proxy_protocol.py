"""PROXY protocol to a real backend: nginx (`listen ... proxy_protocol`) in a pod namespace
reports the client pod's own address and the address it dialed, through the ClusterIP and
through the NodePort, with the data plane in worker processes and in the control process.
"""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import running_proxies, service
from tests.integration.netns import CLIENT_IP, NODE_IP, Topology, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("dataplane")]

NGINX_PORT = 8081
ANNOTATION = "kube-userspace-proxy.io/proxy-protocol"
SERVICES = {  # version -> (ClusterIP, NodePort)
    "v1": ("10.96.0.41", 30041),
    "v2": ("10.96.0.42", 30042),
}

SEEN = " ".join(f"$proxy_protocol_{v}" for v in ("addr", "port", "server_addr", "server_port"))

# One HTTP request; prints the client's own port, then the body (what nginx saw).
REQUEST = textwrap.dedent(
    """
    import socket, sys
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
    print(s.getsockname()[1])
    s.sendall(b"GET / HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n")
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    print(data.split(b"\\r\\n\\r\\n", 1)[1].decode().strip())
    """
)


def nginx_config(tmp: Path, listen: str) -> Path:
    conf = tmp / "nginx.conf"
    conf.write_text(
        textwrap.dedent(
            f"""
            daemon off;
            master_process off;
            pid {tmp}/nginx.pid;
            error_log {tmp}/nginx.err info;
            events {{ worker_connections 64; }}
            http {{
                access_log off;
                client_body_temp_path {tmp}/body;
                proxy_temp_path {tmp}/proxy;
                fastcgi_temp_path {tmp}/fastcgi;
                uwsgi_temp_path {tmp}/uwsgi;
                scgi_temp_path {tmp}/scgi;
                server {{
                    listen {listen} proxy_protocol;
                    location / {{
                        return 200 "{SEEN}";
                    }}
                }}
            }}
            """
        )
    )
    return conf


@pytest.fixture
def nginx_topology(netns_ok: None, tmp_path: Path) -> Iterator[Topology]:
    """The standard topology, with nginx expecting PROXY headers on pod-a:8081."""
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        pytest.skip("needs nginx (Debian nginx-light; scripts/dev installs it as root)")
    topo = Topology.create(tmp_path)
    try:
        pod = topo.pods["pod-a"]
        conf = nginx_config(tmp_path, f"0.0.0.0:{NGINX_PORT}")
        topo.procs.append(pod.popen([nginx, "-c", str(conf)], tmp_path / "nginx.log"))
        wait_for(lambda: f":{NGINX_PORT}" in pod.run("ss", "-lnt"), "nginx listening")
        yield topo
    finally:
        topo.destroy()


def proxy_protocol_services() -> list[dict[str, Any]]:
    objects = []
    for version, (cluster_ip, node_port) in SERVICES.items():
        svc, slice_ = service(f"pp-{version}", cluster_ip, 80, node_port=node_port, pods=("pod-a",))
        svc["metadata"]["annotations"] = {ANNOTATION: version}
        slice_["ports"][0]["port"] = NGINX_PORT
        svc["spec"]["ports"][0]["targetPort"] = NGINX_PORT
        objects += [svc, slice_]
    return objects


@pytest.mark.parametrize("workers", ["1", "2"])
def test_backend_sees_the_client_pod_and_the_address_it_dialed(
    nginx_topology: Topology, tmp_path: Path, workers: str
) -> None:
    topo = nginx_topology
    with running_proxies(topo, tmp_path, "restore") as make:
        proxy = make(proxy_protocol_services(), "--workers", workers)
        proxy.wait_rules(*(f'"default/pp-{v}:p"' for v in SERVICES))
        for version, (cluster_ip, node_port) in SERVICES.items():
            for host, port in ((cluster_ip, 80), (NODE_IP, node_port)):
                seen: list[str] = []

                def answered(host: str = host, port: int = port, seen: list[str] = seen) -> bool:
                    seen[:] = topo.client.python(REQUEST, host, str(port)).split("\n", 1)
                    return len(seen) == 2 and seen[1] != ""

                wait_for(answered, f"{version} through {host}:{port}", timeout=20)
                client_port, body = seen[0], seen[1].strip()
                # The client's own address and port, and the Service address it dialed:
                # neither the node's address nor the proxy port.
                assert body == f"{CLIENT_IP} {client_port} {host} {port}", (version, body)
