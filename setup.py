"""The native data plane (src/kube_userspace_proxy/dataplane/_native.c), built with the package.

Everything else about the package is in pyproject.toml. The extension is optional: without a
C compiler (or Python's headers) the build says so and the package installs without it; the
proxy then serves with the Python data plane and says so once at start.

Flags: warnings are errors and the usual hardening (stack protector, _FORTIFY_SOURCE, full
RELRO). KUP_SANITIZE=1 builds it with AddressSanitizer and UndefinedBehaviorSanitizer for the
sanitizer run of the tests (scripts/dev sanitize). KUP_REQUIRE_NATIVE=1 makes a failed build
an error instead (the Dockerfile's build stage: the image always has the native data plane).
"""

from __future__ import annotations

import os

from setuptools import Extension, setup

CFLAGS = [
    "-std=gnu11",
    "-O2",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-fstack-protector-strong",
    "-U_FORTIFY_SOURCE",
    "-D_FORTIFY_SOURCE=2",
    "-fvisibility=hidden",
]
LDFLAGS = ["-Wl,-z,relro,-z,now"]
if os.environ.get("KUP_SANITIZE"):
    sanitize = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined"]
    CFLAGS = [f for f in CFLAGS if f not in ("-O2", "-U_FORTIFY_SOURCE", "-D_FORTIFY_SOURCE=2")]
    CFLAGS += ["-O1", "-g", *sanitize]
    LDFLAGS += sanitize

setup(
    ext_modules=[
        Extension(
            "kube_userspace_proxy.dataplane._native",
            ["src/kube_userspace_proxy/dataplane/_native.c"],
            extra_compile_args=CFLAGS,
            extra_link_args=LDFLAGS,
            optional=not os.environ.get("KUP_REQUIRE_NATIVE"),
        )
    ]
)
