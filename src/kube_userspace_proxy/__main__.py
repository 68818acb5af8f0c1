"""`python -m kube_userspace_proxy` is the same as the `kube-userspace-proxy` command."""

from kube_userspace_proxy.cli import main

raise SystemExit(main())
