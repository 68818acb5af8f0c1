"""What operators and load balancers talk to: health, metrics, debug pages.

- `server`: the aiohttp health and metrics sites (the metrics site answers only to its names).
- `health`: kube-proxy's `/healthz` and `/livez` semantics; `servicehealth`: healthCheckNodePort.
- `httpguard`: connection caps (per client address and per site), header and idle timeouts
  and their metrics, for all of those sites.
- `metrics`: kube-proxy's metric names and `ProxyMetrics`, what the proxy reports through;
  `portmetrics`: the per-service-port families, read from the data plane at scrape time.
- `debugui`: the live `/debug/ui` page (`static/`).
"""
