#!/usr/bin/env bash
# A real `helm` for the chart's tests (deploy/helm/ambient-agent), built from its Go module.
#
#   scripts/helm-build.sh build     build (or find cached) helm, print its path
#   scripts/helm-build.sh path      print the cached helm's path, exit 1 if not built
#
# Built with `go install helm.sh/helm/v3/cmd/helm@$HELM_VERSION`: exactly the dependency
# versions helm's own go.mod pins (no main module of ours), CGO off, trimmed paths, the
# version stamped as helm's Makefile stamps it. Cached under $HELM_CACHE (default
# /var/cache/ambient-agent-helm as root, else ${XDG_CACHE_HOME:-~/.cache}/ambient-agent-helm),
# one directory per (helm version, Go version); the build runs under `flock` on
# $HELM_CACHE/.lock so two callers never build it at once (the second finds the result).
# Needs Go (`go` on PATH or /usr/local/go/bin) and the Go module proxy.
set -euo pipefail

HELM_VERSION=${HELM_VERSION:-v3.22.0}

die() { echo "helm-build: $*" >&2; exit 1; }
log() { echo "helm-build: $*" >&2; }

# shellcheck source=scripts/lib-go.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib-go.sh"

cache_root() { cache_root_for HELM_CACHE ambient-agent-helm; }

bin_path() {
  local gov; gov=$("$1" env GOVERSION)
  echo "$(cache_root)/helm-${HELM_VERSION}_${gov}/helm"
}

cmd_build() {
  local go bin work t0
  go=$(find_go) || die "Go not found (PATH or /usr/local/go/bin)"
  bin=$(bin_path "$go")
  if [ -x "$bin" ]; then echo "$bin"; return; fi
  mkdir -p "$(cache_root)"
  exec 9>"$(cache_root)/.lock"
  lock_build 9 "$(cache_root)/.lock" helm
  if [ -x "$bin" ]; then echo "$bin"; return; fi
  work=$(mktemp -d "$(cache_root)/build.XXXXXX")
  trap 'rm -rf "$work"' RETURN
  t0=$(date +%s)
  log "building helm ${HELM_VERSION} with $("$go" env GOVERSION) (first run only)"
  (cd "$work" &&
   GOBIN="$work/out" GOFLAGS="-buildvcs=false -trimpath" CGO_ENABLED=0 GOTOOLCHAIN=local \
   "$go" install -ldflags "-s -w \
      -X helm.sh/helm/v3/internal/version.version=${HELM_VERSION} \
      -X helm.sh/helm/v3/internal/version.gitTreeState=clean" \
      "helm.sh/helm/v3/cmd/helm@${HELM_VERSION}" >&2) \
    || die "go install helm.sh/helm/v3/cmd/helm@${HELM_VERSION} failed"
  "$work/out/helm" version --short >/dev/null || die "the built helm does not run"
  rm -rf "$(dirname "$bin")"; mkdir -p "$(dirname "$bin")"
  mv "$work/out/helm" "$bin"
  log "built in $(( $(date +%s) - t0 ))s: $bin ($("$bin" version --short))"
  echo "$bin"
}

cmd_path() {
  local go bin
  go=$(find_go) || die "Go not found (PATH or /usr/local/go/bin)"
  bin=$(bin_path "$go")
  [ -x "$bin" ] || die "helm ${HELM_VERSION} not built: run $0 build"
  echo "$bin"
}

case "${1:-}" in
  build) cmd_build ;;
  path) cmd_path ;;
  *) die "usage: $0 build | path" ;;
esac
