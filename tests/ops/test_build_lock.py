"""The Go-build scripts' lock: a caller that finds another build holding the lock says
so in one stderr line before it waits (a newuser finding: the README's test command sat
silent for 12 minutes in flock). The real helper of scripts/lib-go.sh against a lock held
by this test."""

from __future__ import annotations

import fcntl
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = ("helm-build", "istio-cni-test", "istiod-test", "kube-test-apiserver",
           "kube-test-node")


def _locker(lock: pathlib.Path) -> subprocess.Popen:
    script = (f'. "{ROOT}/scripts/lib-go.sh"; exec 9>"{lock}"; '
              'lock_build 9 "$LOCK" "the test peer"; echo locked')
    return subprocess.Popen(["bash", "-c", script], env={"LOCK": str(lock), "PATH": "/usr/bin:/bin"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_waiting_for_a_held_lock_is_announced_once(tmp_path):
    lock = tmp_path / ".lock"
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        proc = _locker(lock)
        try:
            line = proc.stderr.readline()  # printed before it blocks
            assert line == f"waiting for {lock} (another build of the test peer is running)\n"
            assert proc.poll() is None  # still waiting
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out == "locked\n" and err == "", (out, err)


def test_a_free_lock_is_taken_silently(tmp_path):
    proc = _locker(tmp_path / ".lock")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out == "locked\n" and err == ""


def test_every_build_script_takes_its_lock_through_the_helper():
    for name in SCRIPTS:
        text = (ROOT / "scripts" / f"{name}.sh").read_text()
        assert "lock_build 9 " in text, name
        assert not [line for line in text.splitlines() if line.strip().startswith("flock ")], name
