"""Configuration precedence, error messages and the config/version commands."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agent import config as cfg


def test_defaults_and_derived_paths(tmp_path):
    c = cfg.load({"state_dir": str(tmp_path)}, env={})
    assert c.status_port == 15020 and c.origins["status_port"] == "default"
    assert c.xds_port == 15010
    assert c.trust_domain == "cluster.local"
    assert c.ztunnel_uds_address == "/var/run/ztunnel/ztunnel.sock"
    assert c.config_dir == str(tmp_path / "cluster")
    assert c.sds_socket == str(tmp_path / "workload-spiffe-uds" / "socket")
    assert c.secret_ttl == 86400.0


def test_precedence_flag_env_file_default(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("status_port: 1111\nxds_port: 2222\ntrust_domain: file.td\nlog_format: json\n")
    env = {"AMBIENT_AGENT_CONFIG_FILE": str(f), "STATUS_PORT": "3333", "TRUST_DOMAIN": "env.td"}
    c = cfg.load({"status_port": "4444"}, env=env)
    assert (c.status_port, c.origins["status_port"]) == (4444, "flag --status-port")
    assert (c.trust_domain, c.origins["trust_domain"]) == ("env.td", "env TRUST_DOMAIN")
    assert (c.xds_port, c.origins["xds_port"]) == (2222, f"file {f}")
    assert c.log_format == "json"
    assert c.origins["health_port"] == "default"


@pytest.mark.parametrize("text,seconds", [("24h", 86400), ("1h30m", 5400), ("250ms", 0.25),
                                          ("90", 90), (12, 12)])
def test_durations(text, seconds):
    assert cfg.parse_duration(text) == seconds


@pytest.mark.parametrize("flags,name", [({"status_port": "http"}, "status_port"),
                                        ({"status_port": "70000"}, "status_port"),
                                        ({"secret_ttl": "soon"}, "secret_ttl"),
                                        ({"log_format": "xml"}, "log_format"),
                                        ({"log_level": "loud"}, "log_level"),
                                        ({"host_probe_snat_ip": "1.2.3"}, "host_probe_snat_ip"),
                                        ({"secret_grace_ratio": "2"}, "secret_grace_ratio"),
                                        ({"sds_socket_mode": "999"}, "sds_socket_mode"),
                                        ({"ca_addr": "nohostport"}, "ca_addr")])
def test_bad_values_name_the_setting(flags, name):
    with pytest.raises(cfg.ConfigError) as e:
        cfg.load(flags, env={})
    assert e.value.setting == name
    assert name in str(e.value) and repr(next(iter(flags.values()))) in str(e.value)


def test_malformed_yaml_and_unknown_keys(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("status_port: [1\n")
    with pytest.raises(cfg.ConfigError, match="malformed YAML"):
        cfg.load({"config_file": str(bad)}, env={})
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("no_such_setting: 1\n")
    with pytest.raises(cfg.ConfigError, match="no_such_setting"):
        cfg.load({"config_file": str(unknown)}, env={})
    wrong_type = tmp_path / "wrong.yaml"
    wrong_type.write_text("xds_port: {a: 1}\n")
    with pytest.raises(cfg.ConfigError, match="xds_port"):
        cfg.load({"config_file": str(wrong_type)}, env={})


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "agent.cli", *args], capture_output=True,
                          text=True, env=env, timeout=60)


def test_cli_config_shows_sources(tmp_path):
    r = _cli("config", "--state-dir", str(tmp_path), "--xds-port", "1234")
    assert r.returncode == 0, r.stderr
    assert "xds_port" in r.stdout and "1234  (flag --xds-port)" in r.stdout
    assert "status_port" in r.stdout and "15020  (default)" in r.stdout


def test_cli_user_errors_are_one_line(tmp_path):
    for args in (["config", "--status-port", "abc"], ["run", "--log-format", "xml"],
                 ["config", "--config-file", str(tmp_path / "missing.yaml")]):
        r = _cli(*args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = _cli("run", "--no-such-flag")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--no-such-flag" in r.stderr


def test_unwritable_state_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = _cli("run", "--state-dir", str(blocker / "sub"))
    assert r.returncode == 2 and "state_dir" in r.stderr and "Traceback" not in r.stderr


def test_version():
    r = _cli("version")
    assert r.returncode == 0 and r.stdout.startswith("ambient-agent ")
