"""Runtime log levels: ``POST /logging`` on the admin socket (ztunnel's admin ``/logging``
semantics) and ``ambient-agent log-level``, against a running status server; and
``--log-level debug`` keeping third-party libraries (pyroute2, which resets its own
logger's level on import) at WARNING unless named."""

from __future__ import annotations

import asyncio
import io
import logging
from contextlib import redirect_stderr, redirect_stdout

import aiohttp
import pytest

from agent import cli as agent_cli
from agent.core import logsetup
from tests.status.conftest import running_status


@pytest.fixture
def logs():
    stream = io.StringIO()
    logsetup.setup("info", "text", stream=stream)
    yield stream
    logsetup.setup("info", "text", stream=io.StringIO())


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = agent_cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


async def in_thread(*argv: str) -> tuple[int, str, str]:
    return await asyncio.get_running_loop().run_in_executor(None, run_cli, *argv)


async def test_cli_lists_changes_and_resets(tmp_path, logs):
    async with running_status(tmp_path) as (_, server):
        sock = server.admin_socket
        code, out, err = await in_thread("log-level", "--socket", sock)
        assert (code, out, err) == (0, "current log level is info\n", "")
        code, out, _ = await in_thread("log-level", "--socket", sock, "zds=debug", "sds:warn")
        assert code == 0
        assert out == "current log level is agent.sds=warn,zds=debug,info\n"
        logging.getLogger("zds.server").debug("now visible")
        logging.getLogger("agent.sds.cache").info("now hidden")
        assert "now visible" in logs.getvalue() and "now hidden" not in logs.getvalue()
        # a bare level changes the default and keeps the named scopes
        code, out, _ = await in_thread("log-level", "--socket", sock, "error")
        assert out == "current log level is agent.sds=warn,zds=debug,error\n"
        code, out, _ = await in_thread("log-level", "--socket", sock, "--reset")
        assert (code, out) == (0, "current log level is info\n")
        logging.getLogger("zds.server").debug("hidden again")
        assert "hidden again" not in logs.getvalue()


async def test_bad_levels_change_nothing(tmp_path, logs):
    async with running_status(tmp_path) as (_, server):
        sock = server.admin_socket
        await in_thread("log-level", "--socket", sock, "zds=debug")
        for bad, word in (("zds=loud", "'loud'"), ("zdss=debug", "'zdss'")):
            code, out, err = await in_thread("log-level", "--socket", sock, bad)
            assert code == 2 and out == "" and word in err and len(err.splitlines()) == 1
        # the endpoint itself refuses with 400 and keeps the levels (a client not ours)
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(sock)) as s:
            async with s.post("http://localhost/logging", params={"level": "zds=loud"}) as r:
                assert r.status == 400 and "'loud'" in await r.text()
            async with s.get("http://localhost/logging") as r:
                assert r.status == 405
            async with s.post("http://localhost/logging") as r:
                assert await r.text() == "current log level is zds=debug,info\n"


async def test_an_oversized_spec_is_one_short_line(tmp_path, logs):
    """A spec over 1,024 characters (a tester sent 8 KB and got aiohttp's own error text
    echoed back) is refused by the CLI and by the endpoint in one short line naming the
    limit; a long bad clause is quoted cut, never whole; nothing changes."""
    async with running_status(tmp_path) as (_, server):
        sock = server.admin_socket
        for spec in ("zds=" + "d" * 9000, "x" * 1100):
            code, out, err = await in_thread("log-level", "--socket", sock, spec)
            assert code == 2 and out == "" and len(err.splitlines()) == 1, err[:300]
            assert "more than the 1024 allowed" in err and len(err) < 200
        code, out, err = await in_thread("log-level", "--socket", sock, "zds=" + "q" * 500)
        assert code == 2 and "unknown level" in err and len(err) < 300
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(sock)) as s:
            async with s.post("http://localhost/logging", params={"level": "y" * 2000}) as r:
                text = await r.text()
                assert r.status == 400 and "1024 allowed" in text and len(text) < 200
            async with s.post("http://localhost/logging", params={"level": "w" * 20000}) as r:
                text = await r.text()  # past aiohttp's request-line limit: its short 4xx
                assert 400 <= r.status < 500 and len(text) < 300, text[:300]
            async with s.post("http://localhost/logging") as r:
                assert await r.text() == "current log level is info\n"


async def test_logging_is_not_on_the_status_port(tmp_path):
    async with running_status(tmp_path) as (_, server):
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{server.port}/logging",
                              params={"level": "debug"}) as r:
                assert r.status == 404
        assert logging.getLogger().level != logging.DEBUG


def test_no_agent_is_one_line(tmp_path):
    code, out, err = run_cli("log-level", "--socket", str(tmp_path / "none.sock"))
    assert code == 1 and out == "" and len(err.splitlines()) == 1
    assert "no agent answering at" in err
    code, _, err = run_cli("log-level", "--socket", str(tmp_path / "x"), "--timeout", "nan")
    assert code == 2 and "--timeout" in err


def test_debug_does_not_flood_with_pyroute2(logs):
    from pyroute2 import IPRoute

    logsetup.setup("debug", "text", stream=logs)
    with IPRoute() as ipr:
        ipr.get_links()
    logging.getLogger("cni.enrollment").debug("ours")
    assert "pyroute2" not in logs.getvalue() and "ours" in logs.getvalue()
    # named explicitly, the library's records come through, at run time too
    logsetup.change_levels("pyroute2=debug")
    with IPRoute() as ipr:
        ipr.get_links()
    assert "pyroute2.netlink" in logs.getvalue()
    logsetup.change_levels("", reset=True)
    assert logsetup.current_levels() == {"": "debug"}
