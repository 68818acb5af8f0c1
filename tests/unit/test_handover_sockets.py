"""Handed-over socket descriptions: each kind survives the handover's JSON as itself."""

import json

import pytest

from kube_userspace_proxy.restart import sockets
from kube_userspace_proxy.restart.sockets import (
    HealthSocket,
    NodePortSocket,
    OpsSocket,
    ProxyPortSocket,
)

EVERY_KIND = [
    ProxyPortSocket("default/web:http", "TCP", "cluster"),
    NodePortSocket("UDP", "10.0.0.1", 30053),
    HealthSocket("::", 31000),
    OpsSocket("0.0.0.0", 10256),
]


@pytest.mark.parametrize("description", EVERY_KIND, ids=lambda d: type(d).__name__)
def test_description_round_trips_through_json(description: sockets.SocketDescription) -> None:
    wire = json.loads(json.dumps(sockets.encode(description)))
    assert sockets.decode(wire) == description


def test_wire_form_is_the_protocols_list() -> None:
    """The wire format of handover protocol 1: a list, its kind first."""
    assert [sockets.encode(d) for d in EVERY_KIND] == [
        ["port", "default/web:http", "TCP", "cluster"],
        ["nodeport", "UDP", "10.0.0.1", 30053],
        ["health", "::", 31000],
        ["ops", "0.0.0.0", 10256],
    ]


def test_proxy_port_keys_match_the_port_book() -> None:
    assert ProxyPortSocket("default/web:http", "TCP", "cluster").claim == (
        "default/web:http",
        "TCP",
        "cluster",
    )
    assert NodePortSocket("UDP", "10.0.0.1", 30053).key == ("UDP", "10.0.0.1", 30053)


@pytest.mark.parametrize("wire", [["socket", 1], ["port", "a"], "port", None, ["ops", "h", "x"]])
def test_anything_else_is_refused(wire: object) -> None:
    with pytest.raises(ValueError):
        sockets.decode(wire)
