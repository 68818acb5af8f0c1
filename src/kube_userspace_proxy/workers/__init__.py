"""Worker processes: the data plane on every core, fed by the control process.

The control process's side, top to bottom:

- `pool`: `WorkerPool`, the proxier's data plane with workers (the one object the rest of the
  program holds), and `SharedPort`, a proxy port the workers serve.
- `supervisor`: keeps the worker processes running (fork, ping, restart, warm spare, reap).
- `forking`: the fork server's handle: starts it (again after it dies), forks workers through
  it, watches each forked worker on a pidfd.
- `publisher`: sends them the full table, then deltas, in an order that keeps steering right;
  sends again the ports a worker could not open.
- `counters`: sums their counters into the proxier's ConnStats; their debug reports.
- `handover`: passes each worker's sockets to the same slot of the next process.
- `groups`: each port's reuseport group as the kernel keeps it, and its steering route.
- `link`: the handle of one worker process, and the answers awaited from workers.

Both sides:

- `protocol`: every message between the control process and a worker, a declared type each.
- `channel`: framed plain tuples on the control <-> worker socketpair.

The worker's side:

- `forkserver`: the fork server (`python -m kube_userspace_proxy.workers.forkserver`), a process
  that imported the data plane only and forks every worker, which shares its pages.
- `process`: the worker process itself (its `main` runs in each forked child).
"""
