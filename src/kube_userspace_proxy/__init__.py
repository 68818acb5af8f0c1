"""kube-userspace-proxy: a node-level Kubernetes Service proxy in kube-proxy's userspace style."""

__version__ = "0.1.0"
