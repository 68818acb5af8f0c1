# kube-userspace-proxy node image: `docker build -t kube-userspace-proxy:VERSION .`, VERSION
# being src/kube_userspace_proxy/__init__.py's __version__ (the one place it is written; the
# chart's appVersion is checked against it by tests/unit/test_packaging.py).
#
# Build stage: python-iptables has a small C extension (and no wheels), and so has this package
# (the native data plane, src/kube_userspace_proxy/dataplane/_native.c), so wheels for the
# package and all its dependencies are built here, with a compiler the final image does not
# carry. KUP_REQUIRE_NATIVE=1: a native data plane that does not build fails the image build
# (elsewhere it is optional, and the Python data plane serves).
FROM python:3.11-slim AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md LICENSE constraints.txt ./
COPY src ./src
# constraints.txt pins every package (direct and indirect): a rebuild gets what was tested.
RUN KUP_REQUIRE_NATIVE=1 pip wheel --no-cache-dir --wheel-dir /wheels -c constraints.txt . \
 && python -c "import glob, sys, zipfile; (w,) = glob.glob('/wheels/kube_userspace_proxy-*.whl'); \
sys.exit(not any(n.endswith('.so') for n in zipfile.ZipFile(w).namelist()))"

FROM python:3.11-slim
LABEL org.opencontainers.image.title="kube-userspace-proxy" \
      org.opencontainers.image.description="Kubernetes Service proxy in kube-proxy's userspace style, on asyncio + uvloop" \
      org.opencontainers.image.licenses="Apache-2.0"
# iptables brings iptables-legacy, iptables-nft, *-restore/-save and the libxtables/libiptc
# libraries python-iptables loads; the proxy picks the backend the host already uses.
RUN apt-get update \
 && apt-get install -y --no-install-recommends iptables \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
# pip compiles the bytecode now, so the read-only root filesystem of the chart costs nothing.
RUN pip install --no-cache-dir --no-index /wheels/*.whl && rm -rf /wheels
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

# Runs as root, on purpose: installing the KUBE-PORTALS-* / KUBE-NODEPORT-* rules needs
# CAP_NET_ADMIN (and CAP_NET_RAW for the legacy tables' socket), and Kubernetes (like Docker)
# only makes added capabilities effective for uid 0 — a non-root user would get them in its
# bounding set but not in its effective set, and every iptables call would fail with EPERM.
# The chart drops every other capability and mounts the root filesystem read-only.
USER 0

# 10256: /healthz and /livez; 10249: /metrics, /proxyMode, /configz, /debug/state.
EXPOSE 10256/tcp 10249/tcp
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import urllib.request as r; r.urlopen('http://127.0.0.1:10256/healthz', timeout=4)"]
ENTRYPOINT ["kube-userspace-proxy"]
