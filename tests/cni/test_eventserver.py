"""The CNI event server over its real Unix socket (aiohttp client), with the recording
enroller of conftest.py as the `enrollment` component and a dict-backed ObjectStore as
the config source."""

from __future__ import annotations

import asyncio
import os
import stat

import aiohttp

from tests.cni.conftest import DictStore, EnrollmentError, start_agent


def event(command="ADD", **kw):
    e = {"command": command, "container_id": "cid1", "netns": "/var/run/netns/p1",
         "pod_name": "web-0", "pod_namespace": "demo", "pod_uid": "uid-1", "ips": ["10.1.1.5"]}
    e.update(kw)
    return e


def pod(name="web-0", ns="demo", uid="uid-1", labels=None, annotations=None, host_network=False):
    return {"kind": "Pod", "metadata": {"name": name, "namespace": ns, "uid": uid,
                                        "labels": labels or {}, "annotations": annotations or {}},
            "spec": {"hostNetwork": host_network}}


def namespace(name, labels=None):
    return {"kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}}


async def post(agent, path, body=None, data=None):
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(agent.socket_path)) as s:
        async with s.post(f"http://localhost{path}", json=body, data=data) as r:
            return r.status, await r.text()


async def test_socket_mode_and_unlinked_on_stop(state_dir):
    agent = await start_agent(state_dir)
    assert stat.S_IMODE(os.stat(agent.socket_path).st_mode) == 0o600
    assert agent.server.ready() == (True, "")
    await agent.server.stop(1)
    assert not os.path.exists(agent.socket_path)


async def test_malformed_requests_are_400_and_server_survives(cni_agent):
    assert (await post(cni_agent, "/cmdadd", data=b""))[0] == 400
    status, text = await post(cni_agent, "/cmdadd", data=b"notjson")
    assert status == 400 and "malformed JSON" in text
    status, text = await post(cni_agent, "/cmdadd", body={"command": "ADD"})
    assert status == 400 and "container_id" in text
    status, text = await post(cni_agent, "/cmdadd", body=event(ips="10.0.0.1"))
    assert status == 400 and "'ips'" in text
    status, text = await post(cni_agent, "/cmdadd", body=event("DEL"))
    assert status == 400 and "'command'" in text
    assert (await post(cni_agent, "/cmdadd", body=event(ambient_default=True)))[0] == 200
    assert len(cni_agent.enroller.enrolled) == 1


async def test_deeply_nested_json_is_400_without_a_traceback(cni_agent, caplog):
    """100k nested '[' used to be a 500 with a RecursionError traceback in the log."""
    for path in ("/cmdadd", "/cmddel", "/log"):
        status, text = await post(cni_agent, path, data=b"[" * 100_000)
        assert status == 400 and "nested deeper than" in text, (path, status, text[:200])
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert (await post(cni_agent, "/cmdadd", body=event(ambient_default=True)))[0] == 200


async def test_store_decides_by_labels(cni_agent):
    cni_agent.set_store(DictStore([
        namespace("demo", {"istio.io/dataplane-mode": "ambient"}), namespace("plain"),
        pod(), pod("opt-out", uid="u2", labels={"istio.io/dataplane-mode": "none"}),
        pod("side", uid="u3", annotations={"sidecar.istio.io/status": "{}"}),
        pod("hostnet", uid="u4", host_network=True),
        pod("labelled", ns="plain", uid="u5", labels={"istio.io/dataplane-mode": "ambient"}),
        pod("unlabelled", ns="plain", uid="u6"),
        pod("sys", ns="kube-system", uid="u7", labels={"istio.io/dataplane-mode": "ambient"}),
    ]))
    cases = {"uid-1": True, "u2": False, "u3": False, "u4": False, "u5": True, "u6": False,
             "u7": False}
    for uid, want in cases.items():
        p = cni_agent.server.store.pod_by_uid(uid)["metadata"]
        status, text = await post(cni_agent, "/cmdadd", body=event(
            pod_uid=uid, pod_name=p["name"], pod_namespace=p["namespace"], container_id=uid,
            ambient_default=True))  # ambient_default is ignored when the Pod object exists
        assert status == 200, text
        assert (f'"ambient": {str(want).lower()}' in text), (uid, text)
    assert sorted(e.pod_uid for e in cni_agent.enroller.enrolled) == ["u5", "uid-1"]


async def test_missing_pod_object_falls_back_to_ambient_default(cni_agent):
    cni_agent.set_store(DictStore([namespace("demo", {"istio.io/dataplane-mode": "ambient"}),
                                   namespace("plain")]))
    # an ambient namespace: held until the Pod object is known (503: try again later)
    status, text = await post(cni_agent, "/cmdadd", body=event(pod_uid=""))
    assert status == 503 and "Pod object demo/web-0 is not known yet" in text, text
    status, text = await post(cni_agent, "/cmdadd", body=event(pod_uid="",
                                                               pod_namespace="plain"))
    assert status == 200 and '"ambient": false' in text
    status, text = await post(cni_agent, "/cmdadd", body=event(pod_uid="", pod_name="",
                                                               pod_namespace="",
                                                               ambient_default=True))
    assert status == 200 and '"ambient": true' in text
    assert cni_agent.enroller.enrolled[0].key == "cid1"  # named by its container ID


async def test_enrollment_errors(cni_agent):
    cni_agent.enroller.fail_with = "rules failed in netns"
    status, text = await post(cni_agent, "/cmdadd", body=event(ambient_default=True, pod_uid=""))
    assert status == 500 and "rules failed in netns" in text and "demo/web-0" in text
    if "retryable" in EnrollmentError.__init__.__code__.co_varnames:
        async def retryable(ev):
            raise EnrollmentError("no ztunnel", retryable=True)
        cni_agent.enroller.enroll = retryable
        status, text = await post(cni_agent, "/cmdadd", body=event(ambient_default=True))
        assert status == 503 and "no ztunnel" in text

    async def crash(ev):
        raise KeyError("boom")
    cni_agent.enroller.enroll = crash
    status, text = await post(cni_agent, "/cmdadd", body=event(ambient_default=True))
    assert status == 500 and "internal error: KeyError" in text
    assert cni_agent.server.ready()[0]


async def test_add_and_del_of_one_pod_are_serialised(cni_agent):
    cni_agent.enroller.delay = 0.2
    body = event(ambient_default=True)
    results = await asyncio.gather(post(cni_agent, "/cmdadd", body=body),
                                   post(cni_agent, "/cmdadd", body=body),
                                   post(cni_agent, "/cmddel", body=event("DEL")))
    assert [r[0] for r in results] == [200, 200, 200]
    assert cni_agent.enroller.max_concurrent_per_pod == 1
    assert len(cni_agent.enroller.unenrolled) == 1
    # a CNI DEL is upstream's RemovePodFromMesh(isDelete=true): the netns goes away
    assert cni_agent.enroller.unenrolled_is_delete == [True]
    assert cni_agent.server.debug_state()["in_flight"] == {}
    assert cni_agent.server._locks == {}


async def test_healthz_and_draining(cni_agent):
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(cni_agent.socket_path)) as s:
        async with s.get("http://localhost/healthz") as r:
            assert r.status == 200
        cni_agent.ctx.draining = True
        async with s.get("http://localhost/healthz") as r:
            assert r.status == 503
    status, text = await post(cni_agent, "/cmdadd", body=event(ambient_default=True))
    assert status == 503 and "shutting down" in text


async def test_metrics_count_requests(cni_agent):
    await post(cni_agent, "/cmdadd", body=event())
    await post(cni_agent, "/cmdadd", data=b"x")
    reg = cni_agent.ctx.registry
    assert reg.get_sample_value("istio_cni_plugin_requests_total",
                                {"command": "ADD", "response_code": "200"}) == 1
    assert reg.get_sample_value("istio_cni_plugin_requests_total",
                                {"command": "ADD", "response_code": "400"}) == 1


async def _raw(path: str, data: bytes, timeout: float = 10.0) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it."""
    reader, writer = await asyncio.open_unix_connection(path)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


async def test_incomplete_body_gets_408_and_the_connection_is_closed(cni_agent, monkeypatch):
    """A request announcing 100 bytes and sending 1 used to hold its connection (and a
    handler) forever."""
    from agent.core import listeners
    monkeypatch.setattr(listeners, "BODY_TIMEOUT", 0.5)
    loop = asyncio.get_running_loop()
    started = loop.time()
    answer = await _raw(cni_agent.socket_path, b"POST /cmdadd HTTP/1.1\r\nHost: x\r\n"
                        b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert b"request body not received within 0.5s" in answer
    assert loop.time() - started < 5
    assert cni_agent.server.requests.labels("ADD", "408")._value.get() == 1
    # the server still answers
    assert (await post(cni_agent, "/cmdadd", body=event(ambient_default=True)))[0] == 200


async def test_malformed_http_is_one_debug_line_not_an_error(cni_agent, caplog):
    import logging
    caplog.set_level(logging.DEBUG)
    for garbage in (b"POST /cmdadd HTTP/1.1\r\nHost: x\r\nBad Header Line\r\n\r\n",
                    b"POST /cmdadd HTTP/1.1\r\nContent-Length: x\r\n\r\n",
                    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 not http\r\n\r\n"):
        answer = await _raw(cni_agent.socket_path, garbage)
        assert answer.split(b" ")[1] == b"400", answer[:80]
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    lines = [r for r in caplog.records if "malformed or broken HTTP request" in r.getMessage()]
    assert len(lines) >= 2 and all(r.levelno == logging.DEBUG and r.exc_info is None
                                   and "\n" not in r.getMessage() for r in lines)
    assert (await post(cni_agent, "/cmdadd", body=event(ambient_default=True)))[0] == 200


async def test_names_are_validated_as_kubernetes_does(cni_agent):
    """Issue 28: a podman-style ADD with a 200-character container ID and a 900-character
    K8S_POD_NAME must fail alone, clearly, before anything is done for it (its ZDS
    request would not fit ztunnel's 1,024-byte receive buffer)."""
    cases = [
        (dict(container_id="c" * 200, pod_uid="", pod_namespace="", pod_name="p" * 900),
         "field 'pod_name'", "900 characters"),
        (dict(pod_name="Web_0"), "field 'pod_name'", "DNS-1123 subdomain"),
        (dict(pod_name="w" * 254), "field 'pod_name'", "longer than 253"),
        (dict(pod_namespace="n" * 64), "field 'pod_namespace'", "DNS-1123 label"),
        (dict(pod_namespace="Demo"), "field 'pod_namespace'", "DNS-1123 label"),
        (dict(pod_uid="u" * 129), "field 'pod_uid'", "at most 128"),
        (dict(pod_uid="uid 1"), "field 'pod_uid'", "Kubernetes UID"),
        (dict(container_id="-bad/id"), "field 'container_id'", "CNI spec"),
    ]
    for fields, field, why in cases:
        status, text = await post(cni_agent, "/cmdadd", body=event(**fields))
        assert status == 400 and field in text and why in text, (fields, status, text)
        assert len(text) < 400  # a long value is cut, never echoed whole
    assert cni_agent.enroller.enrolled == []
    # what real runtimes send still passes: a 200-character container ID, podman's
    # container-name alphabet without a namespace, a 253-character subdomain, a UUID
    for fields in (dict(container_id="c" * 200, pod_uid=""),
                   dict(pod_namespace="", pod_name="My_Container.1", pod_uid=""),
                   dict(pod_name=".".join(["a" * 63] * 4)[:253].rstrip(".")),
                   dict(pod_uid="0b3f6a4e-2c1d-4e5f-9a8b-7c6d5e4f3a2b")):
        status, text = await post(cni_agent, "/cmdadd", body=event(ambient_default=True, **fields))
        assert status == 200, (fields, text)


async def test_hand_written_pod_without_ip_or_ready_is_warned_about(cni_agent, caplog,
                                                                   monkeypatch):
    """A Pod from a config file with no status (newuser finding 5) was enrolled and then
    silently absent from xDS: the ADD now logs one warning naming what is missing (once
    UNSERVABLE_GRACE has passed). A complete Pod, and one from Kubernetes (its kubelet
    fills status later), get none."""
    import logging

    from prometheus_client import CollectorRegistry

    from ambient.store import ObjectStore
    from cni import eventserver
    monkeypatch.setattr(eventserver, "UNSERVABLE_GRACE", 0.05)

    store = ObjectStore(CollectorRegistry())
    ready = {"podIP": "10.199.0.3", "conditions": [{"type": "Ready", "status": "True"}]}
    for name, uid, status, origin in (("web", "u-web", None, "/etc/cluster/nu.yaml"),
                                      ("unready", "u-unready", {"podIP": "10.199.0.4"},
                                       "/etc/cluster/nu.yaml"),
                                      ("ok", "u-ok", ready, "/etc/cluster/nu.yaml"),
                                      ("kube", "u-kube", None, "kubernetes:Pod")):
        obj = pod(name, ns="nu", uid=uid, labels={"istio.io/dataplane-mode": "ambient"})
        if status is not None:
            obj["status"] = status
        store.apply([(obj, f"test {name}")], origin=origin)
    cni_agent.set_store(store)
    caplog.set_level(logging.WARNING, logger="cni.eventserver")
    for name, uid in (("web", "u-web"), ("unready", "u-unready"), ("ok", "u-ok"),
                      ("kube", "u-kube")):
        status, text = await post(cni_agent, "/cmdadd", body=event(
            pod_uid=uid, pod_name=name, pod_namespace="nu", container_id=uid,
            ips=["10.199.0.2"]))
        assert status == 200 and '"ambient": true' in text, text
    await asyncio.sleep(0.3)
    said = [r.getMessage() for r in caplog.records if "lacks" in r.getMessage()]
    assert len(said) == 2, said
    assert "nu/web" in said[0] and "status.podIP" in said[0] and "Ready" in said[0]
    assert "/etc/cluster/nu.yaml" in said[0]
    assert "nu/unready" in said[1] and "status.podIP" not in said[1] and "Ready" in said[1]


class FileStore(DictStore):
    """Pods as the files source holds them: each from a config file."""

    def origin_of(self, key):
        return f"/etc/ambient/cluster/{key[2]}.yaml"


async def test_a_hand_written_pod_is_looked_at_after_a_grace(cni_agent, caplog, monkeypatch):
    """A fresh-eyes run of the demo saw a WARN for each of its pods on a healthy run: the
    demo (as a kubelet does) writes status.podIP and Ready right after the ADD, and the
    check ran at the ADD. It now runs UNSERVABLE_GRACE seconds later against the object
    as it is then: filled in meanwhile -> nothing; still missing -> one WARN; the agent
    stopped first -> nothing."""
    from cni import eventserver
    grace = 1.0  # the margin for filling web-0 in after its ADD answered: the test's own
    monkeypatch.setattr(eventserver, "UNSERVABLE_GRACE", grace)
    ns = namespace("demo", {"istio.io/dataplane-mode": "ambient"})
    filled, bare = pod("web-0", uid="uid-1"), pod("web-1", uid="uid-2")
    cni_agent.set_store(FileStore([ns, filled, bare]))
    for p in (filled, bare):
        status, _ = await post(cni_agent, "/cmdadd", body=event(
            pod_name=p["metadata"]["name"], pod_uid=p["metadata"]["uid"]))
        assert status == 200
        if p is filled:  # as a kubelet (or the demo) writes it right after the ADD
            filled["status"] = {"podIP": "10.1.1.5",
                                "conditions": [{"type": "Ready", "status": "True"}]}
    assert not [r for r in caplog.records if "is enrolled but" in r.getMessage()]
    await asyncio.sleep(grace + 0.3)  # the loop runs the checks' timers before this ends
    warned = [r.getMessage() for r in caplog.records if "is enrolled but" in r.getMessage()]
    assert len(warned) == 1 and "demo/web-1" in warned[0] and "status.podIP" in warned[0]

    caplog.clear()
    late = pod("web-2", uid="uid-3")
    cni_agent.server.store.objects.append(late)
    assert (await post(cni_agent, "/cmdadd", body=event(pod_name="web-2",
                                                        pod_uid="uid-3")))[0] == 200
    await cni_agent.server.stop(1)
    await asyncio.sleep(grace + 0.3)
    assert not [r for r in caplog.records if "is enrolled but" in r.getMessage()]
