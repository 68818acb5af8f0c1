"""Suite-wide rules: under CI=true a skipped integration test is a failure; every test stops
the log writer thread it started (`logs.setup`, as `cli.main` calls it)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest

from kube_userspace_proxy import logs

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and "integration" in item.keywords:
        report.outcome = "failed"
        report.longrepr = f"integration test skipped under CI=true: {report.longrepr}"


@pytest.fixture(autouse=True)
def package_logger_restored() -> Iterator[None]:
    """Put the package logger back as the test found it, stopping any writer thread it
    started: a writer left behind would write to the stderr pytest captured for a test that
    has ended ("--- Logging error --- ValueError: I/O operation on closed file")."""
    logger = logging.getLogger(logs.LOGGER_NAME)
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    yield
    if logger.handlers != handlers:
        logs.stop()
        for handler in list(logger.handlers):
            if handler not in handlers:
                logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


@pytest.fixture
def logged(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Records of the package logger at DEBUG and above, even when logs.setup() stopped it
    propagating (tests/control and the manifest tests narrow it to INFO)."""
    logger = logging.getLogger("kube_userspace_proxy")
    logger.addHandler(caplog.handler)
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    yield caplog
    logger.removeHandler(caplog.handler)
    logger.setLevel(old_level)


DATAPLANES = ("native", "python")
"""The TCP data planes every data-plane test runs over (one suite, as uvicorn runs its tests
over h11 and httptools). Without the extension the native runs fail rather than skip: a
package that was meant to build it and did not is a defect."""


@pytest.fixture(params=DATAPLANES)
def dataplane(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Run the test over one data plane: listeners made without one get it, and so does a
    proxy started in or out of this process with the default `--dataplane auto` (the
    environment switch `KUP_NO_EXTENSIONS` makes auto the Python one; subprocesses inherit it)."""
    from kube_userspace_proxy.dataplane import native, tcp

    name = str(request.param)
    if name == "python":
        monkeypatch.setenv(native.NO_EXTENSIONS, "1")
    else:
        monkeypatch.delenv(native.NO_EXTENSIONS, raising=False)
    tcp.set_default("auto")
    assert tcp.default() == name, native.unavailable()
    yield name
    tcp.set_default("auto")
