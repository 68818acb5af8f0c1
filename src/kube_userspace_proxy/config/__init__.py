"""The proxy's configuration: defaults < KubeProxyConfiguration file < command-line flags.

- `kubeproxy`: the KubeProxyConfiguration document read the way kube-proxy reads it.
- `settings`: `ProxyConfig` and how it is built from the document and the flags.
"""
