"""Worker processes: the data plane on every core, fed by the control process.

- `channel`: framed messages on the control <-> worker socketpair.
- `pool`: the control side (start, feed, steer, sum, supervise).
- `process`: the worker process itself (`python -m kube_userspace_proxy.workers.process`).
"""
