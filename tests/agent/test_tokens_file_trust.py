"""tokens_file trust (agent.core.trusted.secret_file_problem): a file another user owns,
or that group/others may write, or others may read, is refused at config time (one
ConfigError naming path, owner and mode) and at reload (previous tokens kept, one WARN);
a symlink counts by its target. docs/xds.md."""

from __future__ import annotations

import logging
import os

import pytest

from agent.core import config as cfg
from agent.tlsport.authn import AuthnComponent, Authenticator, TokensFile

TOKEN = "tok-9f3c2a-secret"
NOBODY = 65534


def _tokens(tmp_path, mode=0o600, uid=None, text=f"{TOKEN}: shop/cart\n"):
    path = tmp_path / "tokens.yaml"
    path.write_text(text)
    os.chmod(path, mode)
    if uid is not None:
        os.chown(path, uid, -1)
    return path


@pytest.mark.parametrize("mode,uid,why", [
    (0o620, None, "writable by group (mode 0620"),
    (0o602, None, "writable by others (mode 0602"),
    (0o604, None, "readable by others (mode 0604"),
    (0o644, None, "readable by others (mode 0644"),
    (0o600, NOBODY, f"(uid {NOBODY}), not by the agent's"),
])
def test_config_refuses_untrusted_tokens_file(tmp_path, mode, uid, why):
    if uid is not None and os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    path = _tokens(tmp_path, mode, uid)
    with pytest.raises(cfg.ConfigError) as e:
        cfg.load({"tokens_file": str(path)}, env={})
    assert e.value.setting == "tokens_file" and str(path) in str(e.value)
    assert why in str(e.value)
    assert "\n" not in str(e.value) and TOKEN not in str(e.value)


def test_config_accepts_owner_only_and_group_readable(tmp_path):
    for mode in (0o600, 0o400, 0o640):
        path = _tokens(tmp_path, mode)
        assert cfg.load({"tokens_file": str(path)}, env={}).tokens_file == str(path)


def test_symlink_is_judged_by_its_target(tmp_path):
    target = _tokens(tmp_path, 0o644)
    link = tmp_path / "link.yaml"
    link.symlink_to(target)
    with pytest.raises(cfg.ConfigError, match="readable by others"):
        cfg.load({"tokens_file": str(link)}, env={})
    os.chmod(target, 0o600)
    assert cfg.load({"tokens_file": str(link)}, env={}).tokens_file == str(link)


async def test_start_refuses_untrusted_file(tmp_path):
    path = _tokens(tmp_path, 0o666)
    component = AuthnComponent(Authenticator("cluster.local",
                                             TokensFile(str(path), "cluster.local")))
    with pytest.raises(cfg.ConfigError) as e:
        await component.start()
    assert e.value.setting == "tokens_file" and "writable by group and others" in str(e.value)


def test_reload_keeps_previous_tokens_and_warns_once(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="agent.tlsport.authn")
    path = _tokens(tmp_path)
    tf = TokensFile(str(path), "cluster.local")
    assert tf.lookup(TOKEN).service_account == "cart"
    # another writer's token planted with a world-writable mode: not taken
    path.write_text(f"{TOKEN}: shop/cart\nplanted: istio-system/ztunnel\n")
    os.chmod(path, 0o666)
    os.utime(path, (5, 5))
    for _ in range(3):
        assert tf.lookup("planted") is None
        assert tf.lookup(TOKEN).service_account == "cart"
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 1 and str(path) in lines[0] and "mode 0666" in lines[0]
    assert "previous tokens" in lines[0] and TOKEN not in caplog.text
    os.chmod(path, 0o600)
    os.utime(path, (6, 6))
    assert tf.lookup("planted").service_account == "ztunnel"
