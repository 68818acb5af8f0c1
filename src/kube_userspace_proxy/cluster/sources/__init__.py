"""Sources feed a StateSink with Services, EndpointSlices and the node's own Node.

- `kube`: `KubeSource`, which resources with which selectors into the sink, one supervised
  loop per resource (backoff, relist, rate-limited logging of trouble).
- `watching`: list, then watch, as layered async generators (lines, events, one stream, a
  paginated list with its "listed" sentinel, and `follow` tying them to a resume `Cursor`).
- `client`: the API client's configuration, credentials kept fresh, request observation.
- `kubeapi`: kubernetes_asyncio's client and config without its ~800 generated modules.
- `failures`: what can go wrong talking to the API server (410, error statuses, bad data).
- `retry`: rate limit, backoff, Retry-After.
- `manifests`: `ManifestSource`, YAML/JSON files reloaded when they change.
"""

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
