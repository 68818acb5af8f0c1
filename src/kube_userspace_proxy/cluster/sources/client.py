"""The API client: where its configuration comes from and how its credentials stay fresh.

kube-proxy's order of kubeconfig, `$KUBECONFIG`, `--master` and the in-cluster service
account; a kubeconfig `tokenFile` re-read when the kubelet rotates it; an exec credential
plugin re-run when its token expires; and a hook that reports every request (for client-go's
metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from kube_userspace_proxy import logs
from kube_userspace_proxy.cluster.sources.failures import describe
from kube_userspace_proxy.cluster.sources.kubeapi import kclient, kconfig
from kube_userspace_proxy.errors import ConfigError

log = logs.get(__name__)

PLUGIN_GRACE = 5.0  # seconds an exec credential plugin may take to finish when we stop
CREDENTIAL_RETRY = 60.0  # seconds between tries of a failed kubeconfig credential refresh


async def load_client_configuration(
    kubeconfig: str | None = None, master: str | None = None
) -> tuple[Any, Any]:
    """Client configuration (and kubeconfig loader, if any) as kube-proxy finds it.

    Order: the kubeconfig file, else `$KUBECONFIG`; `master` overrides its server. With
    neither file, `master` alone, else the in-cluster service account. ConfigError otherwise.
    """
    configuration = kclient.Configuration()
    path = kubeconfig or os.environ.get("KUBECONFIG") or None
    loader = None
    if path:
        if not _any_file(path):
            raise ConfigError(f"cannot load kubeconfig {path}: no such file")
        try:
            loader = await kconfig.load_kube_config(
                config_file=path, client_configuration=configuration, persist_config=False
            )
        except Exception as exc:  # the loader raises many types; all mean "bad kubeconfig"
            raise ConfigError(f"cannot load kubeconfig {path}: {exc}") from exc
        _follow_token_file(loader, configuration)
        if master:
            configuration.host = master.rstrip("/")
    elif master:
        configuration.host = master.rstrip("/")
    else:
        try:
            kconfig.load_incluster_config(client_configuration=configuration)
        except kconfig.ConfigException as exc:
            raise ConfigError(
                "no --kubeconfig, $KUBECONFIG or --master given, and the in-cluster "
                f"config is unusable ({exc}); run in a pod or pass --kubeconfig"
            ) from exc
    return configuration, loader


RequestObserver = Callable[[str, str, str, float], None]
"""Told of every API request: (HTTP code or "<error>", method, host, seconds to the answer)."""


def observe_requests(api: Any, observe: RequestObserver) -> None:
    """Report every request of `api` (an ApiClient) to `observe`, as client-go's metrics see
    them: the status code (or `<error>` without an answer), the method, the API server's
    host:port, and the time to the response headers (a watch's stream is not counted)."""
    rest = api.rest_client
    plain = rest.request

    async def request(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        code = "<error>"
        try:
            response = await plain(method, url, *args, **kwargs)
            code = str(response.status)
            return response
        except kclient.ApiException as exc:
            code = str(exc.status) if exc.status else "<error>"
            raise
        finally:
            observe(code, method, urlsplit(url).netloc, time.monotonic() - started)

    rest.request = request


def _follow_token_file(loader: Any, configuration: Any) -> None:
    """Re-read a kubeconfig user's `tokenFile` whenever the file changes, as client-go does.

    Projected service-account tokens (kubeadm's kubeconfig.conf names one) are rotated by the
    kubelet about hourly; the client reads the token once, so without this the proxy would
    lose the API server when the old token expires. One stat per request: requests are lists
    and watch starts, not per connection.
    """
    user = getattr(loader, "_user", None)
    if user is not None and "exec" in user:
        _rerun_expired_exec(loader, configuration)
        return
    if user is None or "tokenFile" not in user or user.safe_get("token"):
        return
    path = os.path.join(loader._get_base_path(user.path), user["tokenFile"])
    seen = [_stamp(path)]

    def reread(config: Any, *_: Any) -> None:
        stamp = _stamp(path)
        if stamp == seen[0]:
            return
        try:
            with open(path) as handle:
                token = handle.read().strip()
        except OSError as exc:
            log.warning("cannot re-read the API token from %s: %s", path, exc.strerror)
            return
        if not token:
            return  # caught mid-write: the next request reads it again
        seen[0] = stamp
        config.api_key["BearerToken"] = f"Bearer {token}"
        log.info("API token file %s changed: using the new token", path)

    configuration.refresh_api_key_hook = reread


def _rerun_expired_exec(loader: Any, configuration: Any) -> None:
    """Re-run an exec credential plugin at the first request after its token expires.

    (client-go does the same; the client library alone checks only once a minute.) A plugin
    that gives no expirationTimestamp keeps its token until the minutely check re-runs it.
    """

    async def rerun(config: Any, *_: Any) -> None:
        expiry = getattr(loader, "exec_plugin_expiry", None)
        if expiry is None or not kconfig.kube_config._is_expired(expiry):
            return
        run = asyncio.ensure_future(loader.load_from_exec_plugin())
        try:
            renewed = await asyncio.shield(run)
        except asyncio.CancelledError:
            # Stopping: let the plugin process finish rather than leave it behind.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(run, PLUGIN_GRACE)
            raise
        if renewed:
            config.api_key["BearerToken"] = loader.token
            log.info("exec credential plugin re-run: its token had expired")

    configuration.refresh_api_key_hook = rerun


def _stamp(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)  # follows the ..data symlink a projected volume swaps
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _any_file(paths: str) -> bool:
    """Like kubectl: of a `:`-separated $KUBECONFIG, missing files are skipped; none is an error."""
    return any(os.path.isfile(p) for p in paths.split(os.pathsep) if p)


async def refresh_credentials(loader: Any, configuration: Any) -> None:
    """Keep exec-plugin / GCP tokens of a kubeconfig fresh; other auth needs nothing."""
    while True:
        try:
            await kconfig.refresh_token(loader, configuration)
            return  # nothing to refresh for this kind of credential
        except Exception as exc:  # a failed refresh must not stop the proxy; try again later
            log.warning("kubeconfig credential refresh failed: %s", describe(exc))
            await asyncio.sleep(CREDENTIAL_RETRY)
