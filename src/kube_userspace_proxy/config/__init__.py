"""The proxy's configuration: defaults < KubeProxyConfiguration file < command-line flags.

- `fields`: the table of settings: per ProxyConfig field, its flag, its KubeProxyConfiguration
  path and whether kube-proxy's flag or file value applies here (the rest is ignored, warned).
- `kubeproxy`: the KubeProxyConfiguration document read the way kube-proxy reads it.
- `validation`: kube-proxy's checks of the values, each problem named as kube-proxy names it.
- `settings`: `ProxyConfig` and how it is built from the document and the flags.
"""
