"""The local-config format parsed exactly as ztunnel's loader parses it.

ztunnel reads ``LOCAL_XDS_PATH`` with serde_yaml 0.9 into its ``LocalConfig`` (src/xds.rs:
``LocalConfig`` and ``LocalWorkload`` with ``deny_unknown_fields``, the workload's fields
flattened in from ``Workload``, src/state/workload.rs; ``Service``, src/state/service.rs;
``Authorization``/``RbacMatch``/``StringMatch``, src/rbac.rs). The cases below are written
from those definitions and serde_yaml's enum rules (an enum is read only from a YAML tag,
or a unit variant from a plain scalar naming it; a one-key mapping is refused). A
workload's own fields are read through serde's ``flatten`` buffer, which refuses a tag
anywhere in them (``protocol: !HBONE``), while a policy's ``action: !Allow`` is read
directly and accepted.

With ``AMBIENT_TEST_ZTUNNEL`` naming a real ztunnel binary, the same files are given to it
(``LOCAL_XDS_PATH``, in a private network namespace) and it must accept exactly what we
accept: it logs "local config initialized" for a file it loaded and exits with an error
for one it refused. Without it (or without root for the namespace) that test skips.

One deliberate difference, kept and tested here: an unknown key inside a policy *match*
(``RbacMatch`` has no ``deny_unknown_fields``, so ztunnel drops it silently and the match
widens) is refused by us; the real-binary test skips that row.
"""

from __future__ import annotations

import logging
import os
import subprocess
import textwrap
import time

import pytest

from ambient import workload_pb2 as wl
from ambient.source_files import parse_file

ZTUNNEL = os.environ.get("AMBIENT_TEST_ZTUNNEL", "")

WORKLOAD = """\
workloads:
- uid: cluster1//Pod/default/local
  name: local
  namespace: default
  workloadIps: ["127.0.0.1"]
  services: {{"default/example.com": {{80: 8080}}}}
{extra}"""

SERVICE = """\
services:
- name: local
  namespace: default
  hostname: example.com
  vips: ["/127.10.0.1"]
  ports: {{80: 8080}}
{extra}"""

POLICY = """\
policies:
- name: p
  namespace: default
  scope: Namespace
  action: Allow
  dryRun: false
  rules:
  - - - {match}
"""

# (case id, file text, accepted, the field an error names)
CASES = [
    ("stringmatch-tag", POLICY.format(match="namespaces: [!Exact ns-a]"), True, ""),
    ("stringmatch-tags-all", POLICY.format(
        match="principals: [!Prefix a, !Suffix b, !Presence [], !Exact '']"), True, ""),
    ("stringmatch-mapping", POLICY.format(match="namespaces: [{Exact: ns-a}]"), False,
     "namespaces[0]"),
    ("stringmatch-unknown-tag", POLICY.format(match="namespaces: [!Regex a]"), False,
     "namespaces[0]"),
    ("action-as-tag", POLICY.format(match="destinationPorts: [80]").replace(
        "action: Allow", "action: !Allow"), True, ""),
    ("sourceip-bare-ip", POLICY.format(match="sourceIps: [10.0.0.1]"), False, "sourceIps[0]"),
    ("sourceip-cidr", POLICY.format(match="sourceIps: [10.0.0.1/8]"), True, ""),
    ("workload-ok", WORKLOAD.format(extra=""), True, ""),
    ("workload-unknown-key", WORKLOAD.format(extra="  colour: blue\n"), False,
     "workloads[0].colour"),
    ("workload-enum-plain", WORKLOAD.format(extra="  protocol: HBONE\n  status: Unhealthy\n"),
     True, ""),
    ("workload-enum-as-tag", WORKLOAD.format(extra="  protocol: !HBONE\n"), False,
     "workloads[0].protocol"),
    ("workload-type-any-string", WORKLOAD.format(extra="  workloadType: statefulset\n"), True,
     ""),
    ("workload-type-capitalised", WORKLOAD.format(extra="  workloadType: Pod\n"), True, ""),
    ("locality-full", WORKLOAD.format(
        extra="  locality: {region: r, zone: z, subzone: s}\n"), True, ""),
    ("locality-no-subzone", WORKLOAD.format(extra="  locality: {region: r, zone: z}\n"), False,
     "workloads[0].locality.subzone"),
    ("app-tunnel-no-protocol", WORKLOAD.format(extra="  applicationTunnel: {port: 15088}\n"),
     False, "workloads[0].applicationTunnel.protocol"),
    ("service-ports-quoted", WORKLOAD.format(extra="").replace("{80: 8080}", '{"80": 8080}'),
     False, "services.default/example.com"),
    ("service-ok", SERVICE.format(extra=""), True, ""),
    ("service-unknown-key", SERVICE.format(extra="  colour: blue\n"), False,
     "services[0].colour"),
    ("service-vip-without-network", SERVICE.format(extra="").replace('"/127.10.0.1"',
                                                                      '"127.10.0.1"'),
     False, "services[0].vips[0]"),
    ("service-cidr-vip-without-network", SERVICE.format(
        extra="  cidrVips: [{cidr: 10.9.0.0/16}]\n"), False, "services[0].cidrVips[0].network"),
    ("service-cidr-vip", SERVICE.format(
        extra="  cidrVips: [{network: '', cidr: 10.9.0.0/16}]\n"), True, ""),
    ("service-lb-without-health-policy", SERVICE.format(
        extra="  loadBalancer: {routingPreferences: [Zone], mode: Failover}\n"), False,
     "services[0].loadBalancer.healthPolicy"),
]

# ours refuses, ztunnel silently drops the key (a widened match): not run against ztunnel
DELIBERATE = [("match-unknown-key", POLICY.format(match="sourceIp: [10.0.0.1/8]"), False,
               "rules[0][0][0].sourceIp")]


def _parse(tmp_path, text: str):
    f = tmp_path / "local.yaml"
    f.write_text(text)
    return parse_file(str(f))


@pytest.mark.parametrize("case, text, accepted, field", CASES + DELIBERATE,
                         ids=[c[0] for c in CASES + DELIBERATE])
def test_accepts_and_refuses_as_ztunnel(tmp_path, case, text, accepted, field):
    parsed = _parse(tmp_path, text)
    if accepted:
        assert parsed.objects and not parsed.errors and not parsed.broken, parsed.errors
    else:
        assert not parsed.objects
        assert parsed.errors and field in parsed.errors[0][1], parsed.errors


def test_tagged_string_matches_translate(tmp_path):
    from ambient import localconfig
    parsed = _parse(tmp_path, CASES[1][1])
    (obj, _), = parsed.objects
    m = localconfig.policy(obj["spec"]).groups[0].rules[0].matches[0]
    kinds = [p.WhichOneof("match_type") for p in m.principals]
    assert kinds == ["prefix", "suffix", "presence", "exact"]
    assert (m.principals[0].prefix, m.principals[1].suffix) == ("a", "b")


def test_workload_type_kept_when_known_and_logged_when_not(tmp_path, caplog):
    from ambient import localconfig
    (obj, _), = _parse(tmp_path, WORKLOAD.format(extra="  workloadType: Pod\n")).objects
    assert localconfig.workload(obj["spec"]).workload_type == wl.POD
    (obj, _), = _parse(tmp_path, WORKLOAD.format(extra="  workloadType: sts\n")).objects
    with caplog.at_level(logging.WARNING, logger="ambient.localconfig"):
        assert localconfig.workload(obj["spec"]).workload_type == wl.DEPLOYMENT
    assert "workloadType" in caplog.text and "'sts'" in caplog.text


def test_a_tag_outside_local_config_is_refused(tmp_path):
    parsed = _parse(tmp_path, textwrap.dedent("""\
        apiVersion: v1
        kind: Pod
        metadata: {name: p, namespace: !Exact a}
        """))
    assert not parsed.objects and "YAML tag" in parsed.broken


# ---------------------------------------------------------------- the real ztunnel


def _ztunnel_verdict(path: str, timeout: float = 20.0) -> tuple[bool, str]:
    """Run ztunnel on ``path`` in a private netns; True when it loaded the file."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LOCAL_XDS_PATH": path,
           "CA_ADDRESS": "https://127.0.0.1:1", "PROXY_MODE": "dedicated", "RUST_LOG": "info",
           "PROXY_WORKLOAD_INFO": "default/local/local",
           "XDS_ADDRESS": "", "NODE_NAME": "local", "POD_NAMESPACE": "default",
           "POD_NAME": "local", "SERVICE_ACCOUNT": "local", "INSTANCE_IP": "127.0.0.1",
           "ISTIO_META_DNS_CAPTURE": "false"}
    proc = subprocess.Popen(["unshare", "--net", "sh", "-c", f"ip link set lo up && exec {ZTUNNEL}"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = bytearray()
    deadline = time.monotonic() + timeout

    def drain(fd: int) -> None:
        # a non-blocking pipe: read what is there (a text-mode read of an empty
        # non-blocking pipe fails inside the decoder instead of returning nothing)
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                return
            if not chunk:
                return
            out.extend(chunk)

    try:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        os.set_blocking(fd, False)
        while time.monotonic() < deadline:
            drain(fd)
            text = out.decode(errors="replace")
            if "local config initialized" in text:
                return True, text
            if proc.poll() is not None:
                drain(fd)
                return False, out.decode(errors="replace")
            time.sleep(0.1)
        raise AssertionError("ztunnel neither loaded nor refused the file in "
                             f"{timeout}s:\n{out.decode(errors='replace')[-2000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.skipif(not (ZTUNNEL and os.access(ZTUNNEL, os.X_OK)),
                    reason="AMBIENT_TEST_ZTUNNEL does not name a ztunnel binary")
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a private network namespace)")
@pytest.mark.parametrize("case, text, accepted, field", CASES, ids=[c[0] for c in CASES])
def test_real_ztunnel_agrees(tmp_path, case, text, accepted, field):
    f = tmp_path / "local.yaml"
    f.write_text(text)
    loaded, log = _ztunnel_verdict(str(f))
    assert loaded == accepted, log[-3000:]
