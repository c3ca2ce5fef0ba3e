#!/usr/bin/env bash
# System packages the agent, its tests and the demo use (Debian 12). Idempotent.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
pkgs=(iptables nftables iproute2 containernetworking-plugins podman runc busybox-static
      tcpdump wrk procps psmisc)
missing=()
for p in "${pkgs[@]}" prometheus; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -q || true
  # prometheus only for promtool: skip its recommends (no service is started).
  apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
