"""The istio-cni plugin, exec'd through the launcher the installer writes, against the real
CNI event server (tests/cni/conftest.py). Bad input must give the CNI spec's error code
and a message naming the field, and leave nothing behind."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from cni import plugin, plugin_request
from tests.cni.conftest import cni_env, net_conf, run_plugin, start_agent


async def test_add_enrolls_and_prints_prev_result_unchanged(cni_agent, launcher):
    conf = net_conf(cni_agent.run_dir, ambient_default=True)
    rc, out, err = await run_plugin(launcher, cni_env(), conf)
    assert rc == 0, (out, err)
    assert out == conf["prevResult"]
    [event] = cni_agent.enroller.enrolled
    assert (event.command, event.container_id, event.netns, event.ifname) == (
        "ADD", "c0ffee", "/var/run/netns/none", "eth0")
    assert (event.pod_namespace, event.pod_name, event.pod_uid) == ("demo", "web-0", "u-1")
    assert event.ips == ["10.9.8.7"] and event.ambient_default is True


async def test_add_not_ambient_without_pod_object_and_default(cni_agent, launcher):
    rc, out, _ = await run_plugin(launcher, cni_env(), net_conf(cni_agent.run_dir))
    assert rc == 0 and out["ips"][0]["address"] == "10.9.8.7/24"
    assert cni_agent.enroller.enrolled == []


@pytest.mark.parametrize("version, has_version_field", [
    ("0.3.0", True), ("0.3.1", True), ("0.4.0", True), ("1.0.0", False), ("1.1.0", False)])
async def test_result_converted_only_where_required(cni_agent, launcher, version,
                                                    has_version_field):
    conf = net_conf(cni_agent.run_dir, version=version)
    conf["prevResult"]["cniVersion"] = "1.0.0"  # a runtime that did not convert
    rc, out, _ = await run_plugin(launcher, cni_env(), conf)
    assert rc == 0 and out["cniVersion"] == version
    assert ("version" in out["ips"][0]) is has_version_field
    assert out["interfaces"] == conf["prevResult"]["interfaces"]


async def test_excluded_namespace_and_disabled_never_contact_agent(tmp_path, launcher):
    # no agent at all: a contact would fail with code 11
    run_dir = tmp_path / "nothing"
    for keys in ({"exclude_namespaces": ["demo"]}, {"ambient_enabled": False},
                 {"pod_namespace": "istio-system"}):
        env = cni_env(args="K8S_POD_NAMESPACE=istio-system;K8S_POD_NAME=istio-cni-node-x"
                      if "pod_namespace" in keys else cni_env()["CNI_ARGS"])
        rc, out, err = await run_plugin(launcher, env, net_conf(run_dir, **keys))
        assert rc == 0, (keys, out, err)


async def test_agent_enrollment_failure_fails_add_with_reason(cni_agent, launcher):
    cni_agent.enroller.fail_with = "no ztunnel connected within 30s"
    rc, out, _ = await run_plugin(launcher, cni_env(), net_conf(cni_agent.run_dir,
                                                                ambient_default=True))
    assert rc == 1 and out["code"] == plugin_request.ERR_AGENT_REFUSED
    assert "no ztunnel connected within 30s" in out["msg"] and "demo/web-0" in out["msg"]


async def test_no_enrollment_component_fails_ambient_add(state_dir, launcher):
    agent = await start_agent(state_dir, with_enroller=False)
    try:
        rc, out, _ = await run_plugin(launcher, cni_env(), net_conf(agent.run_dir,
                                                                    ambient_default=True))
        assert rc == 1 and "no enrollment component" in out["msg"]
        # a pod that is not ambient still starts
        rc, _, _ = await run_plugin(launcher, cni_env(), net_conf(agent.run_dir))
        assert rc == 0
    finally:
        await agent.server.stop(1)


async def test_agent_down_is_try_again_later(tmp_path, launcher):
    rc, out, _ = await run_plugin(launcher, cni_env(), net_conf(tmp_path / "run"))
    assert rc == 1 and out["code"] == plugin_request.ERR_TRY_AGAIN
    assert "pluginevent.sock" in out["msg"]


async def test_agent_slow_times_out_try_again_later(cni_agent, launcher):
    cni_agent.enroller.delay = 2.0
    rc, out, _ = await run_plugin(launcher, cni_env(), net_conf(
        cni_agent.run_dir, ambient_default=True, agent_timeout=0.3))
    assert rc == 1 and out["code"] == plugin_request.ERR_TRY_AGAIN and "0.3s" in out["msg"]
    # the enrollment the agent started still completes (a following DEL undoes it)
    await asyncio.sleep(2.2)
    assert len(cni_agent.enroller.enrolled) == 1


async def test_del_is_best_effort(cni_agent, launcher, tmp_path):
    conf = net_conf(cni_agent.run_dir)
    rc, out, _ = await run_plugin(launcher, cni_env("DEL"), conf)
    assert rc == 0 and out is None
    assert [e.command for e in cni_agent.enroller.unenrolled] == ["DEL"]
    # agent gone, netns gone, no prevResult: still success
    rc, out, err = await run_plugin(launcher, cni_env("DEL", netns=None),
                                    net_conf(tmp_path / "gone", prev=False))
    assert rc == 0 and out is None and "not reached" in err


async def test_status_reports_agent_availability(cni_agent, launcher, tmp_path):
    rc, out, _ = await run_plugin(launcher, cni_env("STATUS"),
                                  net_conf(cni_agent.run_dir, version="1.1.0", prev=False))
    assert rc == 0 and out is None
    rc, out, _ = await run_plugin(launcher, cni_env("STATUS"),
                                  net_conf(tmp_path / "gone", version="1.1.0", prev=False))
    assert rc == 1 and out["code"] == plugin_request.ERR_NOT_AVAILABLE
    rc, out, _ = await run_plugin(launcher, cni_env("STATUS"),
                                  net_conf(cni_agent.run_dir, version="1.0.0", prev=False))
    assert rc == 1 and out["code"] == plugin_request.ERR_INCOMPATIBLE_VERSION


async def test_version_and_check(launcher, tmp_path):
    rc, out, _ = await run_plugin(launcher, {"CNI_COMMAND": "VERSION"}, {"cniVersion": "0.4.0"})
    assert rc == 0 and out == {"cniVersion": "0.4.0",
                               "supportedVersions": list(plugin_request.SUPPORTED_VERSIONS)}
    rc, out, _ = await run_plugin(launcher, cni_env("CHECK"), net_conf(tmp_path, "0.4.0"))
    assert rc == 0 and out is None
    rc, out, _ = await run_plugin(launcher, cni_env("CHECK"), net_conf(tmp_path, "0.3.1"))
    assert rc == 1 and out["code"] == plugin_request.ERR_INCOMPATIBLE_VERSION


BAD_INPUT = [
    ("malformed JSON", cni_env(), '{"cniVersion": "1.0.0",', 6, "cannot decode network config"),
    ("not an object", cni_env(), "[1, 2]", 7, "must be a JSON object"),
    # the C scanner recurses per level: past the recursion limit it raises RecursionError
    ("deeply nested", cni_env(), "[" * 100000, 6, "nested too deeply"),
    ("deeply nested key", cni_env(), '{"cniVersion": "1.0.0", "exclude_namespaces": '
     + "[" * 5000 + "]" * 5000 + "}", 6, "nested too deeply"),
    ("deeply nested VERSION", cni_env("VERSION"), "[" * 100000, 6, "nested too deeply"),
    ("empty stdin", cni_env(), "", 6, "empty network config"),
    ("missing prevResult", cni_env(), net_conf("/run/x", prev=False), 7, "missing prevResult"),
    ("bad prevResult.ips", cni_env(), {**net_conf("/run/x"), "prevResult": {"ips": "10.0.0.1"}},
     7, "prevResult.ips"),
    ("unknown CNI_COMMAND", cni_env("FROB"), net_conf("/run/x"), 4, "invalid CNI_COMMAND 'FROB'"),
    ("missing CNI_COMMAND", cni_env(CNI_COMMAND=None), net_conf("/run/x"), 4, "CNI_COMMAND"),
    ("missing CNI_NETNS", cni_env(netns=None), net_conf("/run/x"), 4, "CNI_NETNS"),
    ("missing CNI_CONTAINERID", cni_env(container_id=None), net_conf("/run/x"), 4,
     "CNI_CONTAINERID"),
    ("bad CNI_IFNAME", cni_env(CNI_IFNAME="a/b"), net_conf("/run/x"), 4, "CNI_IFNAME"),
    ("bad CNI_ARGS", cni_env(args="K8S_POD_NAME"), net_conf("/run/x"), 4, "CNI_ARGS"),
    ("unsupported version", cni_env(), net_conf("/run/x", version="0.2.0"), 1,
     "incompatible CNI version '0.2.0'"),
    ("future version", cni_env(), net_conf("/run/x", version="2.0.0"), 1, "2.0.0"),
    ("no cniVersion", cni_env(), {"name": "n", "type": "istio-cni"}, 1, "cniVersion"),
    ("bad key type", cni_env(), net_conf("/run/x", ambient_enabled="yes"), 7,
     'ambient_enabled must be a boolean, got "yes"'),
    ("relative run dir", cni_env(), net_conf("run"), 7, "cni_agent_run_dir"),
    ("bad log level", cni_env(), net_conf("/run/x", plugin_log_level="loud"), 7,
     "plugin_log_level"),
    # 1e10 s overflowed the socket timeout (time_t): a traceback and no CNI error
    *((f"agent_timeout {t}", cni_env(), json.dumps(net_conf("/run/x", agent_timeout=1.5))
       .replace("1.5", t), 7, "agent_timeout must be > 0 and at most 3600 seconds")
      for t in ("0", "-1", "1e10", "1e400")),
]


@pytest.mark.parametrize("case, env, stdin, code, text", BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
async def test_bad_input_gives_cni_error(cni_agent, launcher, case, env, stdin, code, text):
    rc, out, err = await run_plugin(launcher, env, stdin)
    assert rc == 1, (out, err)
    assert out["code"] == code and text in out["msg"], out
    assert set(out) <= {"cniVersion", "code", "msg", "details"}
    assert "Traceback" not in err
    # nothing reached the agent, nothing left behind
    assert cni_agent.enroller.enrolled == [] and cni_agent.server.debug_state()["in_flight"] == {}


async def test_unknown_keys_ignored(cni_agent, launcher):
    conf = net_conf(cni_agent.run_dir, labSetting=1, kubernetes={"kubeconfig": "/x"},
                    enablement_selectors=[{}], native_nftables=False)
    rc, out, _ = await run_plugin(launcher, cni_env(), conf)
    assert rc == 0


def test_plugin_imports_only_stdlib_c_modules():
    """The shim's start-up cost: under -I -S it loads no pure-Python json/socket/http."""
    code = ("import sys; sys.path.insert(0, %r); before = set(sys.modules);"
            "import cni.plugin; print(sorted(set(sys.modules) - before))"
            % os.path.dirname(os.path.dirname(plugin.__file__)))
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True,
                         text=True, check=True).stdout
    loaded = eval(out)  # noqa: S307 - our own printed list
    assert not {"json", "socket", "http", "http.client", "re", "enum", "agent"} & set(loaded), loaded
