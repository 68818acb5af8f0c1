"""Packaging facts kept true: one version, true floors, an image lock that covers them."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

from kube_userspace_proxy import __version__

ROOT = Path(__file__).resolve().parents[2]


def pyproject() -> dict[str, object]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def test_the_version_is_written_once_and_the_chart_follows_it() -> None:
    project = pyproject()["project"]
    assert isinstance(project, dict)
    assert "version" not in project and "version" in project["dynamic"]
    chart = yaml.safe_load((ROOT / "charts" / "kube-userspace-proxy" / "Chart.yaml").read_text())
    assert chart["appVersion"] == __version__
    assert chart["version"] == __version__


def test_every_direct_dependency_has_a_floor_and_the_image_lock_satisfies_it() -> None:
    project = pyproject()["project"]
    assert isinstance(project, dict)
    pinned = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pinned[_key(name)] = version
    for dependency in project["dependencies"]:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([\d.]+)", dependency.replace(" ", ""))
        assert match, f"{dependency}: give a floor (>=), tested by `scripts/dev floors`"
        name, floor = match.groups()
        assert _key(name) in pinned, f"constraints.txt does not pin {name}"
        assert _version(pinned[_key(name)]) >= _version(floor), name
