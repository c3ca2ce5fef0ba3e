#!/usr/bin/env bash
# System packages the agent, its tests and the demo use (Debian 12). Idempotent.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
pkgs=(iptables nftables iproute2 containernetworking-plugins podman runc busybox-static
      python3.11-minimal libpython3.11-stdlib python3.11-venv patchelf util-linux  # istio-cni build, image
      tcpdump wrk procps psmisc
      curl openssl  # curl + openssl: scripts/kube-test-apiserver.sh (certificates, /readyz)
      containerd)  # the real node's runtime (tests/node/, scripts/kube-test-node.sh)
missing() {
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || echo "$p"
  done
}
need=($(missing "${pkgs[@]}"))
need_prom=($(missing prometheus))
if [ ${#need[@]} -gt 0 ] || [ ${#need_prom[@]} -gt 0 ]; then
  apt-get update -q || true
fi
# podman needs its recommends (conmon, netavark, slirp4netns, catatonit, ...).
[ ${#need[@]} -eq 0 ] || apt-get install -y -q "${need[@]}"
# prometheus only for promtool: skip its recommends; no service is started.
[ ${#need_prom[@]} -eq 0 ] || apt-get install -y -q --no-install-recommends prometheus
