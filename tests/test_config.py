"""Configuration precedence, error messages and the config/version commands."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from agent.core import config as cfg, config_values


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
    assert config_values.parse_duration(text) == seconds


@pytest.mark.parametrize("flags,name", [({"status_port": "http"}, "status_port"),
                                        ({"status_port": "70000"}, "status_port"),
                                        ({"secret_ttl": "soon"}, "secret_ttl"),
                                        ({"log_format": "xml"}, "log_format"),
                                        ({"log_level": "loud"}, "log_level"),
                                        ({"host_probe_snat_ip": "1.2.3"}, "host_probe_snat_ip"),
                                        ({"secret_grace_ratio": "2"}, "secret_grace_ratio"),
                                        ({"sds_socket_mode": "999"}, "sds_socket_mode"),
                                        ({"ca_addr": "nohostport"}, "ca_addr"),
                                        ({"ca_cert_file": "/nonexistent"}, "ca_cert_file"),
                                        ({"ca_key_file": "/nonexistent"}, "ca_key_file"),
                                        ({"ca_root_cert": "/nonexistent"}, "ca_root_cert"),
                                        ({"ca_token_file": "/nonexistent"}, "ca_token_file"),
                                        ({"tokens_file": "/nonexistent"}, "tokens_file"),
                                        ({"xds_token_file": "/nonexistent"}, "xds_token_file"),
                                        ({"trust_anchors_file": "/tmp"}, "trust_anchors_file"),
                                        ({"xds_address": "999.1.1.1"}, "xds_address"),
                                        ({"xds_tls_address": "example.com"}, "xds_tls_address"),
                                        ({"ca_listen_address": "1.2.3"}, "ca_listen_address"),
                                        ({"status_address": "::g"}, "status_address"),
                                        ({"config_dir": "/etc/hostname"}, "config_dir"),
                                        ({"state_dir": "/etc/hostname"}, "state_dir"),
                                        ({"workload_certs_dir": "/etc/hostname"},
                                         "workload_certs_dir"),
                                        ({"proc_dir": "/etc/hostname"}, "proc_dir"),
                                        ({"exclude_namespaces": "ok,notjson["},
                                         "exclude_namespaces"),
                                        ({"exclude_namespaces": "Kube-System"},
                                         "exclude_namespaces"),
                                        ({"exclude_namespaces": ",,"},
                                         "exclude_namespaces"),
                                        ({"exclude_namespaces": "kube-system,,x"},
                                         "exclude_namespaces"),
                                        ({"exclude_namespaces": ["kube-system", ""]},
                                         "exclude_namespaces"),
                                        ({"system_namespace": "a_b"}, "system_namespace"),
                                        ({"pod_namespace": ""}, "pod_namespace"),
                                        ({"service_account": "Bad Name"}, "service_account"),
                                        ({"ca_trusted_node_accounts": "istio-system"},
                                         "ca_trusted_node_accounts"),
                                        ({"cluster_id": ""}, "cluster_id"),
                                        ({"cluster_id": "a/b"}, "cluster_id"),
                                        ({"trust_domain": ""}, "trust_domain"),
                                        ({"trust_domain": "spiffe://x"}, "trust_domain"),
                                        ({"node_name": " "}, "node_name"),
                                        ({"host_probe_snat_ip": "::1"}, "host_probe_snat_ip"),
                                        ({"host_probe_snat_ipv6": "169.254.7.127"},
                                         "host_probe_snat_ipv6"),
                                        ({"probe_source_ip": "::6"}, "probe_source_ip"),
                                        ({"probe_source_ipv6": "127.0.0.6"}, "probe_source_ipv6"),
                                        ({"instance_ip": "pod"}, "instance_ip"),
                                        ({"ecc_signature_algorithm": "DSA"},
                                         "ecc_signature_algorithm"),
                                        ({"secret_ttl": "0s"}, "secret_ttl"),
                                        ({"secret_ttl": "2m"}, "secret_ttl"),
                                        ({"cni_conf_name": "../x.conflist"}, "cni_conf_name"),
                                        ({"sds_socket": "/tmp/" + "s" * 110}, "sds_socket"),
                                        ({"kube_app_probers": '{"/x": {"httpGet": {"port": 80}}}'},
                                         "kube_app_probers"),
                                        ({"prometheus_annotations": '{"port": "http"}'},
                                         "prometheus_annotations"),
                                        ({"prometheus_annotations": "[1"},
                                         "prometheus_annotations")])
def test_bad_values_name_the_setting(flags, name):
    with pytest.raises(cfg.ConfigError) as e:
        cfg.load(flags, env={})
    assert e.value.setting == name
    assert name in str(e.value) and repr(next(iter(flags.values()))) in str(e.value)
    assert "\n" not in str(e.value)


REQUIRED_PATHS = ["state_dir", "config_dir", "ca_dir", "cni_event_socket", "cni_conf_dir",
                  "cni_bin_dir", "ztunnel_uds_address", "sds_socket", "admin_socket"]


@pytest.mark.parametrize("name", REQUIRED_PATHS)
def test_an_empty_required_path_is_refused_from_flag_env_and_file(tmp_path, name):
    """``--state-dir ''`` (or ``AMBIENT_AGENT_STATE_DIR=``) was read as "not set": the
    agent wrote its CA, mesh root and sockets into the working directory, then failed on
    "No such file or directory: ''" (newuser finding). An empty path the agent cannot do
    without is refused naming the setting and where the value came from; the settings
    whose empty value means "off" (mesh_root_file, workload_certs_dir, kubeconfig, ...)
    still take it."""
    setting = cfg.SETTINGS_BY_NAME[name]
    with pytest.raises(cfg.ConfigError, match=rf"{name}='' \(from flag {setting.flag}\): "
                                              r"must not be empty"):
        cfg.load({name: ""}, env={})
    with pytest.raises(cfg.ConfigError, match=rf"{name}='' \(from env {setting.env_name}\)"):
        cfg.load({}, env={setting.env_name: ""})
    f = tmp_path / "config.yaml"
    f.write_text(f"{name}: ''\n")
    with pytest.raises(cfg.ConfigError, match=rf"{name}=''.*must not be empty"):
        cfg.load({"config_file": str(f)}, env={})


def test_empty_paths_that_mean_off_are_accepted():
    c = cfg.load({"mesh_root_file": "", "workload_certs_dir": "", "kubeconfig": "",
                  "host_rules_netns": ""}, env={})
    assert (c.mesh_root_file, c.workload_certs_dir, c.kubeconfig) == ("", "", "")


def test_empty_lists_and_token_files(tmp_path):
    """An empty exclude list is the explicit "none"; an empty token file is refused at
    load naming the setting (every client was refused with no way to know why)."""
    assert cfg.load({"exclude_namespaces": ""}, env={}).exclude_namespaces == ()
    assert cfg.load({"exclude_namespaces": []}, env={}).exclude_namespaces == ()
    with pytest.raises(cfg.ConfigError, match="exclude_namespaces=',,'.*empty entry"):
        cfg.load({"exclude_namespaces": ",,"}, env={})
    token = tmp_path / "token"
    for text in ("", " \n"):
        token.write_text(text)
        with pytest.raises(cfg.ConfigError) as e:
            cfg.load({"xds_token_file": str(token)}, env={})
        assert e.value.setting == "xds_token_file" and "file is empty" in str(e.value)
    token.write_text("s3cret\n")
    assert cfg.load({"xds_token_file": str(token)}, env={}).xds_token_file == str(token)


def test_missing_file_error_reads_as_documented():
    with pytest.raises(cfg.ConfigError) as e:
        cfg.load({"ca_cert_file": "/nonexistent"}, env={})
    assert str(e.value) == ("invalid setting ca_cert_file='/nonexistent' "
                            "(from flag --ca-cert-file): no such file")
    with pytest.raises(cfg.ConfigError, match="'notjson\\[' is not a valid namespace"):
        cfg.load({}, env={"EXCLUDE_NAMESPACES": "kube-system,notjson["})


def test_good_values_are_accepted_and_normalised(tmp_path):
    cert, key = tmp_path / "root.pem", tmp_path / "key.pem"
    cert.write_text("x")
    key.write_text("x")
    key.chmod(0o600)
    c = cfg.load({"state_dir": str(tmp_path), "ca_cert_file": str(cert),
                  "ca_key_file": str(key), "xds_address": "localhost",
                  "xds_tls_address": "[::1]", "status_address": "", "ca_listen_address": "::",
                  "exclude_namespaces": "kube-system, istio-system",
                  "ca_trusted_node_accounts": "istio-system/ztunnel,kube-system/node.agent",
                  "probe_source_ipv6": "::1", "instance_ip": "10.0.0.7",
                  "ecc_signature_algorithm": "ECDSA", "workload_certs_dir": str(tmp_path / "no"),
                  "config_dir": str(tmp_path / "not-yet"), "trust_domain": "example.org",
                  "cluster_id": "Kubernetes", "xds_debounce": "1s", "xds_debounce_max": "1s"},
                 env={})
    assert (c.ca_cert_file, c.ca_key_file) == (str(cert), str(key))
    assert (c.xds_address, c.xds_tls_address, c.ca_listen_address) == ("127.0.0.1", "::1", "::")
    assert c.exclude_namespaces == ("kube-system", "istio-system")
    # files settings are empty (= not set) by default, so defaults load on any machine
    d = cfg.load({"state_dir": str(tmp_path)}, env={})
    assert d.ca_cert_file == d.ca_root_cert == d.xds_token_file == d.kubeconfig == ""


def test_cross_field_checks(tmp_path):
    cert = tmp_path / "root.pem"
    cert.write_text("x")
    with pytest.raises(cfg.ConfigError) as e:
        cfg.load({"ca_cert_file": str(cert)}, env={})
    assert e.value.setting == "ca_cert_file" and "ca_key_file must be set too" in str(e.value)
    with pytest.raises(cfg.ConfigError) as e:
        cfg.load({"xds_debounce": "2s"}, env={})
    assert e.value.setting == "xds_debounce" and "'2s'" in str(e.value)
    assert "xds_debounce_max" in str(e.value)
    with pytest.raises(cfg.ConfigError) as e:  # a default derived from a long state_dir
        cfg.load({"state_dir": str(tmp_path / ("d" * 100))}, env={})
    assert e.value.setting == "cni_event_socket" and "state_dir" in str(e.value)
    # kubeconfig is checked only when the kubernetes source will read it
    assert cfg.load({"kubeconfig": "/nonexistent"}, env={}).kubeconfig == "/nonexistent"
    with pytest.raises(cfg.ConfigError, match="kubeconfig='/nonexistent'.*no such file"):
        cfg.load({"kubeconfig": "/nonexistent", "config_source": "kubernetes"}, env={})


def test_port_check_blames_the_address_or_the_port():
    with pytest.raises(cfg.ConfigError) as e:
        cfg.ensure_tcp_port_free("xds_port", "192.0.2.1", 0)  # TEST-NET-1: not on this host
    assert e.value.setting == "xds_address" and "not an address of this host" in str(e.value)
    with pytest.raises(cfg.ConfigError) as e:
        cfg.ensure_tcp_port_free("ca_port", "nohost", 1234)
    assert e.value.setting == "ca_listen_address"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(cfg.ConfigError) as e:
            cfg.ensure_tcp_port_free("xds_port", "127.0.0.1", port)
    assert e.value.setting == "xds_port" and e.value.value == port
    cfg.ensure_tcp_port_free("xds_tls_port", "::1", 0)


def test_a_busy_port_at_start_names_its_origin_and_holder():
    """``run`` on a busy port said "Address already in use" without the setting's origin
    or who holds the port, which ``precheck`` names (newuser finding)."""
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = cfg.load({"status_port": str(port), "health_port": "0", "xds_port": "0",
                           "xds_tls_port": "0", "monitoring_port": "0"}, env={})
        with pytest.raises(cfg.ConfigError) as e:
            cfg.ensure_ports_free(config)
    assert e.value.setting == "status_port" and e.value.origin == "flag --status-port"
    assert f"(held by pid {os.getpid()} " in str(e.value), str(e.value)


def test_malformed_yaml_and_unknown_keys(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("status_port: [1\n")
    # with the parser's reason (it said only "at line 2")
    with pytest.raises(cfg.ConfigError, match="malformed YAML at line 2: .*expected"):
        cfg.load({"config_file": str(bad)}, env={})
    twice = tmp_path / "twice.yaml"
    twice.write_text("status_port: 1234\nlog_level: info\nstatus_port: 5678\n")
    with pytest.raises(cfg.ConfigError, match=r"line 3: key 'status_port' given twice "
                                              r"\(first at line 1\)"):
        cfg.load({"config_file": str(twice)}, env={})
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("no_such_setting: 1\n")
    with pytest.raises(cfg.ConfigError, match="no_such_setting"):
        cfg.load({"config_file": str(unknown)}, env={})
    wrong_type = tmp_path / "wrong.yaml"
    wrong_type.write_text("xds_port: {a: 1}\n")
    with pytest.raises(cfg.ConfigError, match="xds_port"):
        cfg.load({"config_file": str(wrong_type)}, env={})
    not_text = tmp_path / "latin1.yaml"
    not_text.write_bytes(b"\xff\xfestatus_port: 1\n")
    with pytest.raises(cfg.ConfigError, match="not UTF-8 text") as e:
        cfg.load({"config_file": str(not_text)}, env={})
    assert e.value.setting == "config_file"


@pytest.mark.parametrize("line,setting,reason", [
    ("node_name: on", "node_name", "the boolean true"),
    ("network: no", "network", "the boolean false"),
    ("cluster_id: 0777", "cluster_id", "the number 511"),
    ("repair_broken_pod_label_value: true", "repair_broken_pod_label_value", "boolean true"),
    ("sds_socket_mode: 0600", "sds_socket_mode", "the number 384: quote it"),
    ("sds_socket_mode: 666", "sds_socket_mode", "the number 666: quote it"),
    ("exclude_namespaces: [kube-system, off]", "exclude_namespaces", "the boolean false"),
    ("config_file: /etc/other.yaml", "config_file", "cannot name another one"),
])
def test_yaml_values_whose_text_yaml_changed_are_refused(tmp_path, line, setting, reason):
    """Newuser finding: unquoted YAML scalars reached string settings converted
    (``node_name: on`` ran as node "True", ``cluster_id: 0777`` as "511") and an unquoted
    ``sds_socket_mode: 666`` made the socket world-writable. Each is now refused, naming
    the setting and asking for quotes; quoted, the same values load."""
    f = tmp_path / "c.yaml"
    f.write_text(line + "\n")
    with pytest.raises(cfg.ConfigError) as e:
        cfg.load({"config_file": str(f)}, env={})
    assert e.value.setting == setting and reason in str(e.value), str(e.value)
    key, _, value = line.partition(": ")
    if key != "config_file" and not value.startswith("["):
        f.write_text(f"{key}: '{value}'\n")
        if key in ("node_name", "network", "cluster_id", "repair_broken_pod_label_value"):
            assert getattr(cfg.load({"config_file": str(f)}, env={}), key) == value


@pytest.mark.parametrize("flag,value,reason", [
    ("status_port", "abc", "expected a port number"),
    ("secret_grace_ratio", "half", "expected a number between 0 and 1"),
])
def test_non_numbers_are_named_in_words(flag, value, reason):
    """Python's "invalid literal for int() with base 10" is not a message for operators."""
    with pytest.raises(cfg.ConfigError, match=reason) as e:
        cfg.load({flag: value}, env={})
    assert e.value.setting == flag and "int()" not in str(e.value) and "float" not in str(e.value)


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
                 ["run", "--state-dir", str(tmp_path), "--xds-address", "999.1.1.1"],
                 ["run", "--state-dir", str(tmp_path), "--config-dir", "/etc/hostname"],
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


async def test_directory_source_names_config_dir_when_a_file_is_in_the_way(tmp_path):
    """Settings that pass ``load`` but turn bad before start (a file created at
    config_dir afterwards) still fail with the setting's name, not errno 17."""
    from prometheus_client import CollectorRegistry

    from ambient.source_files import DirectorySource
    from ambient.store import ObjectStore

    blocker = tmp_path / "cluster"
    blocker.write_text("")

    async def run_blocking(fn, *args):
        return fn(*args)

    source = DirectorySource(ObjectStore(CollectorRegistry()), str(blocker), run_blocking)
    with pytest.raises(cfg.ConfigError) as e:
        await source.start()
    assert e.value.setting == "config_dir" and "not a directory" in str(e.value)


async def test_embedded_ca_names_the_bad_root_file(tmp_path):
    from agent.core.lifecycle import AgentContext
    from agent.sds.server import build

    cert, key = tmp_path / "root.pem", tmp_path / "key.pem"
    cert.write_text("not a certificate")
    key.write_text("not a key")
    key.chmod(0o600)
    config = cfg.load({"state_dir": str(tmp_path / "state"), "ca_cert_file": str(cert),
                       "ca_key_file": str(key), "workload_certs_dir": str(tmp_path / "none")},
                      env={})
    ctx = AgentContext(config)
    try:
        with pytest.raises(RuntimeError, match=f"ca_cert_file='{cert}'"):
            await build(ctx, None, None).start()
    finally:
        ctx.executor.shutdown(wait=False)


def test_renamed_settings_and_ca_port_collision_are_clear_errors(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("ca_tokens_file: /etc/tokens.yaml\n")
    with pytest.raises(cfg.ConfigError, match="renamed to tokens_file"):
        cfg.load({"config_file": str(path)}, env={})
    with pytest.raises(cfg.ConfigError, match="ca_client_cert_auth.*removed"):
        cfg.load({}, env={"AMBIENT_AGENT_CA_CLIENT_CERT_AUTH": "true"})
    with pytest.raises(cfg.ConfigError) as e:
        cfg.load({"ca_port": "15012"}, env={})
    assert e.value.setting == "ca_port" and "collides with xds_tls_port" in str(e.value)
    assert cfg.load({"ca_port": "15013"}, env={}).ca_port == 15013
    d = cfg.load({"state_dir": str(tmp_path)}, env={})
    assert d.mesh_root_file == str(tmp_path / "mesh-root" / "root-cert.pem")
    assert d.token_audiences == ("istio-ca",) and d.tls_server_names == ()
    assert cfg.load({}, env={"ISTIOD_CUSTOM_HOST": "agent.example,10.0.0.5"}).tls_server_names \
        == ("agent.example", "10.0.0.5")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a check as another uid")
def test_unreachable_netns_file_says_eacces_not_missing():
    """As non-root, /proc/1/ns/net exists but can't be opened: the error says so (it
    said "no such network namespace file")."""
    code = ("from agent.core import config as cfg\n"
            "try:\n"
            "    cfg.load({'host_rules_netns': '/proc/1/ns/net'}, env={})\n"
            "except cfg.ConfigError as e:\n"
            "    print(e)\n")
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                          sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         timeout=60).stdout
    assert "host_rules_netns='/proc/1/ns/net'" in out and "EACCES" in out, out
    with pytest.raises(cfg.ConfigError, match="no such network namespace file"):
        cfg.load({"host_rules_netns": "/var/run/netns/nu-missing-xyz"}, env={})


def test_every_setting_answers_to_the_project_prefix_and_typos_are_refused(tmp_path):
    """``AMBIENT_AGENT_CNI_CONF_NAME`` (written so in docs/podman.md) and
    ``AMBIENT_AGENT_STATUS_PORT`` were ignored without a word: the settings' variables
    are Istio's ``CNI_CONF_NAME`` and ``STATUS_PORT``. Every setting now also answers to
    ``AMBIENT_AGENT_<NAME>``; both names set differently is refused; an unknown
    ``AMBIENT_AGENT_*`` variable is refused with the nearest real name (newuser
    finding), and an unknown config-file key gets the same hint."""
    c = cfg.load({}, env={"AMBIENT_AGENT_CNI_CONF_NAME": "mesh.conflist",
                          "AMBIENT_AGENT_STATUS_PORT": "31999"})
    assert (c.cni_conf_name, c.status_port) == ("mesh.conflist", 31999)
    assert c.origins["status_port"] == "env AMBIENT_AGENT_STATUS_PORT"
    same = cfg.load({}, env={"STATUS_PORT": "31999", "AMBIENT_AGENT_STATUS_PORT": "31999"})
    assert same.status_port == 31999 and same.origins["status_port"] == "env STATUS_PORT"
    with pytest.raises(cfg.ConfigError, match=r"set twice, differently: STATUS_PORT='2' and "
                                              r"AMBIENT_AGENT_STATUS_PORT='1'"):
        cfg.load({}, env={"STATUS_PORT": "2", "AMBIENT_AGENT_STATUS_PORT": "1"})
    # a flag still wins, and a bad alias it hides must still parse
    assert cfg.load({"status_port": "31998"},
                    env={"AMBIENT_AGENT_STATUS_PORT": "1"}).status_port == 31998
    with pytest.raises(cfg.ConfigError, match="overridden by flag --status-port"):
        cfg.load({"status_port": "31998"}, env={"AMBIENT_AGENT_STATUS_PORT": "x"})
    with pytest.raises(cfg.ConfigError) as e:
        cfg.load({}, env={"AMBIENT_AGENT_STATUS_PROT": "1"})
    assert str(e.value) == ("invalid setting status_prot='1' (from env "
                            "AMBIENT_AGENT_STATUS_PROT): no such setting (unknown environment "
                            "variable); did you mean AMBIENT_AGENT_STATUS_PORT?")
    with pytest.raises(cfg.ConfigError, match=r"no such setting \(unknown environment "
                                              r"variable\)$"):
        cfg.load({}, env={"AMBIENT_AGENT_XYZZY": "1"})
    # set by the agent on children it runs, not a setting: not refused
    assert cfg.load({}, env={"AMBIENT_AGENT_EVENTS_OWNER": "x"}).status_port == 15020
    # Istio's namespace is shared with other software: unknown names there are left alone
    assert cfg.load({}, env={"STATUS_PROT": "1"}).status_port == 15020
    f = tmp_path / "config.yaml"
    f.write_text("status_prot: 1\n")
    with pytest.raises(cfg.ConfigError, match="unknown setting in .*; did you mean status_port"):
        cfg.load({"config_file": str(f)}, env={})
