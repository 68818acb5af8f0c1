#!/bin/bash
# What a new connection costs when nat OUTPUT holds the rules of N Services, as the proxy
# installs them (Portals, restore backend, iptables-nft), against no rules at all:
# - "direct": a connection no rule matches (the proxy's dial to a pod, any node-local
#   connection): it walks whatever the layout makes it walk and matches nothing;
# - "ClusterIP": connections to 100 ClusterIPs spread over the N Services, each DNATed by its
#   Service's rule to the server (as the proxy's host rules DNAT to NODEIP:proxy-port).
# With BASELINE_SRC (another checkout's src/, e.g. the layout before destination shards), its
# rules are installed and measured too, in the same run, rounds interleaved; the figure is the
# median of ROUNDS rounds. Two network namespaces made here (names carry this pid) and removed
# on exit; the rules live only in the first. Needs root.
# Usage: sudo bash benchmarks/nat_walk.sh [SERVICES] [CONNECTIONS] [BASELINE_SRC] [ROUNDS]
set -euo pipefail
SERVICES=${1:-10000}
CONNECTIONS=${2:-3000}
BASELINE=${3:-}
ROUNDS=${4:-3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
A=kupnatA$$
B=kupnatB$$
SERVER=
OUT=$(mktemp -d)
cleanup() {
  if [ -n "$SERVER" ]; then kill "$SERVER" 2>/dev/null || true; fi
  ip netns del $A 2>/dev/null || true
  ip netns del $B 2>/dev/null || true
  rm -rf "$OUT"
}
trap cleanup EXIT
ip netns add $A
ip netns add $B
ip link add va$$ netns $A type veth peer name vb$$ netns $B
ip -n $A addr add 10.250.0.1/24 dev va$$
ip -n $B addr add 10.250.0.2/24 dev vb$$
ip -n $A link set va$$ up
ip -n $B link set vb$$ up
# The node sends to ClusterIPs: it needs a route before nat OUTPUT rewrites them.
ip -n $A route add 10.96.0.0/16 via 10.250.0.2 dev va$$
ip netns exec $B timeout 600 python3 -c '
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("10.250.0.2", 9000))
s.listen(4096)
while True:
    s.accept()[0].close()
' &
SERVER=$!
sleep 0.5

# Installs the rules of SERVICES Services with the Portals of source tree $1 ("" for none),
# after removing whatever an earlier install left. Every host rule DNATs to 10.250.0.2:9000.
install() {
  ip netns exec $A env PYTHONPATH="${1:-$ROOT/src}" "$PY" - "$SERVICES" "${1:+rules}" <<'EOF'
import sys
from kube_userspace_proxy import logs
from kube_userspace_proxy.model import ProxiedPort, ServicePortInfo, ServicePortName
from kube_userspace_proxy.portals import Portals, cleanup_all, make_backend

logs.setup(0)
cleanup_all()
if len(sys.argv) > 2 and sys.argv[2]:
    ports = []
    for i in range(int(sys.argv[1])):
        name = ServicePortName(f"ns{i % 50}", f"svc{i}", "http")
        info = ServicePortInfo(name, 80, (f"10.96.{i // 250}.{i % 250 + 1}",))
        ports.append(ProxiedPort(info, 9000, 9000))
    Portals(make_backend("restore"), node_ips=("10.250.0.2",)).apply(ports)
EOF
}

# Microseconds per new connection (wall), to $1: "direct" or "cluster".
measure() {
  ip netns exec $A python3 -c '
import socket, struct, sys, time
n, how, services = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
if how == "direct":
    targets = [("10.250.0.2", 9000)]
else:  # 100 ClusterIPs spread over the Services (their rules spread over the chains)
    picks = [k * services // 100 for k in range(100)]
    targets = [(f"10.96.{i // 250}.{i % 250 + 1}", 80) for i in picks]
linger = struct.pack("ii", 1, 0)  # close with RST: no TIME_WAIT piling up
wall = time.perf_counter()
for k in range(n):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
    s.connect(targets[k % len(targets)])
    s.close()
print(f"{1e6 * (time.perf_counter() - wall) / n:.1f}")
' "$CONNECTIONS" "$1" "$SERVICES"
}

LAYOUTS=(none current)
if [ -n "$BASELINE" ]; then LAYOUTS=(none baseline current); fi
for round in $(seq "$ROUNDS"); do
  for layout in "${LAYOUTS[@]}"; do
    case $layout in
      none) install "" ;;
      baseline) install "$BASELINE" ;;
      current) install "$ROOT/src" ;;
    esac
    measure direct >>"$OUT/$layout.direct"
    if [ "$layout" != none ]; then measure cluster >>"$OUT/$layout.cluster"; fi
  done
done

median() { sort -n "$1" | awk '{a[NR]=$1} END {print (NR % 2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
NONE=$(median "$OUT/none.direct")
echo "nat_walk: $SERVICES Services, $CONNECTIONS connections per figure, median of $ROUNDS rounds (us per new connection, wall)"
echo
echo "| rules in nat OUTPUT | direct (no rule matches) | through a ClusterIP | direct / no rules | ClusterIP / no rules |"
echo "|---|---:|---:|---:|---:|"
echo "| none | $NONE |  | 1.00x |  |"
for layout in "${LAYOUTS[@]}"; do
  if [ "$layout" = none ]; then continue; fi
  d=$(median "$OUT/$layout.direct")
  c=$(median "$OUT/$layout.cluster")
  label="$layout ($SERVICES Services)"
  if [ "$layout" = baseline ]; then label="baseline $BASELINE ($SERVICES Services)"; fi
  awk -v l="$label" -v d="$d" -v c="$c" -v n="$NONE" \
    'BEGIN {printf "| %s | %s | %s | %.2fx | %.2fx |\n", l, d, c, d / n, c / n}'
done
