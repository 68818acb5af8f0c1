"""Suite-wide rules: under CI=true a skipped integration test is a failure."""

from __future__ import annotations

import os

import pytest

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and "integration" in item.keywords:
        report.outcome = "failed"
        report.longrepr = f"integration test skipped under CI=true: {report.longrepr}"
