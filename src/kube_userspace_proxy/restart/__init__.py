"""Restarts that refuse nothing and restarts during an API outage.

- `handover`: a new process takes the running one's sockets and state over a unix socket.
- `peers`: who may take over (the same user, the same network namespace).
- `statefile`: the last applied state on disk; its directory and file refused when others
  can write them.
- `restored`: each restored entry checked as the API's objects are (`cluster.objects`).
- `sockets`: what each handed-over socket is (one frozen type per kind) and its wire form.
"""
