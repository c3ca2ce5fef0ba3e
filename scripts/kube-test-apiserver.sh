#!/usr/bin/env bash
# A real Kubernetes API server for the tests: kube-apiserver + etcd on loopback.
#
#   scripts/kube-test-apiserver.sh build              build (or find cached) binaries, print their dir
#   scripts/kube-test-apiserver.sh start DIR          start etcd + kube-apiserver, wait for /readyz
#   scripts/kube-test-apiserver.sh stop DIR           stop both and remove DIR
#   scripts/kube-test-apiserver.sh apiserver-stop DIR    stop kube-apiserver only (etcd keeps the data)
#   scripts/kube-test-apiserver.sh apiserver-start DIR   start it again on the same port, wait for /readyz
#
# What `start` leaves in DIR (mode 0700):
#   admin.kubeconfig   cluster-admin (client certificate, group system:masters), certs embedded
#   env                shell-style KEY=value lines: KUBE_APISERVER_URL, ETCD_URL, ports, pids, CA
#   ca.crt             the CA of the serving certificate and of client certificates
#   sa.key / sa.pub    service-account token signing key pair
#   *.log              the servers' logs
#
# The server: RBAC (`--authorization-mode=Node,RBAC`), client-certificate and service-account
# token authentication (so TokenReview and TokenRequest work), the default admission plugins
# (ServiceAccount included: a namespace needs its `default` ServiceAccount before pods can be
# created in it, which kube-controller-manager would create; tests play that controller, as
# they play the kubelet), dual-stack service CIDRs, APF on. No controller manager, scheduler
# or kubelet runs. Everything binds 127.0.0.1 on free ports picked at start (two runs can
# coexist); the ports are kept across apiserver-stop/apiserver-start so clients can reconnect.
# On SIGTERM it ends open watches after 2 s (--shutdown-watch-termination-grace-period;
# without it a graceful stop waits for every watch to time out).
# etcd speaks plain HTTP on loopback (a throwaway test store; DIR is 0700).
#
# Why etcd from its Go module: it is the store kube-apiserver is developed and tested
# against, at the version Kubernetes itself requires (go.mod of k8s.io/kubernetes); it is
# built by the same toolchain as the apiserver into the same cache, installs no system
# service, and its HTTP gateway lets tests compact history (410 Gone). Debian 12's
# etcd-server is 3.4 (end of life; Kubernetes 1.37 is built against etcd 3.7); kine would
# be a translation layer of its own, not the store real clusters run.
#
# Build: two throwaway Go modules (k8s.io/kubernetes with its staging modules replaced by
# their published versions; go.etcd.io/etcd/server/v3), binaries cached under
# $KUBE_TEST_CACHE (default /var/cache/ambient-agent-kube as root, else
# ${XDG_CACHE_HOME:-~/.cache}/ambient-agent-kube), one directory per
# (Kubernetes version, etcd version, Go version). Needs Go (`go` on PATH or /usr/local/go/bin)
# and the Go module proxy. Environment: KUBE_TEST_K8S_VERSION, KUBE_TEST_ETCD_VERSION,
# KUBE_TEST_CACHE, KUBE_TEST_OWNER_PID (stop everything when that process exits),
# KUBE_TEST_APISERVER_ARGS (extra kube-apiserver flags).
set -euo pipefail

K8S_VERSION=${KUBE_TEST_K8S_VERSION:-v1.37.2}
ETCD_VERSION=${KUBE_TEST_ETCD_VERSION:-v3.7.3}
READY_TIMEOUT=${KUBE_TEST_READY_TIMEOUT:-120}
MARKER=.kube-test-apiserver

die() { echo "kube-test-apiserver: $*" >&2; exit 1; }
log() { echo "kube-test-apiserver: $*" >&2; }

# shellcheck source=scripts/lib-go.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib-go.sh"

cache_root() { cache_root_for KUBE_TEST_CACHE ambient-agent-kube; }

# bin_dir GO -> the cache directory for this version triple
bin_dir() {
  local gov; gov=$("$1" env GOVERSION)
  echo "$(cache_root)/k8s-${K8S_VERSION}_etcd-${ETCD_VERSION}_${gov}"
}

cmd_build() {
  local go bin work t0 ver
  go=$(find_go) || die "Go not found (PATH or /usr/local/go/bin)"
  bin=$(bin_dir "$go")
  if [ -x "$bin/kube-apiserver" ] && [ -x "$bin/etcd" ]; then echo "$bin"; return; fi
  mkdir -p "$(cache_root)"
  exec 9>"$(cache_root)/.lock"
  lock_build 9 "$(cache_root)/.lock" kube-apiserver+etcd   # one build at a time; a second caller finds the first one's result
  if [ -x "$bin/kube-apiserver" ] && [ -x "$bin/etcd" ]; then echo "$bin"; return; fi
  work=$(mktemp -d "$(cache_root)/build.XXXXXX")
  trap 'rm -rf "$work"' RETURN
  t0=$(date +%s)
  export GOFLAGS="-mod=mod -buildvcs=false -trimpath" CGO_ENABLED=0 GOTOOLCHAIN=local
  log "building kube-apiserver ${K8S_VERSION} and etcd ${ETCD_VERSION} with $("$go" env GOVERSION) (first run only)"

  mkdir -p "$work/k8s" "$work/etcd" "$work/out"
  k8s_gomod "$go" "$work/k8s" ambient.invalid/kube-test-apiserver
  ver=${K8S_VERSION#v}
  (cd "$work/k8s" &&
   "$go" get "k8s.io/kubernetes/cmd/kube-apiserver@${K8S_VERSION}" >&2 &&
   "$go" build -ldflags "-s -w \
      -X k8s.io/component-base/version.gitVersion=${K8S_VERSION} \
      -X k8s.io/component-base/version.gitMajor=${ver%%.*} \
      -X k8s.io/component-base/version.gitMinor=$(echo "$ver" | cut -d. -f2) \
      -X k8s.io/component-base/version.gitTreeState=clean" \
      -o "$work/out/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver >&2)
  log "kube-apiserver built after $(( $(date +%s) - t0 ))s"
  (cd "$work/etcd" &&
   printf 'module ambient.invalid/kube-test-etcd\n\ngo 1.24\n' > go.mod &&
   "$go" get "go.etcd.io/etcd/server/v3@${ETCD_VERSION}" >&2 &&
   "$go" build -ldflags "-s -w" -o "$work/out/etcd" go.etcd.io/etcd/server/v3 >&2)
  rm -rf "$bin"; mkdir -p "$(dirname "$bin")"
  mv "$work/out" "$bin"
  log "built in $(( $(date +%s) - t0 ))s: $bin"
  echo "$bin"
}

# --- start / stop ---

gen_certs() {
  local d=$1
  (
    cd "$d"
    umask 077
    openssl req -x509 -newkey rsa:2048 -nodes -days 7 -keyout ca.key -out ca.crt \
      -subj "/CN=kube-test-apiserver-ca" 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr \
      -subj "/CN=kube-apiserver" 2>/dev/null
    printf '%s\n' "subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local" \
      "extendedKeyUsage=serverAuth" "keyUsage=digitalSignature,keyEncipherment" > apiserver.ext
    openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 7 \
      -extfile apiserver.ext -out apiserver.crt 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -keyout admin.key -out admin.csr \
      -subj "/O=system:masters/CN=kube-test-admin" 2>/dev/null
    printf '%s\n' "extendedKeyUsage=clientAuth" "keyUsage=digitalSignature,keyEncipherment" > client.ext
    openssl x509 -req -in admin.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 7 \
      -extfile client.ext -out admin.crt 2>/dev/null
    openssl genrsa -out sa.key 2048 2>/dev/null
    openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
    rm -f ./*.csr ./*.ext ca.srl
  )
}

write_kubeconfig() {
  local d=$1 url=$2
  local ca crt key
  ca=$(base64 -w0 < "$d/ca.crt"); crt=$(base64 -w0 < "$d/admin.crt"); key=$(base64 -w0 < "$d/admin.key")
  (umask 077; cat > "$d/admin.kubeconfig" <<KUBECONFIG
apiVersion: v1
kind: Config
clusters:
- name: kube-test
  cluster:
    server: $url
    certificate-authority-data: $ca
users:
- name: admin
  user:
    client-certificate-data: $crt
    client-key-data: $key
contexts:
- name: admin@kube-test
  context: {cluster: kube-test, user: admin}
current-context: admin@kube-test
KUBECONFIG
  )
}

# wait_ready DIR URL PIDFILE NAME: /readyz through the admin certificate
wait_ready() {
  local d=$1 url=$2 pidf=$3 name=$4 deadline=$(( $(date +%s) + READY_TIMEOUT ))
  while :; do
    if curl -sf --max-time 5 --cacert "$d/ca.crt" --cert "$d/admin.crt" --key "$d/admin.key" \
         "$url/readyz" 2>/dev/null | grep -qx ok; then
      return 0
    fi
    if ! pid_alive "$pidf"; then
      tail -n 30 "$d/$name.log" >&2 || true
      return 1
    fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
      log "$name not ready after ${READY_TIMEOUT}s"; tail -n 30 "$d/$name.log" >&2 || true
      return 1
    fi
    sleep 0.3
  done
}

start_etcd() {
  local d=$1 bin=$2 tries port peer
  for tries in 1 2 3 4 5; do
    port=$(free_port); peer=$(free_port)
    [ "$port" != "$peer" ] || continue
    setsid "$bin/etcd" --name kube-test --data-dir "$d/etcd-data" \
      --listen-client-urls "http://127.0.0.1:$port" --advertise-client-urls "http://127.0.0.1:$port" \
      --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
      --initial-cluster "kube-test=http://127.0.0.1:$peer" --initial-cluster-state new \
      --listen-metrics-urls "" --unsafe-no-fsync --log-level warn \
      --watch-progress-notify-interval 1s \
      </dev/null >>"$d/etcd.log" 2>&1 &
    echo $! > "$d/etcd.pid"
    local i
    for i in $(seq 100); do
      if curl -sf --max-time 2 "http://127.0.0.1:$port/health" 2>/dev/null | grep -q '"health":"true"'; then
        echo "$port"; return 0
      fi
      pid_alive "$d/etcd.pid" || break
      sleep 0.1
    done
    stop_pid "$d/etcd.pid" etcd
    log "etcd did not come up on 127.0.0.1:$port (try $tries)"; tail -n 5 "$d/etcd.log" >&2 || true
    rm -rf "$d/etcd-data"
  done
  return 1
}

# launch_apiserver DIR BIN PORT ETCD_PORT: start kube-apiserver in the background
launch_apiserver() {
  local d=$1 bin=$2 port=$3 etcd=$4
  # shellcheck disable=SC2086  # KUBE_TEST_APISERVER_ARGS is a flag list
  setsid "$bin/kube-apiserver" \
    --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$port" \
    --etcd-servers "http://127.0.0.1:$etcd" \
    --cert-dir "$d/apiserver-certs" \
    --tls-cert-file "$d/apiserver.crt" --tls-private-key-file "$d/apiserver.key" \
    --client-ca-file "$d/ca.crt" \
    --anonymous-auth=false \
    --authorization-mode Node,RBAC \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-account-key-file "$d/sa.pub" \
    --service-account-signing-key-file "$d/sa.key" \
    --service-cluster-ip-range 10.96.0.0/16,fd00:10:96::/112 \
    --endpoint-reconciler-type none \
    --allow-privileged=true \
    --profiling=false \
    --shutdown-delay-duration 0s --shutdown-send-retry-after=false \
    --shutdown-watch-termination-grace-period 2s \
    --v 1 ${KUBE_TEST_APISERVER_ARGS:-} \
    </dev/null >>"$d/kube-apiserver.log" 2>&1 &
  echo $! > "$d/kube-apiserver.pid"
}

write_env() {
  local d=$1 bin=$2 port=$3 etcd=$4
  cat > "$d/env" <<ENV
KUBE_APISERVER_URL=https://127.0.0.1:$port
KUBE_APISERVER_PORT=$port
ETCD_URL=http://127.0.0.1:$etcd
ETCD_PORT=$etcd
KUBECONFIG=$d/admin.kubeconfig
KUBE_CA_FILE=$d/ca.crt
KUBE_BIN_DIR=$bin
K8S_VERSION=$K8S_VERSION
ETCD_VERSION=$ETCD_VERSION
ENV
}

env_get() { sed -n "s/^$2=//p" "$1/env"; }

# start the owner watchdog: when KUBE_TEST_OWNER_PID exits, stop everything in DIR
start_watchdog() {
  local d=$1 owner=${KUBE_TEST_OWNER_PID:-}
  [ -n "$owner" ] || return 0
  local self; self=$(readlink -f "$0")
  setsid bash -c 'while kill -0 "$1" 2>/dev/null && [ -f "$2/'"$MARKER"'" ]; do sleep 1; done
                  [ -f "$2/'"$MARKER"'" ] && exec bash "$3" stop "$2"' \
    kube-test-watchdog "$owner" "$d" "$self" </dev/null >/dev/null 2>&1 &
  echo $! > "$d/watchdog.pid"
}

cmd_start() {
  local d=${1:-} bin etcd port tries
  [ -n "$d" ] || die "usage: $0 start DIR"
  if [ -e "$d" ] && [ -n "$(ls -A "$d" 2>/dev/null)" ]; then
    die "$d exists and is not empty (stop it first, or choose a new directory)"
  fi
  mkdir -p "$d"; chmod 700 "$d"; d=$(cd "$d" && pwd)
  touch "$d/$MARKER"
  bin=$(cmd_build) || { rm -rf "$d"; die "build failed (output above)"; }
  gen_certs "$d"
  if ! etcd=$(start_etcd "$d" "$bin"); then cmd_stop "$d" >/dev/null 2>&1 || true; die "etcd failed to start"; fi
  for tries in 1 2 3; do
    port=$(free_port)
    write_env "$d" "$bin" "$port" "$etcd"
    write_kubeconfig "$d" "https://127.0.0.1:$port"
    launch_apiserver "$d" "$bin" "$port" "$etcd"
    if wait_ready "$d" "https://127.0.0.1:$port" "$d/kube-apiserver.pid" kube-apiserver; then
      start_watchdog "$d"
      log "ready: https://127.0.0.1:$port (kubeconfig $d/admin.kubeconfig)"
      return 0
    fi
    stop_pid "$d/kube-apiserver.pid" kube-apiserver
    grep -q "address already in use" "$d/kube-apiserver.log" || break
  done
  cmd_stop "$d" >/dev/null 2>&1 || true
  die "kube-apiserver failed to start (log above)"
}

cmd_apiserver_stop() {
  local d=${1:-}
  [ -f "$d/$MARKER" ] || die "$d is not a directory made by '$0 start'"
  stop_pid "$d/kube-apiserver.pid" kube-apiserver
}

cmd_apiserver_start() {
  local d=${1:-} port
  [ -f "$d/$MARKER" ] || die "$d is not a directory made by '$0 start'"
  pid_alive "$d/kube-apiserver.pid" && die "kube-apiserver already running in $d"
  port=$(env_get "$d" KUBE_APISERVER_PORT)
  launch_apiserver "$d" "$(env_get "$d" KUBE_BIN_DIR)" "$port" "$(env_get "$d" ETCD_PORT)"
  wait_ready "$d" "https://127.0.0.1:$port" "$d/kube-apiserver.pid" kube-apiserver \
    || { stop_pid "$d/kube-apiserver.pid" kube-apiserver; die "kube-apiserver failed to restart on port $port"; }
}

cmd_stop() {
  local d=${1:-}
  [ -n "$d" ] || die "usage: $0 stop DIR"
  [ -e "$d" ] || return 0
  [ -f "$d/$MARKER" ] || die "$d is not a directory made by '$0 start'; not touching it"
  stop_pid "$d/kube-apiserver.pid" kube-apiserver
  stop_pid "$d/etcd.pid" etcd
  if [ -f "$d/watchdog.pid" ] && [ "$(cat "$d/watchdog.pid")" != "$$" ]; then
    kill "$(cat "$d/watchdog.pid")" 2>/dev/null || true
  fi
  rm -rf "$d"
}

case "${1:-}" in
  build) cmd_build ;;
  start) cmd_start "${2:-}" ;;
  stop) cmd_stop "${2:-}" ;;
  apiserver-stop) cmd_apiserver_stop "${2:-}" ;;
  apiserver-start) cmd_apiserver_start "${2:-}" ;;
  *) die "usage: $0 build | start DIR | stop DIR | apiserver-stop DIR | apiserver-start DIR" ;;
esac
