"""The embedded CA's signer process (``agent.sds.signer``): real children minting and
signing by the CA's rules, and the failure paths: a child killed with requests in flight
(resent, answered), a child that dies on every request (a clear UNAVAILABLE, nothing
lost), a stuck child (DEADLINE_EXCEEDED, killed, replaced), CA files that do not load,
and the SDS component issuing through it without a key byte in the log."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import sys

import grpc
import pytest
from cryptography import x509

from agent.core.backoff import Backoff
from agent.sds import keys
from agent.sds.ca_embedded import EmbeddedCA
from agent.sds.ca_istio import CAClientError
from agent.sds.server import SdsServer, embedded_ca_files
from agent.sds.signer import SignerProcess
from tests.sds.helpers import Stream, executor_runner, make_config, request, secrets_of

ID = "spiffe://cluster.local/ns/a/sa/b"


@pytest.fixture(scope="module")
def ca_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("signer") / "ca"
    EmbeddedCA.load_or_create(d, "cluster.local")
    return str(d / "root-cert.pem"), str(d / "root-key.pem")


def _fake_python(tmp_path, body: str) -> str:
    """An "interpreter" for SignerProcess that runs ``body`` (Python) instead of the
    signer, with the real one's argv; ``body`` may call ``real()`` to become the signer."""
    prog = tmp_path / "fake_signer.py"
    prog.write_text("import sys, os\nsys.argv = sys.argv[2:]\n"
                    "def real():\n    from agent.sds import signer\n"
                    "    sys.exit(signer._serve(sys.argv[1], sys.argv[2], sys.stdin.buffer, "
                    "sys.stdout.buffer))\n" + body)
    launcher = tmp_path / "fake-python"
    launcher.write_text(f"#!/bin/sh\nexec {sys.executable} {prog} \"$@\"\n")
    launcher.chmod(launcher.stat().st_mode | stat.S_IXUSR)
    return str(launcher)


async def test_mint_and_sign_follow_the_ca_rules(ca_files):
    signer = SignerProcess(*ca_files)
    await signer.start()
    try:
        key_pem, chain, (not_before, not_after, serial) = await signer.mint([ID], "ECDSA", 3600)
        leaf = x509.load_pem_x509_certificate(chain[0].encode())
        assert keys.uri_sans(leaf) == [ID] and leaf.serial_number == serial
        assert (not_before, not_after) == (leaf.not_valid_before_utc, leaf.not_valid_after_utc)
        leaf.verify_directly_issued_by(x509.load_pem_x509_certificate(chain[1].encode()))
        assert keys.same_public_key(
            __import__("cryptography.hazmat.primitives.serialization", fromlist=["x"])
            .load_pem_private_key(key_pem, None), leaf)
        _, csr = keys.new_key_and_csr("RSA", ["spiffe://evil/ns/x/sa/y"])
        chain2, _ = await signer.sign(csr, [ID], 600)
        assert keys.uri_sans(x509.load_pem_x509_certificate(chain2[0].encode())) == [ID]
        with pytest.raises(CAClientError) as e:
            await signer.mint([ID], "ECDSA", 91 * 24 * 3600)
        assert e.value.code == "INVALID_ARGUMENT" and "max allowed TTL" in str(e.value)
        with pytest.raises(CAClientError) as e:
            await signer.sign(b"not a csr", [ID], 600)
        assert e.value.code == "INVALID_ARGUMENT" and "csr" in str(e.value)
    finally:
        await signer.close()
    with pytest.raises(CAClientError) as e:
        await signer.mint([ID], "ECDSA", 3600)
    assert e.value.code == "UNAVAILABLE"


async def test_killed_child_is_replaced_and_its_requests_resent(ca_files):
    signer = SignerProcess(*ca_files, restart=Backoff(0.01, 0.05))
    await signer.start()
    try:
        first = signer._proc.pid
        calls = [asyncio.ensure_future(signer.mint([f"{ID}-{i}"], "ECDSA", 3600))
                 for i in range(20)]
        await asyncio.sleep(0)  # sent, not answered yet
        os.kill(first, 9)
        done = await asyncio.gather(*calls)
        assert [keys.uri_sans(x509.load_pem_x509_certificate(c[1][0].encode()))
                for c in done] == [[f"{ID}-{i}"] for i in range(20)]
        assert signer._proc.pid != first and signer.restarts == 1
        assert signer.debug_state()["waiting"] == 0
    finally:
        await signer.close()


async def test_child_dying_on_every_request_fails_clearly(ca_files, tmp_path):
    # answers "ready", then exits on its first request: each request is tried on two
    # children and then fails UNAVAILABLE naming the identity
    python = _fake_python(tmp_path, "from agent.sds import signer\n"
                          "sys.stdout.buffer.write(signer._encode({'ready': True}))\n"
                          "sys.stdout.buffer.flush()\nsys.stdin.buffer.read(4)\nsys.exit(3)\n")
    signer = SignerProcess(*ca_files, python=python, restart=Backoff(0.01, 0.05))
    await signer.start()
    try:
        with pytest.raises(CAClientError) as e:
            await signer.mint([ID], "ECDSA", 3600)
        assert e.value.code == "UNAVAILABLE" and ID in str(e.value) and "twice" in str(e.value)
        assert signer.restarts >= 1 and signer.retried == 1
    finally:
        await signer.close()


async def test_stuck_child_times_out_and_is_replaced(ca_files, tmp_path, caplog):
    marker = tmp_path / "stuck-once"
    python = _fake_python(tmp_path, f"import time\nif not os.path.exists({str(marker)!r}):\n"
                          f"    open({str(marker)!r}, 'w').close()\n"
                          "    from agent.sds import signer\n"
                          "    sys.stdout.buffer.write(signer._encode({'ready': True}))\n"
                          "    sys.stdout.buffer.flush()\n    time.sleep(60)\nreal()\n")
    signer = SignerProcess(*ca_files, python=python, timeout=1.0, restart=Backoff(0.01, 0.05))
    await signer.start()
    try:
        with pytest.raises(CAClientError) as e:
            await signer.mint([ID], "ECDSA", 3600)
        assert e.value.code == "DEADLINE_EXCEEDED" and ID in str(e.value)
        for _ in range(100):  # the stuck child was killed; a real one replaces it
            if signer.restarts and signer._up.is_set():
                break
            await asyncio.sleep(0.05)
        _, chain, _ = await signer.mint([ID], "ECDSA", 3600)
        assert keys.uri_sans(x509.load_pem_x509_certificate(chain[0].encode())) == [ID]
    finally:
        await signer.close()


async def test_unloadable_ca_files_fail_start_naming_the_file(tmp_path):
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("junk")
    key.write_text("junk")
    signer = SignerProcess(str(cert), str(key))
    with pytest.raises(RuntimeError) as e:
        await signer.start()
    assert str(cert) in str(e.value) and "junk" not in str(e.value)


async def test_sds_issues_through_the_signer_with_no_key_in_logs(state_dir, caplog):
    caplog.set_level(logging.DEBUG)
    cfg = make_config(state_dir, service_account="cart", pod_namespace="shop",
                      ecc_signature_algorithm="ECDSA", ca_signer_process=True)
    server = SdsServer(cfg, executor_runner())
    await server.start()
    try:
        assert embedded_ca_files(cfg)[0] == os.path.join(cfg.ca_dir, "root-cert.pem")
        pid = server.ca_client.signer._proc.pid
        async with grpc.aio.insecure_channel("unix:" + cfg.sds_socket) as ch:
            st = Stream(ch)
            await st.send(request(["default", "ROOTCA"]))
            got = secrets_of(await st.recv())
        leaf = x509.load_pem_x509_certificate(
            got["default"].tls_certificate.certificate_chain.inline_bytes)
        assert keys.uri_sans(leaf) == ["spiffe://cluster.local/ns/shop/sa/cart"]
        leaf.verify_directly_issued_by(x509.load_pem_x509_certificate(server.root_pem()))
        key = got["default"].tls_certificate.private_key.inline_bytes
        assert b"PRIVATE KEY" in key and server.cache.csr_count >= 1
    finally:
        await server.stop(0)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the child went with the component
    text = caplog.text
    assert "PRIVATE KEY" not in text and key.decode().splitlines()[1] not in text
