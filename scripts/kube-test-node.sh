#!/usr/bin/env bash
# The node half of a real Kubernetes cluster for the tests: kubelet, kube-controller-manager,
# kube-scheduler and kubectl, built from the same k8s.io/kubernetes module (same version, same
# Go toolchain) as the kube-apiserver of scripts/kube-test-apiserver.sh, plus the static
# `pause` program the node's sandbox image holds.
#
#   scripts/kube-test-node.sh build     build (or find cached) binaries, print their dir
#   scripts/kube-test-node.sh check     say what the node needs and is missing here (exit 1 if any)
#
# The container runtime is Debian 12's containerd (1.6) with runc, both from apt
# (scripts/install-system-deps.sh). Kubelet 1.37 accepts it: it asks the runtime for its
# cgroup driver through the CRI RuntimeConfig call and, when the runtime answers
# Unimplemented (containerd 1.x does), falls back to the kubelet's own cgroupDriver setting
# (cmd/kubelet/app/server.go getCgroupDriverFromCRI; the fallback is announced as going in
# 1.38). The tests run everything else themselves (tests/node/): containerd with a private
# config, root, state, socket and CNI dirs; the kubelet with a private root dir and cgroup
# root; the controllers against the test's own kube-apiserver.
#
# Build: one throwaway Go module requiring k8s.io/kubernetes with its staging modules
# replaced by their published versions (as scripts/kube-test-apiserver.sh does), binaries
# cached under $KUBE_TEST_CACHE (default /var/cache/ambient-agent-kube as root, else
# ${XDG_CACHE_HOME:-~/.cache}/ambient-agent-kube) in node-k8s-<version>_<go version>/.
# One build at a time (flock /tmp/go-build-kube-node.lock); a second caller waits and finds
# the first one's result. Needs Go (`go` on PATH or /usr/local/go/bin) and the Go module
# proxy. Environment: KUBE_TEST_K8S_VERSION (default v1.37.2, as the apiserver's),
# KUBE_TEST_CACHE.
set -euo pipefail

K8S_VERSION=${KUBE_TEST_K8S_VERSION:-v1.37.2}
BINARIES=(kubelet kube-controller-manager kube-scheduler kubectl pause)
LOCK=/tmp/go-build-kube-node.lock

die() { echo "kube-test-node: $*" >&2; exit 1; }
log() { echo "kube-test-node: $*" >&2; }

# shellcheck source=scripts/lib-go.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib-go.sh"

cache_root() { cache_root_for KUBE_TEST_CACHE ambient-agent-kube; }

bin_dir() {
  local gov; gov=$("$1" env GOVERSION)
  echo "$(cache_root)/node-k8s-${K8S_VERSION}_${gov}"
}

complete() {
  local b
  for b in "${BINARIES[@]}"; do [ -x "$1/$b" ] || return 1; done
}

# The sandbox ("pause") container's program: holds the pod's namespaces open, reaps the
# zombies of processes that end up as its children (it is PID 1 of a pod that shares its
# PID namespace), exits 0 on SIGINT/SIGTERM.
write_pause() {
  mkdir -p "$1/pause"
  cat > "$1/pause/main.go" <<'GO'
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range sigs {
		if s == syscall.SIGCHLD {
			for {
				pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
				if pid <= 0 || err != nil {
					break
				}
			}
			continue
		}
		os.Exit(0)
	}
}
GO
}

cmd_build() {
  local go bin work t0 ver
  go=$(find_go) || die "Go not found (PATH or /usr/local/go/bin)"
  bin=$(bin_dir "$go")
  if complete "$bin"; then echo "$bin"; return; fi
  mkdir -p "$(cache_root)"
  exec 9>"$LOCK"
  lock_build 9 "$LOCK" "the kubelet node"
  if complete "$bin"; then echo "$bin"; return; fi
  work=$(mktemp -d "$(cache_root)/node-build.XXXXXX")
  trap 'rm -rf "$work"' RETURN
  t0=$(date +%s)
  export GOFLAGS="-mod=mod -buildvcs=false -trimpath" CGO_ENABLED=0 GOTOOLCHAIN=local
  log "building kubelet, kube-controller-manager, kube-scheduler, kubectl ${K8S_VERSION} with $("$go" env GOVERSION) (first run only)"
  mkdir -p "$work/k8s" "$work/out"
  k8s_gomod "$go" "$work/k8s" ambient.invalid/kube-test-node
  write_pause "$work/k8s"
  ver=${K8S_VERSION#v}
  (cd "$work/k8s" &&
   "$go" get "k8s.io/kubernetes/cmd/kubelet@${K8S_VERSION}" >&2 &&
   "$go" build -ldflags "-s -w \
      -X k8s.io/component-base/version.gitVersion=${K8S_VERSION} \
      -X k8s.io/component-base/version.gitMajor=${ver%%.*} \
      -X k8s.io/component-base/version.gitMinor=$(echo "$ver" | cut -d. -f2) \
      -X k8s.io/component-base/version.gitTreeState=clean" \
      -o "$work/out/" k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-controller-manager \
      k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl >&2 &&
   "$go" build -ldflags "-s -w" -o "$work/out/pause" ./pause >&2)
  rm -rf "$bin"; mkdir -p "$(dirname "$bin")"
  mv "$work/out" "$bin"
  log "built in $(( $(date +%s) - t0 ))s: $bin"
  echo "$bin"
}

cmd_check() {
  local missing=() c
  for c in containerd containerd-shim-runc-v2 ctr runc iptables ip; do
    command -v "$c" >/dev/null 2>&1 || missing+=("$c (apt: scripts/install-system-deps.sh)")
  done
  for c in bridge host-local loopback; do
    [ -x "/usr/lib/cni/$c" ] || missing+=("/usr/lib/cni/$c (apt: containernetworking-plugins)")
  done
  grep -qw overlay /proc/filesystems || missing+=("overlayfs (the containerd snapshotter)")
  if [ ${#missing[@]} -gt 0 ]; then printf 'missing: %s\n' "${missing[@]}"; exit 1; fi
  echo ok
}

case "${1:-}" in
  build) cmd_build ;;
  check) cmd_check ;;
  *) die "usage: $0 build | check" ;;
esac
