"""Sources feed a ClusterState with Services, EndpointSlices and the node's own Node."""

from __future__ import annotations

from typing import Protocol


class Source(Protocol):
    """The API server (`kube.KubeSource`) or YAML files (`manifests.ManifestSource`)."""

    async def run(self) -> None:
        """Keep the state current until cancelled (list and watch, or reload on change)."""
        ...

    async def load_once(self) -> None:
        """Fill the state once, for one-shot commands; raises a ProxyError on failure."""
        ...
