"""Issue 27, "what failed as written": settings that were accepted silently or failed late
or raw now fail ``load`` with one line naming the setting, the value and the reason."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agent.core import config as cfg


def _load(tmp_path, flags=None, env=None):
    return cfg.load({"state_dir": str(tmp_path / "state"), "config_file": "/dev/null",
                     **(flags or {})}, env=env or {})


@pytest.mark.parametrize("setting, value, reason", [
    ("shutdown_grace", "nan", "finite"),
    ("shutdown_grace", "inf", "finite"),
    ("ztunnel_wait", "NaN", "finite"),
    ("secret_ttl", "100d", "at most 90d"),
    ("podman_containers_conf", "/nonexistent/containers.conf", "no such file"),
    ("host_rules_netns", "/var/run/netns/ops-no-such-netns", "no such network namespace"),
])
def test_bad_value_named(tmp_path, setting, value, reason):
    with pytest.raises(cfg.ConfigError, match=reason) as e:
        _load(tmp_path, {setting: value})
    assert e.value.setting == setting and e.value.value == value


def test_secret_ttl_bound_inclusive(tmp_path):
    assert _load(tmp_path, {"secret_ttl": "90d"}).secret_ttl == 90 * 86400


def test_overridden_bad_env_and_file_values_are_errors(tmp_path):
    with pytest.raises(cfg.ConfigError, match="overridden by flag --secret-ttl") as e:
        _load(tmp_path, {"secret_ttl": "1h"}, env={"SECRET_TTL": "garbage"})
    assert e.value.setting == "secret_ttl" and e.value.origin == "env SECRET_TTL"
    conf = tmp_path / "config.yaml"
    conf.write_text("status_port: not-a-port\n")
    with pytest.raises(cfg.ConfigError, match="overridden by env STATUS_PORT") as e:
        cfg.load({"state_dir": str(tmp_path), "config_file": str(conf)},
                 env={"STATUS_PORT": "15999"})
    assert e.value.setting == "status_port" and e.value.origin == f"file {conf}"
    # good values in every source: the highest wins, as before
    conf.write_text("status_port: 15998\n")
    c = cfg.load({"state_dir": str(tmp_path), "config_file": str(conf), "status_port": "15997"},
                 env={"STATUS_PORT": "15999"})
    assert c.status_port == 15997 and c.origins["status_port"] == "flag --status-port"


def test_config_dir_typo_is_refused_not_created(tmp_path):
    typo = tmp_path / "ambient-agnet" / "cluster"
    with pytest.raises(cfg.ConfigError, match="parent directory .* does not exist") as e:
        _load(tmp_path, {"config_dir": str(typo)})
    assert e.value.setting == "config_dir"
    assert not typo.parent.exists()
    # under the state dir (created by the agent) it need not exist yet
    assert _load(tmp_path, {"config_dir": str(tmp_path / "state" / "a" / "cluster")})
    # the last component alone is still created by the files source, as documented
    assert _load(tmp_path, {"config_dir": str(tmp_path / "cluster")}).config_dir


@pytest.mark.parametrize("flags, setting", [
    ({"status_port": "15999", "health_port": "15999"}, "health_port"),
    ({"monitoring_port": "15020"}, "monitoring_port"),
    ({"xds_port": "15020", "xds_address": "127.0.0.1"}, "xds_port"),
])
def test_two_listeners_on_one_port(tmp_path, flags, setting):
    with pytest.raises(cfg.ConfigError, match="two listeners cannot share a port") as e:
        _load(tmp_path, flags)
    assert e.value.setting == setting


def test_one_port_on_two_distinct_addresses_is_fine(tmp_path):
    c = _load(tmp_path, {"xds_port": "15999", "xds_address": "127.0.0.1",
                         "ca_port": "15999", "ca_listen_address": "127.0.0.2"})
    assert c.xds_port == c.ca_port == 15999


@pytest.mark.parametrize("text, reason", [
    ("apiVersion: v1\nclusters: [\n  - name: x\n", "malformed YAML at line"),
    ("- just\n- a list\n", "top level must be a mapping"),
    ("apiVersion: v1\nkind: Config\n", "no clusters"),
])
def test_malformed_kubeconfig_is_one_line(tmp_path, text, reason):
    kc = tmp_path / "kubeconfig"
    kc.write_text(text)
    with pytest.raises(cfg.ConfigError, match=reason) as e:
        _load(tmp_path, {"config_source": "kubernetes", "kubeconfig": str(kc)})
    assert e.value.setting == "kubeconfig" and "\n" not in str(e.value)


def test_non_pem_trust_anchors(tmp_path):
    bad = tmp_path / "anchors.pem"
    bad.write_text("not a certificate\n")
    with pytest.raises(cfg.ConfigError, match="no PEM certificate") as e:
        _load(tmp_path, {"trust_anchors_file": str(bad)})
    assert e.value.setting == "trust_anchors_file"
    bad.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    with pytest.raises(cfg.ConfigError, match="does not parse"):
        _load(tmp_path, {"trust_anchors_file": str(bad)})


def test_status_address_refused_is_named_once(tmp_path):
    c = _load(tmp_path, {"status_address": "192.0.2.77"})  # TEST-NET-1: on no host
    with pytest.raises(cfg.ConfigError) as e:
        cfg.ensure_ports_free(c)
    assert e.value.setting == "status_address"
    assert str(e.value).count("status_address") == 1, str(e.value)


def test_cli_lines(tmp_path):
    for args in (["--shutdown-grace", "nan"], ["--secret-ttl", "100d"],
                 ["--status-port", "15999", "--health-port", "15999"]):
        r = subprocess.run([sys.executable, "-m", "agent.cli", "config", "--config-file",
                            "/dev/null", *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (args, r.stdout)
        assert len(r.stderr.strip().splitlines()) == 1 and args[0].lstrip("-").replace(
            "-", "_") in r.stderr
