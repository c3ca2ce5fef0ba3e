"""A state dir another user owns or may write is refused, and a symlink planted at the
lock file is refused, not followed (newuser finding 3: root overwrote a file of the
dir owner's choice with its PID)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.core import config as agent_config
from agent.core.config import ConfigError, prepare_state_dir
from agent.daemon import StateDirLock


def _config(state: Path):
    return agent_config.load({"state_dir": str(state)}, {})


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o1777])
def test_state_dir_writable_by_others_is_refused(tmp_path, mode):
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, mode)
    with pytest.raises(ConfigError, match=f"mode {mode & 0o7777:04o}") as e:
        prepare_state_dir(_config(state))
    assert str(state) in str(e.value) and "writable by" in str(e.value)


def test_state_dir_owned_by_another_user_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to chown a directory to another user")
    state = tmp_path / "state"
    state.mkdir(mode=0o711)
    os.chown(state, 65534, 65534)
    with pytest.raises(ConfigError, match="owned by .*65534") as e:
        prepare_state_dir(_config(state))
    assert str(state) in str(e.value) and "0711" in str(e.value)


def test_ca_dir_writable_by_others_is_refused(tmp_path):
    state = tmp_path / "state"
    (state / "ca").mkdir(parents=True)
    os.chmod(state, 0o711)
    os.chmod(state / "ca", 0o777)
    with pytest.raises(ConfigError, match="ca_dir"):
        prepare_state_dir(_config(state))


def test_documented_mode_0711_is_kept(tmp_path):
    state = tmp_path / "new-state"
    assert prepare_state_dir(_config(state)) == state
    assert state.stat().st_mode & 0o7777 == 0o711


def test_symlink_at_the_lock_file_is_refused_not_followed(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o711)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (state / "agent.lock").symlink_to(victim)
    missing = tmp_path / "would-be-created"
    with pytest.raises(ConfigError, match="symlink"):
        StateDirLock(state).acquire()
    assert victim.read_text() == "keep me"
    (state / "agent.lock").unlink()
    (state / "agent.lock").symlink_to(missing)
    with pytest.raises(ConfigError, match="symlink"):
        StateDirLock(state).acquire()
    assert not missing.exists()
