"""Restarts that refuse nothing and restarts during an API outage.

- `handover`: a new process takes the running one's sockets and state over a unix socket.
- `statefile`: the last applied state on disk.
- `sockets`: what each handed-over socket is (one frozen type per kind) and its wire form.
"""
