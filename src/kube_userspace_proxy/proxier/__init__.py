"""The proxier: reconcile the desired state against proxy ports, endpoint pools and rules.

- `reconciler`: `Proxier`, which ties the rooms below together (one sync at a time).
- `commits`: when rules are committed: rule generations, the early first commit, deferred
  deletes, then the release of quarantined ports.
- `portbook`: where proxy ports come from: handed-over sockets, the installed rules' claims,
  the state file's preferences, the allocator; quarantine until no rule names a port.
- `nodeports`: a real socket per NodePort and address, so nothing else can take it.
- `debugview`: the /debug/state view, in name order, a run at a time.
- `served`: what is served now (`Served` per service port, which puts the usable endpoints
  of each path into its pool) and the listeners retired.
- `local`: `LocalDataPlane`, the listeners on this process's event loop (`--workers 1`).
- `contracts`: the `Listener`, `DataPlane` and `RuleSink` Protocols the proxier drives.
"""
