"""The Helm chart's ClusterRole, enforced by the fake API server (`FakeApiServer.rbac`).

`chart_rules()` renders the chart (the `helm` binary when on PATH, else Helm's Go SDK in the
`helm_python` wheel of the test extra) with its default values and reads the rules of its
ClusterRole. `Rbac` answers whether a request of the proxy's service account is allowed, as
kube-apiserver's RBAC authorizer would for a ClusterRole bound cluster-wide, and records every
(API group, resource, verb) it was asked about, so a test can compare what the proxy used with
what the chart grants.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "kube-userspace-proxy"
USER = "system:serviceaccount:kube-system:kup-kube-userspace-proxy"
"""The chart's service account (release `kup` in kube-system), as a 403 names it."""

Triple = tuple[str, str, str]
"""(API group, resource, verb)."""


@dataclass(frozen=True)
class Rule:
    api_groups: tuple[str, ...]
    resources: tuple[str, ...]
    verbs: tuple[str, ...]

    def allows(self, group: str, resource: str, verb: str) -> bool:
        return (
            (group in self.api_groups or "*" in self.api_groups)
            and (resource in self.resources or "*" in self.resources)
            and (verb in self.verbs or "*" in self.verbs)
        )


VALUES = {"apiServer": {"host": "kind-control-plane"}}
"""The one value a release needs (where the API server is); the rest are the chart's own."""


def _render() -> list[dict[str, Any]]:
    """The chart's documents with its default values."""
    if shutil.which("helm"):
        done = subprocess.run(
            ["helm", "template", "kup", str(CHART), "-n", "kube-system", "-f", "-"],
            input=json.dumps(VALUES),
            capture_output=True,
            text=True,
            check=True,
        )
        texts = done.stdout.split("\n---")
    else:
        import helm_python

        with helm_python.Chart.load(str(CHART)) as chart:
            rendered = chart.render(VALUES, name="kup", namespace="kube-system")
        texts = [
            doc
            for name, text in rendered.items()
            if name.endswith(".yaml")
            for doc in text.split("\n---")
        ]
    return [doc for text in texts if (doc := yaml.safe_load(text))]


@functools.cache
def chart_rules() -> tuple[Rule, ...]:
    """The rules of the chart's rendered ClusterRole."""
    (role,) = [doc for doc in _render() if doc.get("kind") == "ClusterRole"]
    return tuple(
        Rule(
            tuple(rule.get("apiGroups", ())),
            tuple(rule.get("resources", ())),
            tuple(rule.get("verbs", ())),
        )
        for rule in role["rules"]
    )


@dataclass
class Rbac:
    """Rules in force; what was asked of them."""

    rules: tuple[Rule, ...]
    used: set[Triple] = field(default_factory=set)
    denied: set[Triple] = field(default_factory=set)

    def check(self, group: str, resource: str, verb: str) -> str | None:
        """None when allowed; else the message kube-apiserver's 403 carries."""
        self.used.add((group, resource, verb))
        if any(rule.allows(group, resource, verb) for rule in self.rules):
            return None
        self.denied.add((group, resource, verb))
        return (
            f'{resource} is forbidden: User "{USER}" cannot {verb} resource "{resource}" in API'
            f' group "{group}" at the cluster scope'
        )

    def granted(self) -> set[Triple]:
        """Every (group, resource, verb) the rules name (no wildcards in this chart)."""
        return {
            (group, resource, verb)
            for rule in self.rules
            for group in rule.api_groups
            for resource in rule.resources
            for verb in rule.verbs
        }

    def without(self, resource: str, verb: str) -> Rbac:
        """These rules with `verb` on `resource` taken away (a chart that lacks it)."""
        rules = tuple(
            Rule(
                rule.api_groups,
                rule.resources,
                tuple(v for v in rule.verbs if not (resource in rule.resources and v == verb)),
            )
            for rule in self.rules
        )
        return Rbac(rules)
