"""The demo's table of checks: each pod's enrollment, rules, ZDS and workload; Envoy's
SDS certificate; where traffic lands (the reference ztunnel's listeners, or HBONE and
STRICT mTLS with a real ztunnel); the status server's endpoints; and printing the table.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import sys
import time

from agent.demo.model import APP_PORT, DemoPod, ZtunnelWorkload
from agent.demo.state import DemoState
from agent.demo.traffic import (close_listener, echo_forever, exchange, http_get, listen,
                                mtls_connections, run_in_pod)


class DemoChecks(DemoState):
    async def verify(self) -> None:
        async with self.progress.step("checking every part"):
            if self.ztunnel is not None:
                await self.check_ztunnel()
            for pod in self.pods:
                await self.check_pod(pod)
            await self.check_envoy()
            await self.check_traffic()
            await self.check_endpoints()

    async def check_ztunnel(self) -> None:
        """ztunnel is ready (xDS synced over the TLS port with its token, ZDS snapshot
        received) and holds certificates for the ambient pods, issued from our mesh root."""
        ready = await asyncio.to_thread(self.real_ztunnel.ready)
        subject = f"ztunnel {self.ztunnel_bin.rsplit('/', 1)[-1]}"
        self.add(subject, "ready (xDS + CA over TLS, token)", ready,
                 f"{self.real_ztunnel.settings.xds_address}, :15021/healthz/ready "
                 f"{'200' if ready else 'not 200'}")
        try:
            dump = await asyncio.to_thread(self.real_ztunnel.config_dump)
        except Exception as e:  # noqa: BLE001 - reported as the row's detail
            self.add(subject, "certificates from our CA", False, str(e))
            return
        td = self.config.trust_domain
        want = {f"spiffe://{td}/ns/{p.namespace}/sa/{p.service_account}"
                for p in self.pods if p.ambient}
        have = {c.get("identity") for c in dump.get("certificates") or []
                if c.get("state") == "Available"}
        self.add(subject, "certificates from our CA", want <= have,
                 f"holds {', '.join(sorted(have & want))}" if want <= have
                 else f"missing {', '.join(sorted(want - have))}")

    async def check_pod(self, pod: DemoPod) -> None:
        subject = f"{pod.namespace}/{pod.name} {pod.ip}"
        enrollment = self.component("enrollment").debug_state()["pods"].get(pod.uid)
        status = enrollment["status"] if enrollment else "not enrolled"
        want = "enabled" if pod.ambient else "not enrolled"
        self.add(subject, "enrollment", status == want, status)
        rules = await asyncio.to_thread(self.rules_present, pod)
        self.add(subject, "redirection rules", rules == pod.ambient,
                 "present" if rules else "absent")
        if self.ztunnel is not None:
            state = (await asyncio.to_thread(self.real_ztunnel.pod_states)).get(pod.uid)
            self.add(subject, "ZDS (in-pod proxy in ztunnel)",
                     state == "Up" if pod.ambient else state is None,
                     f"ztunnel proxy {state}" if state else "not sent")
        else:
            held = self.zds_client.pods.get(pod.uid)
            # ztunnel must get the pod's identity from its Pod object, whatever the runtime
            # named it (podman: only the container)
            who = (held.namespace, held.name, held.service_account) if held else None
            self.add(subject, "ZDS (netns fd acked by ztunnel)",
                     (who == (pod.namespace, pod.name, pod.service_account)) if pod.ambient
                     else held is None,
                     f"held by ztunnel as {who[0]}/{who[1]} sa={who[2]}" if who else "not sent")
        w = (await asyncio.to_thread(self.workload_for, pod) if self.ztunnel is not None
             else self.workload_for(pod))
        from ambient import workload_pb2

        if w is None:
            self.add(subject, "workload in xDS", False, "missing")
        else:
            proto = (w.protocol if isinstance(w, ZtunnelWorkload)
                     else workload_pb2.TunnelProtocol.Name(w.tunnel_protocol))
            # ztunnel's config_dump calls a plain-TCP workload "TCP"; the proto says NONE
            want_proto = "HBONE" if pod.ambient else (
                "TCP" if isinstance(w, ZtunnelWorkload) else "NONE")
            self.add(subject, "workload in xDS", proto == want_proto,
                     f"{w.name} sa={w.service_account} tunnel={proto}")

    def rules_present(self, pod: DemoPod) -> bool:
        backend = self.component("enrollment").backend
        from agent.core.netns import run_in_netns_thread

        return bool(run_in_netns_thread(pod.netns_path, backend.present, False))

    async def check_envoy(self) -> None:
        from cryptography import x509

        root_pem = self.component("sds").root_pem()
        der, verified = await asyncio.to_thread(self._envoy_peer_cert, root_pem)
        cert = x509.load_der_x509_certificate(der)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = sans.get_values_for_type(x509.UniformResourceIdentifier)
        want = f"spiffe://{self.config.trust_domain}/ns/demo/sa/server"
        expiry = cert.not_valid_after_utc.strftime("%Y-%m-%d %H:%M:%SZ")
        self.add(f"envoy 127.0.0.1:{self.envoy_port}", "serves our SDS certificate",
                 verified and uris == [want],
                 f"{', '.join(uris)} expires {expiry}; chain verifies against ROOTCA"
                 if verified else "chain does not verify against ROOTCA")

    def _envoy_peer_cert(self, root_pem: str | bytes) -> tuple[bytes, bool]:
        ctx = ssl.create_default_context(cadata=root_pem.decode() if isinstance(root_pem, bytes)
                                         else root_pem)
        ctx.check_hostname = False  # SPIFFE certificates carry a URI SAN, not a DNS name
        with socket.create_connection(("127.0.0.1", self.envoy_port), timeout=5) as raw:
            with ctx.wrap_socket(raw) as tls:
                der = tls.getpeercert(binary_form=True)
                if der is None:
                    raise ssl.SSLError("Envoy sent no certificate")
                return der, True

    async def check_traffic(self) -> None:
        if self.ztunnel is not None:
            await self.check_hbone()
            return
        client, server, legacy = self.pods
        self.app_listener = app = await asyncio.to_thread(
            run_in_pod, server, lambda: listen(APP_PORT))
        self.on_cleanup("app listener", app.close)
        # ambient client -> server: captured by ztunnel's outbound listener in the client pod
        seen = await self.connect_and_observe(client, server.ip, APP_PORT)
        hit = [c for c in seen if c.uid == client.uid and c.port == 15001]
        self.add(f"{client.name} -> {server.name}:{APP_PORT}", "redirected to ztunnel",
                 bool(hit) and hit[0].original_dst == (server.ip, APP_PORT),
                 f"landed on ztunnel 15001 in {client.name}, original dst "
                 f"{hit[0].original_dst[0]}:{hit[0].original_dst[1]}" if hit else
                 f"not captured (saw {[(c.port, c.uid[:8]) for c in seen]})")
        # non-ambient legacy -> server: no outbound capture in the legacy pod
        seen = await self.connect_and_observe(legacy, server.ip, APP_PORT)
        outbound = [c for c in seen if c.uid == legacy.uid]
        inbound = [c for c in seen if c.uid == server.uid and c.port == 15006]
        self.add(f"{legacy.name} -> {server.name}:{APP_PORT}", "not redirected at source",
                 not outbound,
                 "left the legacy pod directly" + ("; captured by ztunnel inbound 15006 in "
                                                   f"{server.name}" if inbound else ""))

    async def check_hbone(self) -> None:
        """With a real ztunnel: client -> server:8080 is carried over HBONE (mTLS between
        the two pods' SPIFFE identities, as ztunnel's own metrics report it), and plaintext
        from the non-ambient legacy pod is refused at the server's inbound (the example
        cluster's PeerAuthentication is STRICT)."""
        client, server, legacy = self.pods
        self.app_listener = app = await asyncio.to_thread(
            run_in_pod, server, lambda: listen(APP_PORT))
        import threading

        threading.Thread(target=echo_forever, args=(app,), daemon=True).start()
        self.on_cleanup("app listener", lambda: close_listener(app))
        td = self.config.trust_domain
        src, dst = (f"spiffe://{td}/ns/demo/sa/{client.service_account}",
                    f"spiffe://{td}/ns/demo/sa/{server.service_account}")
        before = mtls_connections(self.real_ztunnel.metrics(), src, dst)
        reply = await asyncio.to_thread(run_in_pod, client,
                                        lambda: exchange(server.ip, APP_PORT, b"ping\n"))
        after = before
        deadline = time.monotonic() + 5
        while after <= before and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            after = mtls_connections(await asyncio.to_thread(self.real_ztunnel.metrics), src, dst)
        self.add(f"{client.name} -> {server.name}:{APP_PORT}", "HBONE through ztunnel",
                 reply == b"ping\n" and after > before,
                 f"echo {'ok' if reply == b'ping' + bytes([10]) else repr(reply)}; ztunnel "
                 f"counted {after - before:g} mTLS connection(s) {client.service_account} -> "
                 f"{server.service_account}")
        # The example cluster's PeerAuthentication is STRICT: ztunnel must refuse plaintext
        # from the non-mesh legacy pod at the server's inbound, and say why in its log.
        log_before = len(self.real_ztunnel.log())
        reply = await asyncio.to_thread(run_in_pod, legacy,
                                        lambda: exchange(server.ip, APP_PORT, b"hi\n"))
        refused = ""
        deadline = time.monotonic() + 5
        while not refused and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            refused = next((line for line in self.real_ztunnel.log()[log_before:].splitlines()
                            if 'src.workload="legacy"' in line and "policy rejection" in line), "")
        reason = refused.split('error="', 1)[-1].rstrip('"') if refused else ""
        self.add(f"{legacy.name} -> {server.name}:{APP_PORT}", "plaintext refused (STRICT mTLS)",
                 reply == b"" and bool(refused),
                 f"ztunnel: {reason}" if refused else f"not refused (got {reply!r})")

    async def connect_and_observe(self, src: DemoPod, ip: str, port: int) -> list:
        """Connect from ``src`` to ``ip:port``; return what the reference ztunnel saw."""
        self.drain_accepted()
        before = len(self.seen)

        def dial() -> None:
            with socket.create_connection((ip, port), timeout=3):
                pass

        with contextlib.suppress(OSError):
            await asyncio.to_thread(run_in_pod, src, dial)
        await asyncio.sleep(0.3)
        self.drain_accepted()
        return self.seen[before:]

    def drain_accepted(self) -> None:
        queue = self.zds_client.accepted
        while not queue.empty():
            self.seen.append(queue.get_nowait())

    async def check_endpoints(self) -> None:
        from agent.status.cli import fetch

        port = self.agent_port("status")
        url = f"http://127.0.0.1:{port}/stats/prometheus"
        try:
            ok = "# TYPE" in await asyncio.to_thread(http_get, url)
        except OSError:
            ok = False
        self.add("status server", "/stats/prometheus", ok, url)
        admin = self.agent.ctx.config.admin_socket
        try:
            ok = "components" in await asyncio.to_thread(fetch, admin, 5.0)
        except RuntimeError:
            ok = False
        self.add("status server", "/debug", ok, f"admin socket {admin}")
        # `ambient-agent status --workloads`: every demo pod listed with its enrollment
        from agent.status import mesh
        try:
            view = (await asyncio.to_thread(fetch, admin, 5.0)).get("mesh") or {}
            rows = {(r["namespace"], r["name"]): r for r in mesh.select(view, "workloads")}
            states = [(p, rows.get((p.namespace, p.name))) for p in self.pods]
            ok = all(r is not None and (r["enrolled"] == "enabled") == p.ambient
                     and r["ztunnel"] == p.ambient for p, r in states)
            detail = ", ".join(f"{p.namespace}/{p.name} "
                               f"{(r or {}).get('enrolled') or 'not enrolled'}"
                               for p, r in states)
        except (RuntimeError, KeyError, TypeError) as e:
            ok, detail = False, str(e)
        self.add("status server", "status --workloads", ok, detail)

    def print_table(self, footer: bool = True) -> None:
        """The checks as a table; ``footer``: then how to look at the running demo (not
        with ``--once``, which tears it all down right after)."""
        rows = [(c.subject, c.what, "ok" if c.ok else "FAIL", c.detail) for c in self.checks]
        widths = [max(len(r[i]) for r in rows + [("subject", "check", "result", "")])
                  for i in range(3)]
        print()
        print(f"{'subject':<{widths[0]}}  {'check':<{widths[1]}}  {'result':<{widths[2]}}  detail")
        print("-" * (sum(widths) + 6 + 40))
        for r in rows:
            print(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}")
        if not footer:
            return
        port = self.agent_port("status")
        admin = self.agent.ctx.config.admin_socket
        print(f"\nmetrics: http://127.0.0.1:{port}/stats/prometheus   "
              f"debug: curl --unix-socket {admin} http://localhost/debug   "
              f"status: {own_command()} status --socket {admin}")


def own_command() -> str:
    """How to run this ``ambient-agent`` again from another shell: the path it was started
    by (``.venv/bin/ambient-agent`` is not on PATH after the README's install), or
    ``python -m agent.cli`` with this interpreter."""
    argv0 = sys.argv[0] if sys.argv else ""
    if os.path.basename(argv0) == "ambient-agent":
        return os.path.abspath(argv0)
    return f"{sys.executable} -m agent.cli"
