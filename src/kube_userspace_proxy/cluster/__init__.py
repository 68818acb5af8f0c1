"""What the cluster says: raw objects in, an immutable snapshot of this node's view out.

- `objects`: parse and check one Service, EndpointSlice or Node (pure functions).
- `sink`: `StateSink`, what a source may do to the state (lists, pages, events, the Node).
- `state`: `ClusterState` (the one StateSink), the parsed objects kept by key, and the
  snapshot built from them.
- `sources/`: where objects come from (the API server's list+watch, or manifest files),
  written through a StateSink.
"""
