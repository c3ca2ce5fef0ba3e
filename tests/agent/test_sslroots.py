"""agent/core/sslroots.py: aiohttp's default TLS contexts read the system CA roots on first
use, and then verify exactly as before. Each check runs in a fresh ``-S`` interpreter (the
test process imported aiohttp long ago), with ``SSL_CERT_FILE`` naming a CA the test
makes, so "the roots" are known: a server whose certificate that CA signed must be
accepted through aiohttp's default context (so the deferred roots were loaded before the
handshake), one signed by another CA refused."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

from tests.xds.certs import Pki

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import asyncio, os, ssl, sys, threading
    from agent.core import sslroots
    assert sslroots.install() is True
    assert sslroots.install() is True  # idempotent
    import aiohttp, aiohttp.connector as c
    from aiohttp import web
    # the patch is gone, both contexts are deferred and otherwise as aiohttp made them
    assert "set_default_verify_paths" not in vars(ssl.SSLContext)
    v, u = c._SSL_CONTEXT_VERIFIED, c._SSL_CONTEXT_UNVERIFIED
    assert v.roots_pending and u.roots_pending, (v.roots_pending, u.roots_pending)
    assert v.verify_mode == ssl.CERT_REQUIRED and v.check_hostname
    assert u.verify_mode == ssl.CERT_NONE and not u.check_hostname
    # a context made on another thread is never deferred
    other = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    t = threading.Thread(target=sslroots._recording_set_default_verify_paths, args=(other,))
    sslroots._DEFERRING_THREAD = threading.get_ident()
    t.start(); t.join()
    sslroots._DEFERRING_THREAD = None
    assert other.cert_store_stats()["x509_ca"] == 1, other.cert_store_stats()

    async def serve(cert, key):
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(cert, key)
        app = web.Application()
        app.router.add_get("/", lambda r: web.Response(text="ok"))
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]

    async def main():
        good, good_port = await serve(sys.argv[1], sys.argv[2])
        bad, bad_port = await serve(sys.argv[3], sys.argv[4])
        try:
            async with aiohttp.ClientSession() as s:  # no context: aiohttp's default one
                async with s.get(f"https://localhost:{good_port}/") as r:
                    assert await r.text() == "ok"
                assert not v.roots_pending
                assert v.cert_store_stats()["x509_ca"] == 1  # SSL_CERT_FILE's one CA
                try:
                    async with s.get(f"https://localhost:{bad_port}/"):
                        raise AssertionError("a server of an unknown CA was accepted")
                except aiohttp.ClientConnectorCertificateError:
                    pass
            assert u.roots_pending  # never used: never loaded
            assert len(u.get_ca_certs()) == 1 and not u.roots_pending
        finally:
            await good.cleanup()
            await bad.cleanup()
        print("ok")

    asyncio.run(main())
""")


def test_default_contexts_load_the_roots_on_first_use_and_verify_as_before(tmp_path):
    trusted, stranger = Pki("trusted root"), Pki("unknown root")
    files = []
    for name, pki in (("good", trusted), ("bad", stranger)):
        cert, key = pki.leaf(None, dns=["localhost"])
        (tmp_path / f"{name}.crt").write_bytes(cert)
        (tmp_path / f"{name}.key").write_bytes(key)
        files += [str(tmp_path / f"{name}.crt"), str(tmp_path / f"{name}.key")]
    (tmp_path / "roots.pem").write_bytes(trusted.root_pem)
    prefix = (f"import sys; sys.path[1:1] = [{str(ROOT)!r}, "
              f"{sysconfig.get_paths()['purelib']!r}]\n")
    env = {"PATH": "/usr/bin:/bin", "SSL_CERT_FILE": str(tmp_path / "roots.pem"),
           "SSL_CERT_DIR": str(tmp_path / "no-such-dir")}
    p = subprocess.run([sys.executable, "-S", "-c", prefix + SCRIPT, *files], env=env,
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]


def test_nothing_is_done_once_aiohttp_is_imported():
    """In a process that imported aiohttp first (this one), ``install`` changes nothing
    and says so."""
    import aiohttp.connector  # noqa: F401 - the state the check is about
    from agent.core import sslroots
    before = aiohttp.connector._SSL_CONTEXT_VERIFIED
    assert sslroots.install() is isinstance(before, sslroots.DeferredRootsContext)
    assert aiohttp.connector._SSL_CONTEXT_VERIFIED is before
