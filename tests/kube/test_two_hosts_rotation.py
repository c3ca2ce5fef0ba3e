"""Root rotation of the cluster CA Secret while pod A talks to pod B over HBONE through two
real ztunnels (issue 24 item 5, by hand: needs ``AMBIENT_TEST_ZTUNNEL``, root, and the real
kube-apiserver). Layout: :mod:`tests.kube.hosts`, with both agents signing with the
plug-in CA Secret ``cacerts`` of a fresh system namespace (the shipped ``ambient-agent-ca``
Role bound in it).

How ztunnel learns roots (ztunnel ``src/identity/caclient.rs``, ``src/tls/certificate.rs``,
``src/identity/manager.rs``): each workload certificate it fetches carries its own trust
store, the last element of the CA response split into its roots; that store verifies
peers for connections made with that certificate, and it is replaced only with the next
certificate, fetched at half of the certificate's span (NotBefore to NotAfter). Existing
TLS connections are never re-verified. So the overlap (``ca_root_overlap``) must outlast
the longest time a ztunnel keeps a certificate issued before the rotation.

Timing, honestly: ztunnel asks for ``SECRET_TTL`` (its own setting, here ``10m``, the
agent's floor); the CA backdates NotBefore 2 minutes, so a certificate spans 12 minutes
and ztunnel renews it 4 minutes after issue. ``ca_root_overlap`` is :data:`OVERLAP`
(6 minutes, a test value: production keeps 24 h against 24 h certificates). The run takes
about 10-12 minutes after setup: the overlap, then up to one more renewal until both
ztunnels hold certificates of the new key. Nothing is sped up inside ztunnel.

While the Secret is rotated, pod A keeps (1) one long-lived connection exchanging a
numbered line every 100 ms and (2) a new connection every 150 ms (connect, one line
echoed, close). Checks: zero failed exchanges and connections, the long-lived connection
never reconnected; both ztunnels learned the new root (their config_dump on the admin port
lists it among the certificate's roots) before the agents switched signing; after the
switch both hold certificates chained to the new intermediate and root; a burst of
concurrent connections then needs a second HBONE connection (ztunnel's pool carries at most
100 concurrent streams per connection), whose TLS handshake is made with the new
certificates on both sides, and succeeds; both ztunnels' access logs list the connections
with both identities, also after the switch. The figures are printed.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
import os
import socket
import subprocess
import threading
import time

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from agent.core.netns import run_in_netns
from agent.sds import keys
from agent.sds.ca_embedded import create_root
from tests.kube import cluster as kc
from tests.kube.hosts import APP_PORT, HAVE_ZTUNNEL, ZT_ADMIN, Host, access_lines, two_hosts, until
from tests.kube.test_ca_secret import _ca_role_documents, cacerts_data

pytestmark = [
    pytest.mark.root,
    # ztunnel renews at half its 10-minute certificates' span: the run is ~10-12 minutes
    # after set-up, longer than the suite's default 300 s per test
    pytest.mark.timeout(1800),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (netns, veth, CNI, iptables)"),
    pytest.mark.skipif(not HAVE_ZTUNNEL, reason="AMBIENT_TEST_ZTUNNEL not set or not executable: a root rotation "
                       "under traffic through the real ztunnel needs its binary (the CI part, "
                       "with ztunnel-exact clients, is tests/kube/test_two_nodes_mtls.py)"),
]

OVERLAP = 360.0  # ca_root_overlap, seconds (test value; see the module docstring)
ZTUNNEL_TTL = "10m"  # ztunnel's SECRET_TTL
SWITCHED = "root rotation: signing with the new CA"
BURST = 120  # concurrent connections: more than one HBONE connection's 100 streams


def ztunnel_cert(h: Host, identity: str) -> tuple[list[x509.Certificate],
                                                  list[x509.Certificate]] | None:
    """(leaf + intermediates, roots) of ztunnel's certificate for ``identity`` from its
    admin ``/config_dump`` (``certificates[].certChain/rootCerts[].pem``, base64 PEM), or
    None while it has none available."""
    status, body = h.get(ZT_ADMIN, "/config_dump")
    if status != 200:
        return None
    for c in json.loads(body).get("certificates", []):
        if c.get("identity") == identity and c.get("state") == "Available":
            def load(items):
                return [x509.load_pem_x509_certificate(base64.b64decode(i["pem"])) for i in items]
            return load(c["certChain"]), load(c["rootCerts"])
    return None


def pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"closed by the peer after {len(out)} of {n} bytes")
        out += chunk
    return out


class Traffic:
    """Pod A -> pod B: one long-lived connection exchanging a line every ``long_every``
    seconds, and a new connection every ``new_every`` seconds, each on a thread in pod A's
    netns. Every exchange is checked byte for byte; a failure is recorded with its time
    and error (never retried silently). Socket timeouts are generous (30 s): a loaded
    machine is slow, not failing."""

    def __init__(self, netns: str, ip: str, port: int, long_every: float = 0.1,
                 new_every: float = 0.15):
        self.netns, self.ip, self.port = netns, ip, port
        self.long_every, self.new_every = long_every, new_every
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.long_ok = self.new_ok = self.reconnects = 0
        self.failures: list[tuple[float, str, str]] = []  # (epoch s, kind, error)
        self.new_ok_times: list[float] = []
        self.threads = [threading.Thread(target=self._in_pod, args=(f,), daemon=True)
                        for f in (self._long, self._new)]

    def _in_pod(self, loop) -> None:
        try:
            run_in_netns(self.netns, loop)
        except Exception as e:  # noqa: BLE001 - a loop that died is a failure, never silence
            self._fail("traffic thread", e)

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def _fail(self, kind: str, e: object) -> None:
        with self.lock:
            self.failures.append((time.time(), kind, repr(e)))

    def _long(self) -> None:
        n = 0
        s: socket.socket | None = None
        while not self.stop.is_set():
            try:
                if s is None:
                    if n:
                        self.reconnects += 1
                    s = socket.create_connection((self.ip, self.port), timeout=30)
                msg = f"long {n}\n".encode()
                s.sendall(msg)
                got = recv_exact(s, len(msg))
                if got != msg:
                    raise ValueError(f"sent {msg!r}, got {got!r}")
                with self.lock:
                    self.long_ok += 1
            except (OSError, ValueError) as e:
                self._fail("long-lived", e)
                if s is not None:
                    s.close()
                s = None
            n += 1
            self.stop.wait(self.long_every)
        if s is not None:
            s.close()

    def _new(self) -> None:
        n = 0
        while not self.stop.is_set():
            msg = f"new {n}\n".encode()
            try:
                with socket.create_connection((self.ip, self.port), timeout=30) as s:
                    s.sendall(msg)
                    got = recv_exact(s, len(msg))
                if got != msg:
                    raise ValueError(f"sent {msg!r}, got {got!r}")
                with self.lock:
                    self.new_ok += 1
                    self.new_ok_times.append(time.time())
            except (OSError, ValueError) as e:
                self._fail("new connection", e)
            n += 1
            self.stop.wait(self.new_every)


def burst(ip: str, port: int, count: int, ss_netns: str) -> tuple[int, list[str], int]:
    """``count`` connections open at once, each echoing one line, all held open until the
    last is established; returns (echoed, errors, established HBONE connections to
    ``ip:15008`` seen by ``ss`` in ``ss_netns`` meanwhile). Run in pod A's netns."""
    socks: list[socket.socket] = []
    errors: list[str] = []
    ok = 0
    try:
        for i in range(count):
            try:
                s = socket.create_connection((ip, port), timeout=30)
                socks.append(s)
                msg = f"burst {i}\n".encode()
                s.sendall(msg)
                if recv_exact(s, len(msg)) != msg:
                    raise ValueError("wrong echo")
                ok += 1
            except (OSError, ValueError) as e:
                errors.append(repr(e))
        out = subprocess.run(["ip", "netns", "exec", ss_netns, "ss", "-Htn", "state",
                              "established", "dst", f"{ip}:15008"],
                             capture_output=True, text=True, timeout=30).stdout
        hbone = len([line for line in out.splitlines() if line.strip()])
    finally:
        for s in socks:
            s.close()
    return ok, errors, hbone


def log_time(line: str) -> float:
    """Epoch seconds of a ztunnel log line (it starts with an RFC 3339 UTC timestamp)."""
    stamp = line.split(None, 1)[0].rstrip("Z")
    return dt.datetime.fromisoformat(stamp[:26]).replace(tzinfo=dt.timezone.utc).timestamp()


async def test_root_rotation_under_traffic_through_real_ztunnels(kube_cluster, kube_admin,
                                                                 kube_namespace, capsys):
    system_ns = kc.unique("sys")
    await kc.create_namespace(kube_admin, system_ns)
    try:
        for d in _ca_role_documents(system_ns):
            await kc.apply(kube_admin, d)
        old_root, old_key = create_root("cluster.local")
        data, old_inter = cacerts_data(old_root, old_key, "rotation-old")
        await kc.request(kube_admin, "POST", f"/api/v1/namespaces/{system_ns}/secrets", body={
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "cacerts"},
            "data": data})
        agent_env = {"SYSTEM_NAMESPACE": system_ns, "AMBIENT_AGENT_CA_ROOT_PUBLISH": "false",
                     "AMBIENT_AGENT_CA_ROOT_OVERLAP": f"{OVERLAP:g}s"}
        async with two_hosts(kube_cluster, kube_admin, kube_namespace, root_files=False,
                             agent_env=agent_env,
                             ztunnel_env={"SECRET_TTL": ZTUNNEL_TTL}) as t:
            await rotate_under_traffic(t, system_ns, kube_admin, old_root, old_inter, capsys)
    finally:
        await kc.delete_namespace(kube_admin, system_ns)


async def rotate_under_traffic(t, system_ns, kube_admin, old_root, old_inter, capsys):
    a, b, ident = t.a, t.b, t.identity
    hosts = (a, b)
    await t.first_exchange()
    for h in hosts:  # before: the old intermediate and only the old root
        await until(f"ztunnel {h.letter} holding {ident} from the old CA",
                    lambda h=h: (c := ztunnel_cert(h, ident)) is not None
                    and c[0][1:2] == [old_inter] and c[1] == [old_root], timeout=60,
                    detail=lambda h=h: str(ztunnel_cert(h, ident)))
    traffic = Traffic(t.pod_path(a), b.pod_ip, APP_PORT)
    traffic.start()
    try:
        await until("traffic flowing (20 long-lived exchanges, 10 new connections)",
                    lambda: (traffic.long_ok >= 20 and traffic.new_ok >= 10)
                    or bool(traffic.failures), timeout=120,
                    detail=lambda: str(traffic.failures[:5]))
        assert not traffic.failures, f"before any rotation: {traffic.failures[:5]}"
        new_root, new_key = create_root("cluster.local")
        data, new_inter = cacerts_data(new_root, new_key, "rotation-new")
        t0 = time.time()
        await kc.request(kube_admin, "PATCH",
                         f"/api/v1/namespaces/{system_ns}/secrets/cacerts",
                         body={"data": data}, content_type="application/merge-patch+json")
        both = keys.merge_trust(pem(old_root), pem(new_root))
        marks: dict[str, float] = {}

        def mesh_root(h: Host) -> bytes:
            try:
                return (h.state / "mesh-root" / "root-cert.pem").read_bytes().strip()
            except OSError:
                return b""

        def observe() -> bool:
            """Record when each step happened (first seen); True when both ztunnels hold
            certificates of the new intermediate."""
            now = time.time()
            for h in hosts:
                if mesh_root(h) == both.strip():
                    marks.setdefault(f"bundle {h.letter}", now)
                if SWITCHED in h.full_log("agent.log"):
                    marks.setdefault(f"switch {h.letter}", now)
                c = ztunnel_cert(h, ident)
                if c and new_root in c[1] and old_root in c[1]:
                    marks.setdefault(f"ztunnel {h.letter} trusts new", now)
                if c and len(c[0]) > 1 and c[0][1] == new_inter:
                    c[0][0].verify_directly_issued_by(new_inter)
                    marks.setdefault(f"ztunnel {h.letter} new cert", now)
            return all(f"ztunnel {h.letter} new cert" in marks for h in hosts)

        await until("both ztunnels holding certificates of the new CA", observe,
                    timeout=OVERLAP + 600,
                    detail=lambda: f"marks {marks}; failures {traffic.failures[:5]}")
        # the agents switched only after both ztunnels learned the new root, and saw no
        # certificate of theirs due for renewal after the switch (agent.sds.ca_kube)
        for h in hosts:
            assert "is too short" not in h.full_log("agent.log"), h.log("agent.log")
            for other in hosts:
                assert marks[f"ztunnel {other.letter} trusts new"] < marks[f"switch {h.letter}"], marks
        t_new = max(marks[f"ztunnel {h.letter} new cert"] for h in hosts)
        await until("20 more new connections after both ztunnels renewed",
                    lambda: sum(1 for x in traffic.new_ok_times if x > t_new) >= 20,
                    timeout=120, detail=lambda: str(traffic.failures[:5]))
        ok, errors, hbone = await asyncio.to_thread(
            run_in_netns, t.pod_path(a), burst, b.pod_ip, APP_PORT, BURST, a.pod_netns)
        assert ok == BURST and not errors, (ok, errors[:5])
        assert hbone >= 2, f"{hbone} HBONE connection(s) during the burst: no new handshake"
        await until("traffic still flowing after the burst",
                    lambda: sum(1 for x in traffic.new_ok_times if x > t_new) >= 30,
                    timeout=120, detail=lambda: str(traffic.failures[:5]))
    finally:
        traffic.finish()
    t_end = time.time()
    assert traffic.failures == [], traffic.failures[:20]
    assert traffic.reconnects == 0
    # access logs: ztunnel logs a connection with both identities only when it was mTLS
    outbound: list[str] = []
    inbound: list[str] = []

    def logged() -> bool:
        nonlocal outbound, inbound
        outbound = access_lines(a.full_log("ztunnel.log"), "outbound", ident, ident)
        inbound = access_lines(b.full_log("ztunnel.log"), "inbound", ident, ident)
        want = traffic.new_ok + BURST + 1  # + the long-lived one, logged when it closed
        return len(outbound) >= want and len(inbound) >= want

    await until("both access logs listing every connection with both identities", logged,
                timeout=60, detail=lambda: f"{len(outbound)} outbound, {len(inbound)} inbound, "
                                           f"want {traffic.new_ok + BURST + 1}")
    after = [line for line in outbound if log_time(line) > t_new]
    after_in = [line for line in inbound if log_time(line) > t_new]
    assert after and after_in
    with capsys.disabled():
        print(f"\nroot rotation under traffic (overlap {OVERLAP:g}s, ztunnel SECRET_TTL "
              f"{ZTUNNEL_TTL}), seconds after the Secret changed:")
        for k, v in sorted(marks.items(), key=lambda kv: kv[1]):
            print(f"  {k}: +{v - t0:.1f}")
        print(f"  run: {t_end - t0:.1f}s after the change; long-lived exchanges "
              f"{traffic.long_ok}, reconnects {traffic.reconnects}; new connections "
              f"{traffic.new_ok} ({sum(1 for x in traffic.new_ok_times if x > t_new)} after "
              f"both ztunnels renewed); burst {ok}/{BURST} over {hbone} HBONE connections; "
              f"failures {len(traffic.failures)}")
        print(f"  access log lines with both identities: outbound(a) {len(outbound)}, "
              f"inbound(b) {len(inbound)}; after the renewal {len(after)}/{len(after_in)}")
        print(f"  e.g. {after[-1]}")
