"""Issue 27, "what failed as written": the documented steps checked against what they
describe (podman's address ranges, the unit's flags and paths, the plugin's exit codes,
the tools the install script installs)."""

from __future__ import annotations

import ipaddress
import json
import re
import subprocess
import sys
from pathlib import Path

from agent.core.config import SETTINGS
from tests.agent.test_systemd_unit import parse_unit

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

# podman's default network, and containers.conf's default_subnet_pools (10.89.0.0/16,
# 10.90.0.0/15, 10.92.0.0/14, 10.96.0.0/11, 10.128.0.0/9) from which networks created
# without --subnet are given /24s.
PODMAN_RANGES = [ipaddress.ip_network(n) for n in (
    "10.88.0.0/16", "10.89.0.0/16", "10.90.0.0/15", "10.92.0.0/14", "10.96.0.0/11",
    "10.128.0.0/9")]


def test_podman_doc_subnets_avoid_podmans_ranges():
    text = (DOCS / "podman.md").read_text()
    subnets = re.findall(r"podman network create[^\n]*--subnet\s+(\S+)", text)
    assert subnets, "docs/podman.md creates no network with --subnet"
    for subnet in subnets:
        net = ipaddress.ip_network(subnet)
        clash = [str(r) for r in PODMAN_RANGES if net.overlaps(r)]
        assert not clash, f"{subnet} overlaps podman's {clash}"


def test_podman_doc_creates_namespaces_and_a_long_lived_token():
    section = (DOCS / "podman.md").read_text().split("## 6.")[1].split("\n## ")[0]
    assert "kubectl create namespace" in section
    assert "kubernetes.io/service-account-token" in section


def _env_to_setting():
    return {s.env_name: s for s in SETTINGS}


def test_env_example_sets_nothing_the_unit_overrides():
    unit = parse_unit((ROOT / "systemd" / "ambient-agent.service").read_text())
    exec_start = " ".join(unit["Service.ExecStart"])
    by_env = _env_to_setting()
    example = (ROOT / "systemd" / "ambient-agent.env.example").read_text()
    names = re.findall(r"^#?([A-Z][A-Z0-9_]+)=", example, re.M)
    assert names
    for name in names:
        setting = by_env.get(name)
        assert setting is not None, f"{name} in the env example is no setting's variable"
        assert setting.flag not in exec_start.split(), (
            f"{name} in the env example is overridden by ExecStart's {setting.flag}")


def test_unit_grants_podman_its_storage():
    unit = parse_unit((ROOT / "systemd" / "ambient-agent.service").read_text())
    assert unit["Service.ProtectSystem"] == ["strict"]
    writable = " ".join(unit["Service.ReadWritePaths"]).split()
    for path in ("/var/lib/containers", "/run/containers", "/run/libpod"):
        assert "-" + path in writable or path in writable, path


def test_del_exit_codes_as_documented(tmp_path):
    """cni.md: DEL exits 0 with the agent away, and 1 with a CNI error when it cannot
    read its input (the real plugin, executed as a runtime does)."""
    text = (DOCS / "cni.md").read_text()
    assert "always exit 0" not in text
    conf = json.dumps({"cniVersion": "1.0.0", "name": "n", "type": "istio-cni",
                       "cni_agent_run_dir": str(tmp_path)})
    base = {"PATH": "/usr/bin:/bin", "CNI_COMMAND": "DEL", "CNI_CONTAINERID": "c0ffee",
            "CNI_NETNS": "/var/run/netns/none", "CNI_IFNAME": "eth0",
            "CNI_PATH": "/usr/lib/cni", "CNI_ARGS": "K8S_POD_NAMESPACE=d;K8S_POD_NAME=p"}

    def run(env, stdin):
        return subprocess.run([sys.executable, "-m", "cni.plugin"], input=stdin, env=env,
                              capture_output=True, text=True, timeout=60, cwd=ROOT)

    r = run(base, conf)  # no agent at cni_agent_run_dir: best effort
    assert r.returncode == 0, r.stdout + r.stderr
    r = run({k: v for k, v in base.items() if k != "CNI_CONTAINERID"}, conf)
    assert r.returncode == 1 and json.loads(r.stdout)["code"] == 4
    r = run(base, "{not json")
    assert r.returncode == 1 and json.loads(r.stdout)["code"] == 6


def test_operating_doc_uses_no_ipset_tool():
    deps = (ROOT / "scripts" / "install-system-deps.sh").read_text()
    assert not re.search(r"\bipset\b", deps)  # the tool is not installed
    text = (DOCS / "operating.md").read_text()
    commands = re.findall(r"`(ipset [^`]*)`", text) + re.findall(r"^\s+ipset .*", text, re.M)
    assert not commands, commands
