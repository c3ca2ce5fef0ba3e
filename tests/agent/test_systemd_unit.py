"""systemd/ambient-agent.service: it verifies, and the agent starts under its hardening.

1. ``systemd-analyze verify`` on the unit (ExecStart's program pointed at this checkout's
   venv, everything else as shipped); skipped when systemd-analyze is missing.
2. The agent is started as systemd would start it on a fresh host, emulated in a private
   mount + network namespace (``unshare -m -n``): every mount read-only except the API
   file systems (``ProtectSystem=strict``), a fresh tmpfs on ``/run`` (so
   ``/var/run/ztunnel`` does not exist, as on a host that never ran ztunnel), a tmpfs
   on ``/tmp`` (``PrivateTmp``), the unit's ``RuntimeDirectory=`` and
   ``StateDirectory=`` entries created with their modes, ``ReadWritePaths=`` made
   writable, the capability bounding set and no-new-privs of the unit applied with
   ``setpriv``. The unit's settings are READ from the file, not restated here. The
   agent must report ``READY=1`` on ``NOTIFY_SOCKET`` (``Type=notify``), answer
   ``/readyz`` on its health port, serve ZDS at ``/var/run/ztunnel/ztunnel.sock``,
   keep its CA root and config dir under the state directory, and stop cleanly.

Not emulated: ``ProtectHome`` (this machine's interpreter lives under /root; the unit's
own venv is under /opt) and the syscall/namespace restrictions systemd adds. A checkout
under /tmp (CI clones) is bound back at its path after the private /tmp is mounted.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "systemd" / "ambient-agent.service"
VENV_AGENT = Path(sys.executable).parent / "ambient-agent"


def parse_unit(text: str) -> dict[str, list[str]]:
    """``{"Section.Key": [values in order]}`` of a unit file (comments and continuation
    lines handled as systemd.syntax(7) says)."""
    out: dict[str, list[str]] = {}
    section = ""
    pending = ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return out


def unit_settings() -> dict[str, list[str]]:
    return parse_unit(UNIT.read_text())


def one(settings: dict[str, list[str]], key: str) -> str:
    values = settings.get(key) or [""]
    return values[-1]


def exec_start_argv(settings) -> list[str]:
    """ExecStart with its program replaced by this checkout's venv entry point."""
    argv = shlex.split(one(settings, "Service.ExecStart"))
    assert argv[0].endswith("/ambient-agent"), argv
    return [str(VENV_AGENT), *argv[1:]]


def test_unit_declares_what_a_fresh_host_needs():
    s = unit_settings()
    runtime = " ".join(s.get("Service.RuntimeDirectory", [])).split()
    assert {"ambient-agent", "ztunnel"} <= set(runtime)
    assert "ambient-agent" in one(s, "Service.StateDirectory").split()
    argv = exec_start_argv(s)
    # sockets on the runtime dir; CA root and config dir on the persistent state dir
    assert argv[argv.index("--state-dir") + 1] == "/run/ambient-agent"
    assert argv[argv.index("--ca-dir") + 1].startswith("/var/lib/ambient-agent/")
    assert argv[argv.index("--config-dir") + 1].startswith("/var/lib/ambient-agent/")
    before = " ".join(s.get("Unit.Before", [])).split()
    for runtime_unit in ("podman.service", "containerd.service", "crio.service",
                         "docker.service"):
        assert runtime_unit in before
    assert one(s, "Service.Type") == "notify"
    assert one(s, "Install.WantedBy") == "multi-user.target"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_systemd_analyze_verify(tmp_path):
    text = UNIT.read_text().replace("/opt/ambient-agent/.venv/bin/ambient-agent",
                                    str(VENV_AGENT))
    unit = tmp_path / "ambient-agent.service"
    unit.write_text(text)
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                       text=True, timeout=60)
    # verify prints a line per problem (and exits non-zero on errors)
    problems = [ln for ln in (r.stdout + r.stderr).splitlines()
                if "ambient-agent.service" in ln]
    assert r.returncode == 0 and not problems, r.stdout + r.stderr


RUNNER = r"""
set -eu
mount --make-rprivate /
# ProtectSystem=strict: every mount read-only, API file systems excepted
awk '{print $5}' /proc/self/mountinfo | sort -u | while read -r mp; do
  case $mp in /proc|/proc/*|/sys|/sys/*|/dev|/dev/*) continue ;; esac
  mount -o remount,bind,ro "$mp" 2>/dev/null || true
done
mount -t tmpfs -o mode=0755 tmpfs /run
# PrivateTmp hides /tmp; a checkout that lives there (CI clones) is put back at its path
[ -z "$KEEP" ] || mount --bind "$KEEP" "$STASH"
mount -t tmpfs -o mode=1777 tmpfs /tmp
[ -z "$KEEP" ] || { mkdir -p "$KEEP"; mount --bind "$STASH" "$KEEP"; }
mount -t tmpfs -o mode=0755 tmpfs /var/lib
[ ! -e /var/run/ztunnel ] || { echo '{"error": "/var/run/ztunnel exists"}'; exit 3; }
# RuntimeDirectory= / StateDirectory=: created, then the only writable places there
for d in $RUNTIME_DIRS; do mkdir -m "$RUNTIME_MODE" "/run/$d"; mount --bind "/run/$d" "/run/$d"; done
for d in $STATE_DIRS; do mkdir -m "$STATE_MODE" "/var/lib/$d"; mount --bind "/var/lib/$d" "/var/lib/$d"; done
mount -o remount,bind,ro /run
mount -o remount,bind,ro /var/lib
for p in $RW_PATHS; do
  case $p in -*) p=${p#-}; [ -e "$p" ] || continue ;; esac
  mount --bind "$p" "$p"; mount -o remount,bind,rw "$p"
done
ip link set lo up
umask "$UMASK"
setpriv --bounding-set="$BOUNDING" --no-new-privs "$@" >"$LOG" 2>&1 &
agent=$!
ok=0
for i in $(seq 600); do
  if "$PY" -c 'import urllib.request,sys; sys.exit(0 if urllib.request.urlopen("http://127.0.0.1:8000/readyz", timeout=1).status == 200 else 1)' 2>/dev/null; then ok=1; break; fi
  kill -0 $agent 2>/dev/null || break
  sleep 0.1
done
zds=0; [ -S /var/run/ztunnel/ztunnel.sock ] && zds=1
ca=0; [ -f /var/lib/ambient-agent/ca/root-cert.pem ] && ca=1
cfg=0; [ -d /var/lib/ambient-agent/cluster ] && cfg=1
mode=$(stat -c %a /var/run/ztunnel/ztunnel.sock 2>/dev/null || echo none)
kill -TERM $agent 2>/dev/null || true
rc=0; wait $agent || rc=$?
echo "{\"ready\": $ok, \"zds\": $zds, \"ca\": $ca, \"config_dir\": $cfg, \"zds_mode\": \"$mode\", \"exit\": $rc}"
"""


def _caps(settings) -> str:
    caps = one(settings, "Service.CapabilityBoundingSet").split()
    return "-all," + ",".join("+" + c.lower().removeprefix("cap_") for c in caps)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mount and network namespaces)")
@pytest.mark.skipif(shutil.which("unshare") is None or shutil.which("setpriv") is None,
                    reason="needs util-linux unshare and setpriv")
def test_agent_starts_under_the_units_hardening(tmp_path):
    s = unit_settings()
    # NOTIFY_SOCKET must be reachable from inside: /tmp is replaced there and abstract
    # sockets belong to the network namespace, so it lives under /dev/shm (kept).
    notify_dir = Path("/dev/shm") / f"ambient-notify-{secrets.token_hex(4)}"
    notify_dir.mkdir(mode=0o700)
    (notify_dir / "keep").mkdir()
    notify_path = notify_dir / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify_path))
    sock.settimeout(0.5)
    log = Path("/dev/shm") / f"ambient-unit-log-{secrets.token_hex(4)}"
    env = {
        "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
        "NOTIFY_SOCKET": str(notify_path),
        "RUNTIME_DIRS": " ".join(s.get("Service.RuntimeDirectory", [])),
        "RUNTIME_MODE": one(s, "Service.RuntimeDirectoryMode") or "0755",
        "STATE_DIRS": " ".join(s.get("Service.StateDirectory", [])),
        "STATE_MODE": one(s, "Service.StateDirectoryMode") or "0755",
        "RW_PATHS": " ".join(s.get("Service.ReadWritePaths", [])),
        "UMASK": one(s, "Service.UMask") or "0022",
        "BOUNDING": _caps(s),
        "LOG": str(log),
        # the unit's venv is under /opt; this checkout may be under /tmp (PrivateTmp)
        "KEEP": str(ROOT) if str(ROOT).startswith("/tmp/") else "",
        "STASH": str(notify_dir / "keep"),
        "PY": sys.executable,
        # the agent's own logs: plain text, one line each
        "LOG_LEVEL": "info",
    }
    proc = subprocess.Popen(["unshare", "-m", "-n", "--propagation", "private", "sh", "-c",
                             RUNNER, "runner", *exec_start_argv(s)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    messages: list[str] = []
    try:
        while proc.poll() is None:
            try:
                messages.append(sock.recv(4096).decode())
            except TimeoutError:
                continue
        out, err = proc.communicate(timeout=60)
        try:
            while True:
                messages.append(sock.recv(4096).decode())
        except (TimeoutError, BlockingIOError):
            pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sock.close()
        shutil.rmtree(notify_dir, ignore_errors=True)
        agent_log = log.read_text() if log.exists() else ""
        log.unlink(missing_ok=True)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert lines, f"runner printed no result: rc={proc.returncode}\n{out}\n{err}\n{agent_log}"
    result = json.loads(lines[-1])
    assert result == {"ready": 1, "zds": 1, "ca": 1, "config_dir": 1, "zds_mode": "600",
                      "exit": 0}, f"{result}\n{agent_log}"
    assert "READY=1" in messages, (messages, agent_log)
    assert "STOPPING=1" in messages, (messages, agent_log)
    assert "Read-only file system" not in agent_log, agent_log
