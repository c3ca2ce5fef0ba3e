# Helpers shared by the scripts that build a Go peer from its modules and cache it
# (kube-test-apiserver.sh, kube-test-node.sh, istiod-test.sh, istio-cni-test.sh,
# helm-build.sh), and those that start and stop what they built. Sourced, never run; the
# sourcing script defines die() and log() first.
# Every cache path is computed here, so two scripts that share a cache (the API server's
# and the node's, both under ambient-agent-kube) name it the same way.

# find_go -> the go binary: `go` on PATH, else /usr/local/go/bin/go; status 1 when neither
find_go() {
  if command -v go >/dev/null 2>&1; then command -v go
  elif [ -x /usr/local/go/bin/go ]; then echo /usr/local/go/bin/go
  else return 1; fi
}

# cache_root_for VAR NAME -> the cache directory: the value of the environment variable
# named VAR when set and not empty, else /var/cache/NAME as root, else
# ${XDG_CACHE_HOME:-~/.cache}/NAME
cache_root_for() {
  local override=${!1:-}
  if [ -n "$override" ]; then echo "$override"
  elif [ "$(id -u)" = 0 ]; then echo "/var/cache/$2"
  else echo "${XDG_CACHE_HOME:-$HOME/.cache}/$2"; fi
}

# k8s_gomod GO DIR MODULE: writes DIR/go.mod for module MODULE requiring
# k8s.io/kubernetes@$K8S_VERSION, with its staging modules (replaced by ./staging/src/...
# in its own go.mod, which does not apply to a dependent) pointed at their published
# v0.X.Y tags, and its go and godebug lines
k8s_gomod() {
  local go=$1 dir=$2 module=$3 info kmod staging v0=${K8S_VERSION/#v1./v0.}
  info=$(cd "$dir" && GOFLAGS=-mod=mod "$go" mod download -json "k8s.io/kubernetes@${K8S_VERSION}" 2>&1) \
    || die "cannot download k8s.io/kubernetes@${K8S_VERSION}: $(echo "$info" | tr -s '\n' ' ')"
  kmod=$(echo "$info" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')
  [ -f "$kmod" ] || die "no go.mod for k8s.io/kubernetes@${K8S_VERSION}: $(echo "$info" | tr -s '\n' ' ')"
  staging=$(sed -n 's#^[[:space:]]*\(k8s\.io/[a-z0-9-]*\) => \./staging/.*#\1#p' "$kmod")
  [ -n "$staging" ] || die "no staging replace directives in $kmod"
  {
    echo "module $module"
    echo
    sed -n 's/^go \(.*\)$/go \1/p' "$kmod" | head -1
    sed -n 's/^godebug \(.*\)$/godebug \1/p' "$kmod" | head -1
    echo
    echo "require k8s.io/kubernetes ${K8S_VERSION}"
    echo
    echo "replace ("
    for m in $staging; do echo "	$m => $m $v0"; done
    echo ")"
  } > "$dir/go.mod"
}

# lock_build FD LOCK WHAT: take the flock on FD (already opened on the file LOCK); when
# another process holds it, say so on stderr in one line first, so a caller waiting
# minutes for someone else's build knows why nothing happens
lock_build() {
  local fd=$1 lock=$2 what=$3
  flock -n "$fd" && return 0
  echo "waiting for $lock (another build of $what is running)" >&2
  flock "$fd"
}

# --- the peers' processes (kube-test-apiserver.sh, istiod-test.sh) ---

# free_port -> a TCP port on 127.0.0.1 that nothing listens on right now
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# pid_alive PIDFILE: status 0 when the file names a live process
pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# stop_pid PIDFILE NAME: SIGTERM, up to 15 s, then SIGKILL (logged with NAME); waits until
# gone, then removes PIDFILE
stop_pid() {
  local f=$1 pid i
  [ -f "$f" ] || return 0
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      log "$2 (pid $pid) ignored SIGTERM for 15s; killing it"
      kill -KILL "$pid" 2>/dev/null || true
      for i in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
  fi
  rm -f "$f"
}
