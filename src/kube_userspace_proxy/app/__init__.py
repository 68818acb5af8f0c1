"""The control process's wiring and life: sources -> state -> pipeline -> proxier, ops, signals.

- `lifecycle`: the process's life, top to bottom: `serve -> startup -> main loop -> shutdown`;
  signals; `run_loop` (the native core's loop, uvloop or asyncio).
- `rulestext`: the `rules` command's text: the rules `run` would install, each explained; what
  the proxy decides itself (endpoints used and not, affinity); what it ignored, and why.
- `proxy`: the `Proxy` object, its parts wired together (sources' state, proxier, workers,
  portals, health, metrics); which node IPs apply; restoring a saved state.
- `pipeline`: what is applied when: each change at once to listeners and pools (the apply
  loop), rule commits and full resyncs by the runner, then health, metrics and the state file.
- `latency`: trigger times -> the network-programming latency, measured when a change is served.
- `saver`: the state-file saver (the applied state written in the background after changes).
- `handover`: the app's side of a handover: what the running proxy gives (`Giver`), how a
  new one adopts it and serves at once, and how the old one hands over and drains.
- `runner`: the bounded-frequency runner that coalesces changes into syncs.

The entry points the CLI, the demo and tests use are re-exported here.
"""

from kube_userspace_proxy.app.lifecycle import build, run_loop, serve, serves_native
from kube_userspace_proxy.app.proxy import Proxy
from kube_userspace_proxy.app.rulestext import rules_text

__all__ = ["Proxy", "build", "rules_text", "run_loop", "serve", "serves_native"]
