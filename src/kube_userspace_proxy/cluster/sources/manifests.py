"""ManifestSource: Services and EndpointSlices from YAML/JSON files, reloaded when they change.

The same objects `kubectl apply -f` takes (multi-document YAML, `kind: List`); a Node named as
this node gives its addresses and zone, as the API's would; other kinds are ignored. A file that
stops parsing keeps its last good objects until it parses again; nothing in a file (nor an
unexpected error in a poll) ends the polling.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from kube_userspace_proxy import logs
from kube_userspace_proxy.cluster.sink import Kind, StateSink
from kube_userspace_proxy.errors import ManifestError

log = logs.get(__name__)

SUFFIXES = frozenset({".yaml", ".yml", ".json"})
KINDS: tuple[Kind, ...] = ("Service", "EndpointSlice")
ManifestKind = Literal["Service", "EndpointSlice", "Node"]
MAX_LIST_DEPTH = 16  # `kind: List` inside `kind: List` ...; deeper is refused as malformed

# What identifies a file's content cheaply: a rewrite, a rename over it or an append changes it.
Signature = tuple[int, int, int, int]  # (mtime_ns, size, inode, device)


@dataclass(frozen=True, slots=True)
class _Loaded:
    signature: Signature
    objects: tuple[tuple[ManifestKind, dict[str, Any]], ...]
    others: tuple[str, ...] = ()
    """`Kind namespace/name` of the objects of other kinds in the file (`rules` names them)."""


def read_manifest(
    path: Path, others: list[str] | None = None
) -> list[tuple[ManifestKind, dict[str, Any]]]:
    """The Services and EndpointSlices of one file; raises ManifestError naming file:line.
    `others` gets `Kind namespace/name` of each object of another kind."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: cannot read: {exc}") from exc
    try:
        if path.suffix == ".json":
            documents: list[Any] = [json.loads(text)] if text.strip() else []
        else:
            documents = list(yaml.safe_load_all(text))
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{path}:{exc.lineno}:{exc.colno}: {exc.msg}") from exc
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ManifestError(f"{where}: {exc.problem or exc.context}") from exc
    except yaml.YAMLError as exc:
        raise ManifestError(f"{path}: {exc}") from exc
    except (ValueError, RecursionError) as exc:  # PyYAML's date constructor: `2024-13-45`
        raise ManifestError(f"{path}: {exc}") from exc
    except Exception as exc:  # whatever else the parsers raise on odd input is the file's fault
        raise ManifestError(f"{path}: {type(exc).__name__}: {exc}") from exc
    return _objects(documents, path, [] if others is None else others)


def _objects(
    documents: Sequence[Any], path: Path, others: list[str]
) -> list[tuple[ManifestKind, dict[str, Any]]]:
    """The Services and EndpointSlices in documents, `kind: List` items flattened in order.

    Iterative, and each List is walked once: YAML aliases can make a List contain itself,
    or share one List many times over (exponential work); both are a ManifestError.
    """
    found: list[tuple[ManifestKind, dict[str, Any]]] = []
    walked: set[int] = set()  # id() of every List (and items array) walked so far
    stack: list[Iterator[Any]] = [iter(documents)]
    while stack:
        document = next(stack[-1], _DONE)
        if document is _DONE:
            stack.pop()
            continue
        if not isinstance(document, dict):
            continue  # empty documents (`---` at the end) and stray scalars
        kind = document.get("kind")
        if kind == "List":
            items = document.get("items")
            # Only ids of objects that `documents` keeps alive: a freed object's id is reused.
            ids = (id(document), id(items)) if isinstance(items, list) else (id(document),)
            if not walked.isdisjoint(ids):
                raise ManifestError(
                    f"{path}: a kind: List appears twice or inside itself (a YAML alias loop?)"
                )
            if len(stack) > MAX_LIST_DEPTH:
                raise ManifestError(f"{path}: kind: List nested over {MAX_LIST_DEPTH} deep")
            walked.update(ids)
            stack.append(iter(items if isinstance(items, list) else ()))
        elif kind == "Node":
            found.append(("Node", document))  # a Node has no namespace
        elif kind in KINDS:
            metadata = document.get("metadata")
            # As kubectl: an object without a namespace goes to "default".
            if isinstance(metadata, dict) and not metadata.get("namespace"):
                metadata["namespace"] = "default"
            found.append((kind, document))
        else:
            meta = document.get("metadata")
            meta = meta if isinstance(meta, dict) else {}
            others.append(f"{kind} {meta.get('namespace') or 'default'}/{meta.get('name') or '?'}")
    return found


_DONE = object()  # end of one level in _objects' walk


def _signature(path: Path) -> Signature | None:
    try:
        st = path.stat()
    except (OSError, ValueError):  # ValueError: a NUL byte in the path
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev)


class ManifestSource:
    """Feeds a StateSink from manifest files or directories (`*.yaml`, `*.yml`, `*.json`).

    `run()` polls the files every `poll_interval` seconds (a stat per file) and replaces both
    kinds in the state when any file changed.
    """

    def __init__(
        self,
        paths: Sequence[str | Path],
        state: StateSink,
        *,
        poll_interval: float = 0.5,
    ) -> None:
        self.paths = tuple(Path(p) for p in paths)
        self.state = state
        self.poll_interval = poll_interval
        self._loaded: dict[Path, _Loaded] = {}
        self._order: list[Path] = []  # files in command-line / directory order: later ones win
        self._failed: dict[Path, Signature | None] = {}  # broken files, logged at this signature
        self._first = True
        self._generation = 0  # bumped whenever the loaded objects change ...
        self._fed = 0  # ... and the generation the state last took
        self.polls = 0  # polls done; reloads: polls that found changed objects
        self.reloads = 0
        self.errors = 0

    def files(self) -> list[Path]:
        """The manifest files now: given files as they are, directories' matching entries."""
        found: list[Path] = []
        for path in self.paths:
            if path.is_dir():
                try:
                    entries = sorted(os.scandir(path), key=lambda e: e.name)
                except OSError as exc:
                    # Not "the files are gone": fail this poll, so the last good objects stay.
                    raise OSError(
                        exc.errno, f"cannot list manifest directory {path}: {exc.strerror}"
                    ) from exc
                found.extend(
                    Path(e.path)
                    for e in entries
                    if Path(e.name).suffix in SUFFIXES
                    and not e.name.startswith(".")
                    and e.is_file()
                )
            else:
                found.append(path)
        return list(dict.fromkeys(found))

    def other_kinds(self) -> list[tuple[Path, str]]:
        """(file, `Kind namespace/name`) of the loaded objects that are neither a Service, an
        EndpointSlice nor a Node: the proxy reads nothing else."""
        return [
            (p, other) for p in self._order if p in self._loaded for other in self._loaded[p].others
        ]

    async def load_once(self, *, strict: bool = True) -> None:
        """Read every file now and replace the state's objects (KubeSource's shape).

        `strict` (one-shot commands) raises ManifestError on a missing or broken file before
        touching the state; otherwise the error is logged and the file's last good objects kept.
        """
        if strict:
            for path in self.files():
                if not path.exists():
                    raise ManifestError(f"{path}: no such manifest file or directory")
                read_manifest(path)
        await asyncio.to_thread(self._read, self._scan(), force=True)
        self._feed_pending()

    async def run(self) -> None:
        """Load, then reload whenever a file changes; runs until cancelled.

        No error ends it: a failed poll is logged (once while it keeps failing the same way),
        the state keeps the last good objects, and the next poll tries again.
        """
        failing: str | None = None
        while True:
            try:
                current = self._scan()
                # Parse off the loop; feed the state on it (on_change may touch the loop).
                if self._first or self._changed(current):
                    await asyncio.to_thread(self._read, current, force=self._first)
                self._feed_pending()
            except Exception as exc:  # the backstop: keep the last good state, keep polling
                text = f"{type(exc).__name__}: {exc}"
                if text != failing:
                    expected = isinstance(exc, OSError | ManifestError)
                    log.log(
                        logging.WARNING if expected else logging.ERROR,
                        "manifest poll failed, keeping the last good objects: %s",
                        text,
                        exc_info=not expected,
                    )
                failing = text
            else:
                if failing is not None:
                    log.info("manifest polling works again")
                    failing = None
            self.polls += 1
            await asyncio.sleep(self.poll_interval)

    # -- internals ----------------------------------------------------------------------------

    def _scan(self) -> dict[Path, Signature | None]:
        return {path: _signature(path) for path in self.files()}

    def _changed(self, current: dict[Path, Signature | None]) -> bool:
        if current.keys() != self._loaded.keys() | self._failed.keys():
            return True
        for path, signature in current.items():
            known = self._loaded.get(path)
            if path in self._failed:
                if self._failed[path] != signature:
                    return True
            elif known is None or known.signature != signature:
                return True
        return False

    def _read(self, current: dict[Path, Signature | None], *, force: bool = False) -> bool:
        """Re-read the files whose signature changed; True when the objects changed."""
        changed = force
        if force:
            self._generation += 1
        for path in [p for p in self._loaded if p not in current]:
            log.info("manifest %s is gone: its objects are removed", path)
            del self._loaded[path]
            self._generation += 1
            changed = True
        for path in [p for p in self._failed if p not in current]:
            del self._failed[path]
        for path, signature in current.items():
            known = self._loaded.get(path)
            if known is not None and known.signature == signature and path not in self._failed:
                continue
            if path in self._failed and self._failed[path] == signature:
                continue  # still broken as logged; keep the last good objects
            if signature is None:
                self._fail(path, None, f"{path}: no such manifest file or directory")
                continue
            others: list[str] = []
            try:
                objects = tuple(read_manifest(path, others))
            except ManifestError as exc:
                self._fail(path, signature, str(exc))
                continue
            except Exception as exc:  # unforeseen content: this file fails, the others load
                self._fail(path, signature, f"{path}: {type(exc).__name__}: {exc}", trace=True)
                continue
            if path in self._failed:
                log.info("manifest %s parses again", path)
                del self._failed[path]
            self._loaded[path] = _Loaded(signature, objects, tuple(others))
            self._generation += 1
            changed = True
        self._first = False
        self._order = list(current)
        if changed:
            self.reloads += 1
        return changed

    def _fail(
        self, path: Path, signature: Signature | None, message: str, *, trace: bool = False
    ) -> None:
        self.errors += 1
        self._failed[path] = signature
        kept = path in self._loaded
        log.error(
            "%s (%s)",
            message,
            "keeping its last good objects" if kept else "nothing loaded",
            exc_info=trace,
        )

    def _feed_pending(self) -> None:
        """Feed the state if the loaded objects changed since it was last fed (or failed to be)."""
        generation = self._generation
        if generation != self._fed:
            self._feed()
            self._fed = generation

    def _feed(self) -> None:
        by_kind: dict[Kind, dict[tuple[str, str], Mapping[str, Any]]] = {k: {} for k in KINDS}
        node: Mapping[str, Any] | None = None
        for path in self._order:
            loaded = self._loaded.get(path)
            for kind, obj in loaded.objects if loaded is not None else ():
                if kind == "Node":
                    meta = obj.get("metadata")
                    if isinstance(meta, dict) and meta.get("name") == self.state.node_name:
                        node = obj
                    continue
                meta = obj.get("metadata")
                key = (
                    (str(meta.get("namespace")), str(meta.get("name")))
                    if isinstance(meta, dict)
                    else ("", str(id(obj)))  # let the state reject it with its own log line
                )
                if key in by_kind[kind]:
                    log.warning("%s %s/%s in %s overrides an earlier one", kind, *key, path)
                by_kind[kind][key] = obj
        self.state.set_node(node)
        for kind in KINDS:
            self.state.replace(kind, list(by_kind[kind].values()))
