#!/usr/bin/env bash
# Build the agent's OCI image with podman, from Debian packages and PyPI wheels only (no
# registry pull): prints the image name (localhost/ambient-node-agent:<version>) as its
# last line. Run as root on Debian 12 (scripts/install-system-deps.sh installs podman,
# patchelf and python3.11). What it does and why: docs/deploy.md "The image".
#
#   bash scripts/build-image.sh            # build (cached parts reused)
#   AMBIENT_IMAGE_CACHE=/dir bash scripts/build-image.sh
#
# Two layers:
#  1. base, localhost/ambient-node-agent-base:<digest of the .deb set>: the run-time
#     packages (python3.11, iptables, nftables, iproute2 and what they depend on, without
#     dpkg/apt/perl/debconf) unpacked with dpkg-deb into a root, merged /usr, iptables'
#     alternatives links, stdlib bytecode; imported with `podman import`. Rebuilt only
#     when a package version changes.
#  2. the agent: its wheel and its dependencies' wheels (pip install --target, binary
#     wheels only), bytecode compiled, the standalone istio-cni build
#     (scripts/build-cni-plugin.py), the `ambient-agent` entry point.
# Cached between runs under $AMBIENT_IMAGE_CACHE (default /var/cache/ambient-agent-image):
# the .deb files, pip's wheel cache, and the base image in podman's storage.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CACHE=${AMBIENT_IMAGE_CACHE:-/var/cache/ambient-agent-image}
PY=/usr/bin/python3.11
version=$("$PY" -c 'import tomllib;print(tomllib.load(open("pyproject.toml","rb"))["project"]["version"])')
IMAGE=localhost/ambient-node-agent:$version
export DEBIAN_FRONTEND=noninteractive
started=$(date +%s)

# What the agent runs at run time; their Depends/Pre-Depends closure is installed.
RUNTIME_PKGS=(python3.11 iptables nftables iproute2 ca-certificates
              libstdc++6)  # libstdc++6: grpcio's manylinux wheel links it
# In the closure but only needed to install or configure packages, or by programs the
# agent never runs: left out (no maintainer script runs in this image).
EXCLUDE=(dpkg debconf cdebconf libdebian-installer4 libnewt0.52 libslang2 libtextwrap1
         perl perl-base perl-modules-5.36 libperl5.36 libgdbm-compat4 install-info tar
         mailcap mime-support debianutils openssl)

log() { echo "build-image: $*" >&2; }
need() { command -v "$1" >/dev/null || { log "$1 missing: run scripts/install-system-deps.sh"; exit 1; }; }
need podman; need dpkg-deb; need apt-get; need patchelf; [ -x "$PY" ] || need python3.11

mkdir -p "$CACHE/debs" "$CACHE/pip"
work=$(mktemp -d "${TMPDIR:-/tmp}/ambient-image.XXXXXX")
trap 'rm -rf "$work"' EXIT

# --- the package set: closure of RUNTIME_PKGS minus EXCLUDE, with exact versions ---
closure() {
  apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks \
    --no-replaces --no-enhances "${RUNTIME_PKGS[@]}" 2>/dev/null | grep -v '^ ' | grep -v '^<' | sort -u
}
if ! apt-cache show python3.11 >/dev/null 2>&1; then apt-get update -q >&2; fi
mapfile -t pkgs < <(closure | grep -vxF -f <(printf '%s\n' "${EXCLUDE[@]}"))
: > "$work/pkgset"
apt-cache policy "${pkgs[@]}" | awk '/^[^ ].*:$/ {p=substr($0, 1, length($0)-1)}
  /^  Candidate:/ {print p "=" $2}' | sed 's/:amd64=/=/; s/:arm64=/=/' > "$work/pkgset"
while IFS== read -r p v; do
  [ -n "$v" ] && [ "$v" != "(none)" ] || { log "no candidate version for $p"; exit 1; }
done < "$work/pkgset"
[ "$(wc -l < "$work/pkgset")" = "${#pkgs[@]}" ] || { log "apt-cache policy did not list every package"; exit 1; }
base_digest=$( (cat "$work/pkgset"; sed -n '/^# --- base layer/,/^# --- end base layer/p' "$0") | sha256sum | cut -c1-16)
BASE=localhost/ambient-node-agent-base:$base_digest

# --- base layer (cached in podman's storage) ---
if podman image exists "$BASE"; then
  log "base $BASE cached"
else
  log "base $BASE: ${#pkgs[@]} packages"
  # --- base layer
  (cd "$CACHE/debs" && for pv in $(cat "$work/pkgset"); do
     p=${pv%%=*}; v=${pv#*=}; f=$(ls "${p}_${v//:/%3a}_"*.deb 2>/dev/null | head -1 || true)
     [ -n "$f" ] || apt-get download -q "$pv" >&2
   done)
  rootfs=$work/rootfs
  mkdir -p "$rootfs/usr/bin" "$rootfs/usr/sbin" "$rootfs/usr/lib" "$rootfs/usr/lib64"
  for d in bin sbin lib lib64; do ln -s "usr/$d" "$rootfs/$d"; done
  for pv in $(cat "$work/pkgset"); do
    p=${pv%%=*}; v=${pv#*=}
    f=$(ls "$CACHE/debs/${p}_${v//:/%3a}_"*.deb | head -1)
    # unpack into a scratch dir, then merge into the root: a .deb's /lib, /bin, /sbin
    # land in /usr (merged /usr, as Debian 12 systems are)
    x=$work/x; rm -rf "$x"; mkdir "$x"; dpkg-deb -x "$f" "$x"
    for d in bin sbin lib lib64; do
      if [ -d "$x/$d" ] && [ ! -L "$x/$d" ]; then mkdir -p "$x/usr/$d"; cp -a "$x/$d/." "$x/usr/$d/"; rm -rf "${x:?}/$d"; fi
    done
    cp -a "$x/." "$rootfs/"
  done
  # what maintainer scripts would have done: iptables' alternatives (nft backend, the
  # Debian default; the agent detects the flavor in use), users, runtime dirs
  for t in iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore; do
    ln -sf "${t/tables/tables-nft}" "$rootfs/usr/sbin/$t" 2>/dev/null || true
  done
  for t in iptables ip6tables; do
    for s in "" -save -restore; do ln -sf "xtables-nft-multi" "$rootfs/usr/sbin/${t}-nft$s"; done
  done
  ln -sf python3.11 "$rootfs/usr/bin/python3"
  mkdir -p "$rootfs/etc" "$rootfs/tmp" "$rootfs/run" "$rootfs/var/lib" "$rootfs/root" "$rootfs/proc" "$rootfs/sys" "$rootfs/dev"
  chmod 1777 "$rootfs/tmp"; ln -sfn ../run "$rootfs/var/run"
  printf 'root:x:0:0:root:/root:/usr/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n' > "$rootfs/etc/passwd"
  printf 'root:x:0:\nnogroup:x:65534:\n' > "$rootfs/etc/group"
  printf 'hosts: files dns\n' > "$rootfs/etc/nsswitch.conf"
  # CA bundle as update-ca-certificates builds it (for an Istio CA over TLS)
  find "$rootfs/usr/share/ca-certificates" -name '*.crt' | sort | xargs cat > "$rootfs/etc/ssl/certs/ca-certificates.crt"
  # no docs, man pages, locales, lintian data: nothing at run time reads them
  rm -rf "$rootfs/usr/share/doc" "$rootfs/usr/share/man" "$rootfs/usr/share/info" \
         "$rootfs/usr/share/locale" "$rootfs/usr/share/lintian" "$rootfs/usr/share/bug" \
         "$rootfs/var/cache" "$rootfs/var/log"
  rm -rf "$rootfs/usr/lib/python3.11/test" "$rootfs/usr/lib/python3.11/idlelib" \
         "$rootfs/usr/lib/python3.11/ensurepip" "$rootfs/usr/lib/python3.11/lib2to3/tests" \
         "$rootfs/usr/lib/python3.11/tkinter" "$rootfs/usr/lib/python3.11/turtledemo"
  ldconfig -r "$rootfs"
  # stdlib bytecode, normally made by python3.11's postinst (py3compile)
  chroot "$rootfs" /usr/bin/python3.11 -m compileall -q --invalidation-mode unchecked-hash \
    /usr/lib/python3.11 >/dev/null
  tar --sort=name --numeric-owner --mtime=@0 -C "$rootfs" -cf "$work/base.tar" .
  podman import --quiet \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    "$work/base.tar" "$BASE" >/dev/null
  rm -rf "$rootfs" "$work/base.tar"
  # --- end base layer
fi

# --- agent layer ---
app=$work/app
mkdir -p "$app/usr/lib/python3/dist-packages" "$app/usr/local/bin" "$app/usr/lib/ambient-agent"
export PIP_CACHE_DIR=$CACHE/pip PIP_DISABLE_PIP_VERSION_CHECK=1
pyvenv=$CACHE/build-venv
[ -x "$pyvenv/bin/pip" ] || "$PY" -m venv "$pyvenv" >&2
"$pyvenv/bin/pip" wheel -q --no-deps -w "$work/wheel" "$ROOT" >&2
"$pyvenv/bin/pip" install -q --no-compile --only-binary=:all: --target "$app/usr/lib/python3/dist-packages" \
  "$work"/wheel/*.whl >&2
rm -rf "$app/usr/lib/python3/dist-packages/bin"
cat > "$app/usr/local/bin/ambient-agent" <<'EOF'
#!/usr/bin/python3.11 -I
import sys
from agent.cli import main
sys.exit(main())
EOF
chmod 0755 "$app/usr/local/bin/ambient-agent"
"$PY" "$ROOT/scripts/build-cni-plugin.py" --out "$app/usr/lib/ambient-agent/istio-cni" >&2
cat > "$work/Containerfile" <<EOF
FROM $BASE
COPY app/ /
RUN ["/usr/bin/python3.11", "-m", "compileall", "-q", "-j0", "--invalidation-mode", "unchecked-hash", "/usr/lib/python3/dist-packages"]
ENV AMBIENT_AGENT_CNI_PLUGIN_BUNDLE=/usr/lib/ambient-agent/istio-cni
LABEL org.opencontainers.image.title=ambient-node-agent org.opencontainers.image.version=$version
CMD ["ambient-agent", "run"]
EOF
podman build --quiet --pull=never --network=none -t "$IMAGE" -f "$work/Containerfile" "$work" >/dev/null
size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
log "built $IMAGE ($((size / 1024 / 1024)) MiB) in $(( $(date +%s) - started ))s"
echo "$IMAGE"
