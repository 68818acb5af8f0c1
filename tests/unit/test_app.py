"""Wiring decisions made by app.build before anything is opened."""

from __future__ import annotations

import logging

import pytest

from kube_userspace_proxy import app
from kube_userspace_proxy.app import proxy as wiring
from kube_userspace_proxy.config.settings import ProxyConfig


def test_auto_backend_without_root_serves_proxy_ports_only(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(wiring.os, "geteuid", lambda: 1000)
    logging.getLogger("kube_userspace_proxy").propagate = True
    with caplog.at_level(logging.WARNING):
        proxy = app.build(ProxyConfig(iptables_backend="auto", manifests=("x.yaml",)))
    assert proxy.proxier.rule_sink is None
    assert "not running as root" in caplog.text


def test_an_explicit_backend_is_used_even_without_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wiring.os, "geteuid", lambda: 1000)
    proxy = app.build(ProxyConfig(iptables_backend="restore", manifests=("x.yaml",)))
    assert proxy.proxier.rule_sink is not None
