"""Trust of the files and directories the agent reads settings, keys and certificates
from (agent.core.trusted): ``ca_key_file`` owned by another user, writable by
group/others or readable by others; ``ca_cert_file``/``ca_root_cert``/
``trust_anchors_file`` and ``--config-file`` owned by another user or writable by
group/others; a ``config_dir`` owned by another user or writable by group/others. Each is
refused at config time with one line naming path, owner and mode; the CA key and root
also when the embedded CA loads them (start). docs/sds.md, docs/operating.md."""

from __future__ import annotations

import os

import pytest
from cryptography.hazmat.primitives import serialization

from agent.core import config as cfg
from agent.sds import keys
from agent.sds.ca_embedded import CAError, EmbeddedCA, create_root

NOBODY = 65534


def _file(path, mode, uid=None, text="x"):
    path.write_text(text)
    os.chmod(path, mode)
    if uid is not None:
        os.chown(path, uid, -1)
    return path


def _need_root(uid):
    if uid is not None and os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")


def _root_files(tmp_path, cert_mode=0o644, key_mode=0o600):
    cert, key = create_root("cluster.local")
    cert_path, key_path = tmp_path / "root.pem", tmp_path / "root.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(keys.key_pem(key))
    os.chmod(cert_path, cert_mode)
    os.chmod(key_path, key_mode)
    return cert_path, key_path


@pytest.mark.parametrize("mode,uid,why", [
    (0o644, None, "is readable by others (mode 0644"),
    (0o604, None, "is readable by others (mode 0604"),
    (0o620, None, "is writable by group (mode 0620"),
    (0o666, None, "is writable by group and others (mode 0666"),
    (0o600, NOBODY, f"(uid {NOBODY}), not by the agent's"),
])
def test_config_refuses_untrusted_ca_key_file(tmp_path, mode, uid, why):
    _need_root(uid)
    cert = _file(tmp_path / "root.pem", 0o644)
    key = _file(tmp_path / "root.key", mode, uid)
    with pytest.raises(cfg.ConfigError) as e:
        cfg.load({"state_dir": str(tmp_path / "s"), "ca_cert_file": str(cert),
                  "ca_key_file": str(key)}, env={})
    msg = str(e.value)
    assert e.value.setting == "ca_key_file" and str(key) in msg and why in msg
    assert "owner" in msg or "owned by" in msg
    assert "signing key" in msg and "\n" not in msg


@pytest.mark.parametrize("setting", ["ca_cert_file", "ca_root_cert", "trust_anchors_file"])
@pytest.mark.parametrize("mode,uid,why", [
    (0o664, None, "is writable by group (mode 0664"),
    (0o646, None, "is writable by others (mode 0646"),
    (0o644, NOBODY, f"(uid {NOBODY}), not by the agent's"),
])
def test_config_refuses_untrusted_certificate_files(tmp_path, setting, mode, uid, why):
    _need_root(uid)
    cert = _file(tmp_path / "root.pem", mode, uid)
    flags = {"state_dir": str(tmp_path / "s"), setting: str(cert)}
    if setting == "ca_cert_file":
        flags["ca_key_file"] = str(_file(tmp_path / "root.key", 0o600))
    with pytest.raises(cfg.ConfigError) as e:
        cfg.load(flags, env={})
    assert e.value.setting == setting and str(cert) in str(e.value) and why in str(e.value)


def test_config_accepts_private_keys_and_public_certificates(tmp_path):
    cert = _file(tmp_path / "root.pem", 0o644)
    for mode in (0o600, 0o640, 0o400):
        key = _file(tmp_path / "root.key", mode)
        c = cfg.load({"state_dir": str(tmp_path / "s"), "ca_cert_file": str(cert),
                      "ca_key_file": str(key)}, env={})
        assert c.ca_key_file == str(key)


def test_symlinked_key_is_judged_by_its_target(tmp_path):
    cert = _file(tmp_path / "root.pem", 0o644)
    key = _file(tmp_path / "root.key", 0o644)
    link = tmp_path / "link.key"
    link.symlink_to(key)
    flags = {"state_dir": str(tmp_path / "s"), "ca_cert_file": str(cert),
             "ca_key_file": str(link)}
    with pytest.raises(cfg.ConfigError, match="readable by others"):
        cfg.load(flags, env={})
    os.chmod(key, 0o600)
    assert cfg.load(flags, env={}).ca_key_file == str(link)


@pytest.mark.parametrize("key_mode,cert_mode,why", [
    (0o644, 0o644, "readable by others (mode 0644"),
    (0o660, 0o644, "writable by group (mode 0660"),
    (0o600, 0o666, "writable by group and others (mode 0666"),
])
def test_embedded_ca_load_refuses_untrusted_files(tmp_path, key_mode, cert_mode, why):
    # the start-time check: judged on the opened file (a mode changed after config time)
    cert_path, key_path = _root_files(tmp_path, cert_mode, key_mode)
    with pytest.raises(CAError) as e:
        EmbeddedCA.load_or_create(tmp_path / "unused", "cluster.local", str(cert_path),
                                  str(key_path))
    named = key_path if key_mode != 0o600 else cert_path
    assert str(named) in str(e.value) and why in str(e.value)
    assert b"PRIVATE" not in str(e.value).encode()


def test_embedded_ca_load_accepts_owner_only_key(tmp_path):
    cert_path, key_path = _root_files(tmp_path)
    ca = EmbeddedCA.load_or_create(tmp_path / "unused", "cluster.local", str(cert_path),
                                   str(key_path))
    assert ca.cert.subject


@pytest.mark.parametrize("mode,uid,why", [
    (0o666, None, "is writable by group and others (mode 0666"),
    (0o646, None, "is writable by others (mode 0646"),
    (0o644, NOBODY, f"(uid {NOBODY}), not by the agent's"),
])
def test_config_file_refused_when_others_may_write_it(tmp_path, mode, uid, why):
    _need_root(uid)
    path = _file(tmp_path / "config.yaml", mode, uid, "log_level: debug\n")
    with pytest.raises(cfg.ConfigError) as e:
        cfg.load({"config_file": str(path), "state_dir": str(tmp_path / "s")}, env={})
    msg = str(e.value)
    assert e.value.setting == "config_file" and str(path) in msg and why in msg
    assert "\n" not in msg


def test_config_file_readable_by_all_is_accepted(tmp_path):
    path = _file(tmp_path / "config.yaml", 0o644, None, "log_level: debug\n")
    assert cfg.load({"config_file": str(path), "state_dir": str(tmp_path / "s")},
                    env={}).log_level == "debug"


@pytest.mark.parametrize("mode,uid,why", [
    (0o777, None, "is writable by group and others (mode 0777"),
    (0o775, None, "is writable by group (mode 0775"),
    (0o755, NOBODY, f"(uid {NOBODY}), not by the agent's"),
])
def test_config_dir_refused_when_others_may_write_it(tmp_path, mode, uid, why):
    _need_root(uid)
    d = tmp_path / "cluster"
    d.mkdir()
    os.chmod(d, mode)
    if uid is not None:
        os.chown(d, uid, -1)
    with pytest.raises(cfg.ConfigError) as e:
        cfg.load({"config_source": "files", "config_dir": str(d),
                  "state_dir": str(tmp_path / "s")}, env={})
    msg = str(e.value)
    assert e.value.setting == "config_dir" and str(d) in msg and why in msg


def test_config_dir_judged_itself_not_its_parents(tmp_path):
    # a world-writable sticky parent (as /tmp) does not count; the dir itself 0755 is fine
    parent = tmp_path / "sticky"
    parent.mkdir()
    os.chmod(parent, 0o1777)
    d = parent / "cluster"
    d.mkdir()
    os.chmod(d, 0o755)
    c = cfg.load({"config_source": "files", "config_dir": str(d),
                  "state_dir": str(tmp_path / "s")}, env={})
    assert c.config_dir.rstrip("/") == str(d)


def test_config_file_dev_null_means_no_file(tmp_path):
    # /dev/null is 0666 but every read is empty: "no config file", as before
    assert cfg.load({"config_file": os.devnull, "state_dir": str(tmp_path / "s")},
                    env={}).config_file == os.devnull


@pytest.mark.parametrize("setting", ["ca_token_file", "xds_token_file"])
@pytest.mark.parametrize("mode,uid,why", [
    (0o664, None, "is writable by group (mode 0664"),
    (0o646, None, "is writable by others (mode 0646"),
    (0o644, NOBODY, f"(uid {NOBODY}), not by the agent's"),
])
def test_config_refuses_token_files_another_user_can_write(tmp_path, setting, mode, uid, why):
    """A token file a foreign user owns or anybody else may write lets them choose the
    agent's credential to the CA, or the token xDS clients must present."""
    _need_root(uid)
    token = _file(tmp_path / "token", mode, uid, text="tok3n-s3cret")
    with pytest.raises(cfg.ConfigError) as e:
        cfg.load({"state_dir": str(tmp_path / "s"), setting: str(token)}, env={})
    assert e.value.setting == setting and str(token) in str(e.value) and why in str(e.value)
    assert "\n" not in str(e.value) and "tok3n-s3cret" not in str(e.value), str(e.value)


@pytest.mark.parametrize("setting", ["ca_token_file", "xds_token_file"])
def test_projected_token_files_as_kubernetes_mounts_them_are_accepted(tmp_path, setting):
    """Kubernetes projects a service account token as ``token -> ..data/token``, the
    target 0644 (or 0600) and owned by root or the pod's user: readable by others is
    fine for a token file, unlike a key."""
    data = tmp_path / "..2026_12_02" / "token"
    data.parent.mkdir()
    for mode in (0o644, 0o600, 0o640):
        _file(data, mode, text="a-token")
        link = tmp_path / "token"
        link.unlink(missing_ok=True)
        link.symlink_to(data)
        c = cfg.load({"state_dir": str(tmp_path / "s"), setting: str(link)}, env={})
        assert getattr(c, setting) == str(link)
