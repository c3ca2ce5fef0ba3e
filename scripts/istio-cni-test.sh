#!/usr/bin/env bash
# Upstream's Go CNI plugin (istio-cni) as a benchmark peer; never part of CI's default run.
#
#   scripts/istio-cni-test.sh build     build (or find cached) the istio-cni plugin binary, print its path
#
# Built from the same pinned istio.io/istio module version as scripts/istiod-test.sh
# (ISTIOD_TEST_ISTIO_VERSION, default below = that script's default), package
# cni/cmd/istio-cni, with the same flags (static, stripped, trimmed paths). Cached under
# $ISTIO_CNI_TEST_CACHE (default /var/cache/ambient-agent-istio-cni as root, else
# ${XDG_CACHE_HOME:-~/.cache}/ambient-agent-istio-cni), one file per (istio version, Go
# version); the build runs under flock (/tmp/go-build-istio-cni.lock) so two callers never
# build at once and the second finds the first one's result. Used by
# benchmarks/bench_cni_upstream.py.
set -euo pipefail

ISTIO_VERSION=${ISTIOD_TEST_ISTIO_VERSION:-v0.0.0-20260827124520-eed52ebb66ad}

die() { echo "istio-cni-test: $*" >&2; exit 1; }
log() { echo "istio-cni-test: $*" >&2; }

# shellcheck source=scripts/lib-go.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib-go.sh"

cache_root() { cache_root_for ISTIO_CNI_TEST_CACHE ambient-agent-istio-cni; }

cmd_build() {
  local go out work t0
  go=$(find_go) || die "Go not found (PATH or /usr/local/go/bin)"
  out="$(cache_root)/istio-cni-${ISTIO_VERSION}_$("$go" env GOVERSION)"
  if [ -x "$out" ]; then echo "$out"; return; fi
  mkdir -p "$(cache_root)"
  exec 9>/tmp/go-build-istio-cni.lock
  lock_build 9 /tmp/go-build-istio-cni.lock istio-cni
  if [ -x "$out" ]; then echo "$out"; return; fi
  work=$(mktemp -d "$(cache_root)/build.XXXXXX")
  trap 'rm -rf "$work"' RETURN
  t0=$(date +%s)
  export GOFLAGS="-mod=mod -buildvcs=false -trimpath" CGO_ENABLED=0 GOTOOLCHAIN=local
  log "building istio-cni from istio.io/istio@${ISTIO_VERSION} (first run only)"
  (cd "$work" &&
   printf 'module ambient.invalid/istio-cni-test\n\ngo 1.26\n' > go.mod &&
   "$go" get "istio.io/istio@${ISTIO_VERSION}" >&2 &&
   "$go" build -ldflags "-s -w" -o "$work/istio-cni" istio.io/istio/cni/cmd/istio-cni >&2)
  mv "$work/istio-cni" "$out"
  log "built in $(( $(date +%s) - t0 ))s: $out"
  echo "$out"
}

case "${1:-}" in
  build) cmd_build ;;
  *) die "usage: $0 build" ;;
esac
