"""The control process's wiring: sources -> state -> runner -> proxier, ops, restarts, signals.

- `proxy`: the `Proxy` object (what is applied, and when) and `serve`, the process's life.
- `runner`: the bounded-frequency runner that coalesces changes into syncs.
"""
