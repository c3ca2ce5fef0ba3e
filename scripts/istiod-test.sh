#!/usr/bin/env bash
# istiod (pilot-discovery) as a test peer, outside any cluster, against the test API server.
#
#   scripts/istiod-test.sh build               build (or find cached) pilot-discovery + CRDs, print their dir
#   scripts/istiod-test.sh start DIR           install the CRDs into the API server, start istiod, wait ready
#   scripts/istiod-test.sh stop DIR            stop istiod and remove DIR
#
# `start` needs ISTIOD_TEST_KUBECONFIG (a cluster-admin kubeconfig, e.g. the admin.kubeconfig
# that `scripts/kube-test-apiserver.sh start` leaves) or KUBECONFIG. What it leaves in DIR (0700):
#   env            shell-style KEY=value lines: ISTIOD_XDS_ADDR (plaintext gRPC xDS, what
#                  istiod serves on 15010 in a cluster), ISTIOD_SECURE_XDS_ADDR (15012),
#                  ISTIOD_HTTP_ADDR (debug, 8080), ISTIOD_MONITORING_ADDR (15014),
#                  ISTIOD_HTTPS_ADDR (webhooks, 15017), ISTIOD_PID, ISTIOD_BIN_DIR
#   mesh.yaml      the MeshConfig it runs with
#   istiod.log     its log
#
# istiod runs with ambient on (PILOT_ENABLE_AMBIENT), as cluster "Kubernetes" with domain
# cluster.local, all listeners on free ports of 127.0.0.1, no webhook configuration patched
# (no injection/validation webhooks exist here), its own self-signed CA (it keeps the root in
# the istio-ca-secret Secret of istio-system, which `start` creates if missing). Ready means
# its /ready endpoint answers 200 (informers synced).
#
# Build: a throwaway Go module requiring istio.io/istio at ISTIOD_TEST_ISTIO_VERSION (a
# pseudo-version the Go module proxy serves), `go build` of pilot/cmd/pilot-discovery;
# the binary and the CRDs read from that module version (Istio's crd-all.gen.yaml and the
# Gateway API standard+experimental CRDs of the sigs.k8s.io/gateway-api version istio
# requires) are cached under $ISTIOD_TEST_CACHE (default /var/cache/ambient-agent-istiod as
# root, else ${XDG_CACHE_HOME:-~/.cache}/ambient-agent-istiod), one directory per
# (istio version, Go version), built under flock so two callers never build at once.
# Nothing of istio is kept outside the cache. Environment: ISTIOD_TEST_ISTIO_VERSION,
# ISTIOD_TEST_CACHE, ISTIOD_TEST_KUBECONFIG, ISTIOD_TEST_OWNER_PID (stop istiod when that
# process exits), ISTIOD_TEST_ENV (extra "K=V K=V" environment for istiod),
# ISTIOD_TEST_READY_TIMEOUT (seconds, default 120).
set -euo pipefail

ISTIO_VERSION=${ISTIOD_TEST_ISTIO_VERSION:-v0.0.0-20260827124520-eed52ebb66ad}
READY_TIMEOUT=${ISTIOD_TEST_READY_TIMEOUT:-120}
MARKER=.istiod-test

die() { echo "istiod-test: $*" >&2; exit 1; }
log() { echo "istiod-test: $*" >&2; }

# shellcheck source=scripts/lib-go.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib-go.sh"

cache_root() { cache_root_for ISTIOD_TEST_CACHE ambient-agent-istiod; }

bin_dir() {
  local gov; gov=$("$1" env GOVERSION)
  echo "$(cache_root)/istio-${ISTIO_VERSION}_${gov}"
}

built() { [ -x "$1/pilot-discovery" ] && [ -s "$1/crds.yaml" ]; }

cmd_build() {
  local go bin work t0 idir gwv gwdir
  go=$(find_go) || die "Go not found (PATH or /usr/local/go/bin)"
  bin=$(bin_dir "$go")
  if built "$bin"; then echo "$bin"; return; fi
  mkdir -p "$(cache_root)"
  exec 9>"$(cache_root)/.lock"
  lock_build 9 "$(cache_root)/.lock" istiod   # one build at a time; a second caller finds the first one's result
  if built "$bin"; then echo "$bin"; return; fi
  work=$(mktemp -d "$(cache_root)/build.XXXXXX")
  trap 'rm -rf "$work"' RETURN
  t0=$(date +%s)
  export GOFLAGS="-mod=mod -buildvcs=false -trimpath" CGO_ENABLED=0 GOTOOLCHAIN=local
  log "building pilot-discovery from istio.io/istio@${ISTIO_VERSION} with $("$go" env GOVERSION) (first run only)"
  mkdir -p "$work/mod" "$work/out"
  (cd "$work/mod" &&
   printf 'module ambient.invalid/istiod-test\n\ngo 1.26\n' > go.mod &&
   "$go" get "istio.io/istio@${ISTIO_VERSION}" >&2 &&
   "$go" build -ldflags "-s -w" -o "$work/out/pilot-discovery" istio.io/istio/pilot/cmd/pilot-discovery >&2)
  log "pilot-discovery built after $(( $(date +%s) - t0 ))s"
  idir=$(cd "$work/mod" && "$go" list -m -f '{{.Dir}}' istio.io/istio)
  [ -f "$idir/manifests/charts/base/files/crd-all.gen.yaml" ] || die "no CRDs in $idir/manifests/charts/base/files"
  gwv=$(cd "$work/mod" && "$go" list -m -f '{{.Version}}' sigs.k8s.io/gateway-api)
  gwdir=$(cd "$work/mod" && "$go" mod download -json "sigs.k8s.io/gateway-api@$gwv" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  [ -d "$gwdir/config/crd/experimental" ] || die "no Gateway API CRDs in $gwdir/config/crd"
  {
    cat "$idir/manifests/charts/base/files/crd-all.gen.yaml"
    for f in "$gwdir"/config/crd/experimental/*.yaml; do echo "---"; cat "$f"; done
  } > "$work/out/crds.yaml"
  printf 'ISTIO_VERSION=%s\nGATEWAY_API_VERSION=%s\n' "$ISTIO_VERSION" "$gwv" > "$work/out/versions"
  rm -rf "$bin"; mkdir -p "$(dirname "$bin")"
  mv "$work/out" "$bin"
  log "built in $(( $(date +%s) - t0 ))s: $bin"
  echo "$bin"
}

# --- start / stop ---

# kubectl-free apply of the CRDs: server-side apply of each document through curl with the
# kubeconfig's client certificate or token (python3 + PyYAML split the file).
install_crds() {
  local d=$1 bin=$2 kubeconfig=$3
  python3 - "$bin/crds.yaml" "$kubeconfig" "$d" <<'PYCRD'
import base64, json, ssl, sys, time, urllib.request, yaml
crds_file, kubeconfig, d = sys.argv[1:4]
cfg = yaml.safe_load(open(kubeconfig))
ctx = next(c["context"] for c in cfg["contexts"] if c["name"] == cfg["current-context"])
cluster = next(c["cluster"] for c in cfg["clusters"] if c["name"] == ctx["cluster"])
user = next(u["user"] for u in cfg["users"] if u["name"] == ctx["user"])
tls = ssl.create_default_context()
if "certificate-authority-data" in cluster:
    tls.load_verify_locations(cadata=base64.b64decode(cluster["certificate-authority-data"]).decode())
elif "certificate-authority" in cluster:
    tls.load_verify_locations(cafile=cluster["certificate-authority"])
headers = {}
if "client-certificate-data" in user:
    for name in ("client-certificate-data", "client-key-data"):
        with open(f"{d}/.{name}", "wb") as f:
            f.write(base64.b64decode(user[name]))
    tls.load_cert_chain(f"{d}/.client-certificate-data", f"{d}/.client-key-data")
elif "token" in user:
    headers["Authorization"] = "Bearer " + user["token"]
server = cluster["server"].rstrip("/")
base = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
def call(method, path, body=None, ctype="application/json"):
    req = urllib.request.Request(server + path, method=method, data=body,
                                 headers={**headers, "Content-Type": ctype, "Accept": "application/json"})
    with urllib.request.urlopen(req, context=tls, timeout=30) as r:
        return json.loads(r.read() or b"{}")
names = []
for doc in yaml.safe_load_all(open(crds_file)):
    if not doc or doc.get("kind") != "CustomResourceDefinition":
        continue
    name = doc["metadata"]["name"]
    call("PATCH", f"{base}/{name}?fieldManager=istiod-test&force=true",
         json.dumps(doc).encode(), "application/apply-patch+yaml")
    names.append(name)
deadline = time.monotonic() + 60
for name in names:
    while True:
        conds = {c["type"]: c["status"] for c in (call("GET", f"{base}/{name}").get("status") or {}).get("conditions", [])}
        if conds.get("Established") == "True":
            break
        if time.monotonic() > deadline:
            sys.exit(f"CRD {name} not established after 60s: {conds}")
        time.sleep(0.2)
try:
    call("POST", "/api/v1/namespaces", json.dumps({"apiVersion": "v1", "kind": "Namespace",
         "metadata": {"name": "istio-system"}}).encode())
except urllib.error.HTTPError as e:
    if e.code != 409:
        raise
print(len(names))
PYCRD
  rm -f "$d/.client-certificate-data" "$d/.client-key-data"
}

write_mesh() {
  cat > "$1/mesh.yaml" <<'MESH'
# MeshConfig for the test istiod: the defaults, trust domain cluster.local, no discovery
# selectors (every namespace), no outbound restrictions.
trustDomain: cluster.local
rootNamespace: istio-system
defaultConfig:
  discoveryAddress: istiod.istio-system.svc:15012
MESH
}

start_watchdog() {
  local d=$1 owner=${ISTIOD_TEST_OWNER_PID:-}
  [ -n "$owner" ] || return 0
  local self; self=$(readlink -f "$0")
  setsid bash -c 'while kill -0 "$1" 2>/dev/null && [ -f "$2/'"$MARKER"'" ]; do sleep 1; done
                  [ -f "$2/'"$MARKER"'" ] && exec bash "$3" stop "$2"' \
    istiod-test-watchdog "$owner" "$d" "$self" </dev/null >/dev/null 2>&1 &
  echo $! > "$d/watchdog.pid"
}

# wait_ready DIR HTTP_PORT: istiod's /ready (200 once its informers synced)
wait_ready() {
  local d=$1 port=$2 deadline=$(( $(date +%s) + READY_TIMEOUT ))
  while :; do
    if curl -sf --max-time 5 -o /dev/null "http://127.0.0.1:$port/ready" 2>/dev/null; then return 0; fi
    if ! pid_alive "$d/istiod.pid"; then tail -n 30 "$d/istiod.log" >&2 || true; return 1; fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
      log "istiod not ready after ${READY_TIMEOUT}s"; tail -n 30 "$d/istiod.log" >&2 || true
      return 1
    fi
    sleep 0.3
  done
}

cmd_start() {
  local d=${1:-} bin kubeconfig grpc secure http https mon ctrlz n tries
  [ -n "$d" ] || die "usage: $0 start DIR"
  kubeconfig=${ISTIOD_TEST_KUBECONFIG:-${KUBECONFIG:-}}
  [ -n "$kubeconfig" ] && [ -f "$kubeconfig" ] || die "set ISTIOD_TEST_KUBECONFIG (or KUBECONFIG) to a cluster-admin kubeconfig"
  if [ -e "$d" ] && [ -n "$(ls -A "$d" 2>/dev/null)" ]; then
    die "$d exists and is not empty (stop it first, or choose a new directory)"
  fi
  mkdir -p "$d"; chmod 700 "$d"; d=$(cd "$d" && pwd)
  touch "$d/$MARKER"
  bin=$(cmd_build) || { rm -rf "$d"; die "build failed (output above)"; }
  n=$(install_crds "$d" "$bin" "$kubeconfig") || { rm -rf "$d"; die "installing the CRDs failed (output above)"; }
  log "$n CRDs established"
  write_mesh "$d"
  for tries in 1 2 3; do
    grpc=$(free_port); secure=$(free_port); http=$(free_port); https=$(free_port)
    mon=$(free_port); ctrlz=$(free_port)
    cat > "$d/env" <<ENV
ISTIOD_XDS_ADDR=127.0.0.1:$grpc
ISTIOD_SECURE_XDS_ADDR=127.0.0.1:$secure
ISTIOD_HTTP_ADDR=127.0.0.1:$http
ISTIOD_HTTPS_ADDR=127.0.0.1:$https
ISTIOD_MONITORING_ADDR=127.0.0.1:$mon
ISTIOD_BIN_DIR=$bin
ISTIOD_KUBECONFIG=$kubeconfig
$(cat "$bin/versions")
ENV
    # Ambient on; no webhooks to patch (none exist here); the gateway deployment and
    # status controllers off (tests write Gateway status themselves, as a gateway
    # controller would, and create the GatewayClasses, so both control planes read the same
    # objects); the ambient
    # status writer off (it would only add conditions); short debounce.
    # shellcheck disable=SC2086  # ISTIOD_TEST_ENV is a K=V list
    # (cwd DIR: istiod looks for optional files, e.g. injection templates, under ./var)
    (cd "$d" && exec env -i PATH="$PATH" HOME="${HOME:-/root}" \
      POD_NAMESPACE=istio-system POD_NAME=istiod-test REVISION=default \
      CLUSTER_ID=Kubernetes \
      PILOT_ENABLE_AMBIENT=true \
      INJECTION_WEBHOOK_CONFIG_NAME= VALIDATION_WEBHOOK_CONFIG_NAME= \
      PILOT_ENABLE_GATEWAY_API_DEPLOYMENT_CONTROLLER=false \
      PILOT_ENABLE_GATEWAY_API_STATUS=false \
      PILOT_ENABLE_GATEWAY_API_GATEWAYCLASS_CONTROLLER=false \
      AMBIENT_ENABLE_STATUS=false \
      PILOT_DEBOUNCE_AFTER=50ms PILOT_DEBOUNCE_MAX=1s \
      ISTIOD_CUSTOM_HOST=localhost \
      ${ISTIOD_TEST_ENV:-} \
      setsid "$bin/pilot-discovery" discovery \
        --kubeconfig "$kubeconfig" --meshConfig "$d/mesh.yaml" \
        --clusterID Kubernetes --domain cluster.local \
        --grpcAddr "127.0.0.1:$grpc" --secureGRPCAddr "127.0.0.1:$secure" \
        --httpAddr "127.0.0.1:$http" --httpsAddr "127.0.0.1:$https" \
        --monitoringAddr "127.0.0.1:$mon" \
        --ctrlz_address 127.0.0.1 --ctrlz_port "$ctrlz" \
        --log_output_level default:info \
        </dev/null >>"$d/istiod.log" 2>&1) &
    echo $! > "$d/istiod.pid"
    echo "ISTIOD_PID=$(cat "$d/istiod.pid")" >> "$d/env"
    if wait_ready "$d" "$http"; then
      start_watchdog "$d"
      log "ready: xDS 127.0.0.1:$grpc (plaintext), debug http://127.0.0.1:$http"
      return 0
    fi
    stop_pid "$d/istiod.pid" istiod
    grep -q "address already in use" "$d/istiod.log" || break
  done
  cmd_stop "$d" >/dev/null 2>&1 || true
  die "istiod failed to start (log above)"
}

cmd_stop() {
  local d=${1:-}
  [ -n "$d" ] || die "usage: $0 stop DIR"
  [ -e "$d" ] || return 0
  [ -f "$d/$MARKER" ] || die "$d is not a directory made by '$0 start'; not touching it"
  stop_pid "$d/istiod.pid" istiod
  if [ -f "$d/watchdog.pid" ] && [ "$(cat "$d/watchdog.pid")" != "$$" ]; then
    kill "$(cat "$d/watchdog.pid")" 2>/dev/null || true
  fi
  rm -rf "$d"
}

case "${1:-}" in
  build) cmd_build ;;
  start) cmd_start "${2:-}" ;;
  stop) cmd_stop "${2:-}" ;;
  *) die "usage: $0 build | start DIR | stop DIR" ;;
esac
