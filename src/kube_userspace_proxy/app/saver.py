"""The state-file saver: the applied state written in the background after changes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from kube_userspace_proxy import logs
from kube_userspace_proxy.model import ProxiedPort, Snapshot
from kube_userspace_proxy.proxier.reconciler import Proxier
from kube_userspace_proxy.restart import statefile

log = logs.get(__name__)

STATE_FILE_INTERVAL = 5.0
"""Seconds between two writes of the state file while changes keep coming."""

PORTS_STEP = 500
"""Rule targets whose proxy ports are read in one turn of the loop (`_ports_sliced`)."""


class StateSaver:
    """Writes the applied state and its proxy ports to the state file, at most every 5 s.

    A restarted proxy serves from that file until the API server answers (`Proxy.restore`).
    """

    def __init__(
        self, state_dir: str, applied_state: Callable[[], Snapshot], proxier: Proxier[Any]
    ) -> None:
        self._state_dir = state_dir
        self._applied_state = applied_state
        self._proxier = proxier
        self.saved: Snapshot | None = None
        """The state last written, or restored from a file or a handover."""
        self._unsaved = False
        self._encoder = statefile.Encoder()  # the state file, kept encoded between saves
        self._saved_ports: tuple[int, statefile.Ports] | None = None
        """The rule generation and the proxy-port mapping of the last save."""
        self._task: asyncio.Task[None] | None = None
        self._failed = False

    def later(self) -> None:
        """Write the state file in the background (at most every STATE_FILE_INTERVAL)."""
        if not self._state_dir:
            return
        self._unsaved = True
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="state-file")

    async def _loop(self) -> None:
        # At most one write every STATE_FILE_INTERVAL: at 10,000 Services the file is
        # megabytes. It is encoded here, on the loop, a slice per turn (see
        # `statefile.encode_sliced`); only the write (file I/O) is left to a thread.
        while self._unsaved:
            self._unsaved = False
            snapshot = self._applied_state()
            saved = self.saved
            if (
                saved is not None
                and saved.services == snapshot.services
                and saved.endpoints == snapshot.endpoints
                and saved.node_ips == snapshot.node_ips
                and saved.node_zone == snapshot.node_zone
                and saved.pod_cidrs == snapshot.pod_cidrs
            ):
                continue
            self.saved = snapshot
            # The proxy ports change only with a rule target (never in an endpoint storm):
            # the same mapping is kept until then, so the encoder need not look through it.
            generation = self._proxier.rules_generation
            if self._saved_ports is None or self._saved_ports[0] != generation:
                ports = await _ports_sliced(self._proxier.proxied_ports())
                self._saved_ports = (generation, ports)
            ports = self._saved_ports[1]
            data = await statefile.encode_sliced(self._encoder, snapshot, ports)
            try:
                await asyncio.to_thread(statefile.write, self._state_dir, data)
                self._failed = False
            except OSError as exc:
                if not self._failed:
                    log.warning("cannot write the state file in %s: %s", self._state_dir, exc)
                self._failed = True
            await asyncio.sleep(STATE_FILE_INTERVAL)


async def _ports_sliced(targets: Sequence[ProxiedPort]) -> statefile.Ports:
    """`Proxier.ports_of(targets)`, PORTS_STEP targets per turn of the loop."""
    ports: statefile.Ports = {}
    for start in range(0, len(targets), PORTS_STEP):
        if start:
            await asyncio.sleep(0)
        ports.update(Proxier.ports_of(targets[start : start + PORTS_STEP]))
    return ports
