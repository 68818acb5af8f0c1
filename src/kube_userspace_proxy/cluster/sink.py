"""StateSink: what a source may do to the state it feeds (`ClusterState` is the one sink).

A source hands over raw objects (dicts shaped like the API's JSON) in four ways: a whole
kind at once (`replace`), a whole kind page by page (`begin_list`, `list_page`, `end_list`),
one watch event (`apply`), and the node's own Node (`set_node`). Parsing, checking and
deciding what changed are the sink's business, not the source's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal, Protocol

Kind = Literal["Service", "EndpointSlice"]
"""The kinds a source lists and watches into the sink (the Node has `set_node`)."""
Event = Literal["ADDED", "MODIFIED", "DELETED"]
"""The watch events a sink takes (bookmarks and errors stay with the source)."""


class StateSink(Protocol):
    """The state as a source sees it: complete lists, page-wise lists, events, the Node."""

    @property
    def node_name(self) -> str | None:
        """This node's name (None: unknown): which Node object is the own one."""
        ...

    def replace(self, kind: Kind, objects: Iterable[Mapping[str, Any]]) -> None:
        """Take the complete list of one kind (list, relist, manifest reload)."""
        ...

    def begin_list(self, kind: Kind) -> None:
        """A complete list of `kind` follows page by page; beginning again starts it over."""
        ...

    def list_page(self, kind: Kind, objects: Iterable[Mapping[str, Any]]) -> None:
        """One page of the list begun with `begin_list`."""
        ...

    def end_list(self, kind: Kind) -> None:
        """The list is complete: what it did not name is gone."""
        ...

    def apply(self, kind: Kind, event: Event, obj: Mapping[str, Any]) -> None:
        """Take one watch event for one object."""
        ...

    def set_node(self, node: Mapping[str, Any] | None) -> None:
        """Take the own Node object (None: unknown or gone)."""
        ...
