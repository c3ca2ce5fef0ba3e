"""A running agent notices its state dir vanishing (statedir lane finding 1): /readyz
turns 503 naming the dir, one ERROR line, and 200 again when the same dir is back."""

from __future__ import annotations

import signal
import time
import urllib.error
import urllib.request

from tests.agent.test_run_signals import ROOT_ONLY, agent_argv, node_netns, start_agent

__all__ = ["node_netns"]  # the fixture, used by name


def _readyz(port: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except OSError as e:
        return 0, str(e)


def _wait(port: str, code: int, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    last: tuple[int, str] = (0, "")
    while time.monotonic() < deadline:
        last = _readyz(port)
        if last[0] == code:
            return last[1]
        time.sleep(0.2)
    raise AssertionError(f"/readyz never answered {code}: last {last}")


@ROOT_ONLY
def test_state_dir_moved_away_is_not_ready_then_ready_again(tmp_path, node_netns):
    state = tmp_path / "state"
    aside = tmp_path / "state-aside"
    argv, env = agent_argv(state, node_netns)
    proc = start_agent(argv, env, state)
    try:
        port = argv[argv.index("--health-port") + 1]
        _wait(port, 200)
        state.rename(aside)  # what rm -rf does to the agent, but restorable
        try:
            body = _wait(port, 503)
            assert "statedir" in body and str(state) in body, body
            time.sleep(2.5)  # several checks while gone: still one ERROR line
        finally:
            aside.rename(state)
        _wait(port, 200)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        errors = [ln for ln in out.splitlines() if "ERROR" in ln and str(state) in ln]
        assert len(errors) == 1, out
        assert "Traceback" not in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if aside.exists() and not state.exists():
            aside.rename(state)
