"""kubernetes_asyncio's client, loaded without the packages' `__init__` files that import every
generated API and model (~35 MB of a process's RSS; the source reads raw JSON, so it uses none
of them).

`kubernetes_asyncio`, `.client`, `.client.api` and `.client.models` are entered in
`sys.modules` as empty packages with their real `__path__`, so the modules the source needs
import as usual. The first time anything asks one of them for a name it lacks (a model, an API
the source does not use), its real `__init__` runs into it: code elsewhere in the process that
uses the whole client still finds all of it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

PACKAGES = (
    "kubernetes_asyncio",
    "kubernetes_asyncio.client",
    "kubernetes_asyncio.client.api",
    "kubernetes_asyncio.client.models",
)


def _lazy_package(name: str, directory: Path) -> ModuleType:
    """An empty package `name` whose own `__init__` runs on the first missing attribute."""
    package = ModuleType(name)
    package.__path__ = [str(directory)]
    package.__file__ = str(directory / "__init__.py")
    package.__package__ = name
    spec = importlib.util.spec_from_file_location(
        name, directory / "__init__.py", submodule_search_locations=[str(directory)]
    )
    package.__spec__ = spec
    loaded = False

    def complete(attribute: str) -> Any:
        nonlocal loaded
        if loaded or spec is None or spec.loader is None or attribute.startswith("__"):
            raise AttributeError(f"module {name!r} has no attribute {attribute!r}")
        if (directory / f"{attribute}.py").exists() or (directory / attribute).is_dir():
            # `from package import submodule` asks the package first: a submodule is no
            # reason to load the rest.
            return importlib.import_module(f"{name}.{attribute}")
        loaded = True
        del package.__getattr__  # the real names from now on
        spec.loader.exec_module(package)
        return getattr(package, attribute)

    package.__getattr__ = complete  # type: ignore[method-assign]
    return package


def _load() -> tuple[Any, Any]:
    if "kubernetes_asyncio" not in sys.modules:
        spec = importlib.util.find_spec("kubernetes_asyncio")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("kubernetes_asyncio is not installed")
        root = Path(next(iter(spec.submodule_search_locations)))
        for name in PACKAGES:
            directory = root.joinpath(*name.split(".")[1:])
            sys.modules[name] = _lazy_package(name, directory)
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(sys.modules[parent], child, sys.modules[name])
        client: Any = sys.modules["kubernetes_asyncio.client"]
        # What `kube_config` and `incluster_config` import from the client package.
        configuration = importlib.import_module("kubernetes_asyncio.client.configuration")
        api_client = importlib.import_module("kubernetes_asyncio.client.api_client")
        exceptions = importlib.import_module("kubernetes_asyncio.client.exceptions")
        client.Configuration = configuration.Configuration
        client.ApiClient = api_client.ApiClient
        client.ApiException = exceptions.ApiException
        core = importlib.import_module("kubernetes_asyncio.client.api.core_v1_api")
        discovery = importlib.import_module("kubernetes_asyncio.client.api.discovery_v1_api")
        client.CoreV1Api = core.CoreV1Api
        client.DiscoveryV1Api = discovery.DiscoveryV1Api
    return (
        sys.modules["kubernetes_asyncio.client"],
        importlib.import_module("kubernetes_asyncio.config"),
    )


kclient, kconfig = _load()
"""The client package (Configuration, ApiClient, ApiException, CoreV1Api, DiscoveryV1Api) and
the config package (load_kube_config, load_incluster_config, ConfigException, ...)."""
