"""The control process's wiring: sources -> state -> runner -> proxier, ops, restarts, signals.

- `proxy`: the `Proxy` object (what is applied, and when) and `serve`, the process's life.
- `handover`: the app's side of a handover: what the running proxy gives (`Giver`), how a
  new one adopts it and serves at once, and how the old one hands over and drains.
- `runner`: the bounded-frequency runner that coalesces changes into syncs.
"""
