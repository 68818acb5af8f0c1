"""What operators and load balancers talk to: health, metrics, debug pages.

- `server`: the aiohttp health and metrics sites.
- `health`: kube-proxy's `/healthz` and `/livez` semantics; `servicehealth`: healthCheckNodePort.
- `httpguard`: connection caps and header timeouts for those sites.
- `metrics`: the Prometheus metrics; `debugui`: the live `/debug/ui` page (`static/`).
"""
