"""Logging: text/JSON lines, per-component levels, secrets never reach a line."""

from __future__ import annotations

import importlib
import io
import json
import logging
import pkgutil

import pytest

from agent.core import logsetup

KEY = "-----BEGIN EC PRIVATE KEY-----\nMHcCAQEEIBk+secret+material\n-----END EC PRIVATE KEY-----"


@pytest.fixture
def capture():
    stream = io.StringIO()
    yield stream
    logsetup.setup("info", "text", stream=io.StringIO())


def test_json_lines_and_levels(capture):
    logsetup.setup("warn,zds:debug", "json", stream=capture)
    logging.getLogger("zds.server").debug("hello %s", "ztunnel")
    logging.getLogger("cni").info("dropped: below warn")
    lines = [json.loads(line) for line in capture.getvalue().splitlines()]
    assert len(lines) == 1
    assert lines[0]["level"] == "debug" and lines[0]["scope"] == "zds.server"
    assert lines[0]["msg"] == "hello ztunnel" and lines[0]["time"].endswith("Z")


def test_private_keys_and_tokens_redacted(capture):
    logsetup.setup("info", "text", stream=capture)
    log = logging.getLogger("agent.sds")
    log.info("got secret %s", KEY)
    log.info("authorization: Bearer eyJhbGciOi.abc.def")
    log.info('request {"token": "s3cr3t-value"}')
    try:
        raise ValueError(KEY)
    except ValueError:
        log.exception("failed")
    out = capture.getvalue()
    assert "secret+material" not in out and "eyJhbGciOi" not in out and "s3cr3t" not in out
    assert out.count("REDACTED") >= 4


JWT = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJzcGlmZmUifQ.c2lnbmF0dXJlLXZhbHVl"


@pytest.mark.parametrize("text,secret", [
    (f"Authorization: Bearer {JWT}", JWT),
    ("token=s3cr3tv4lue", "s3cr3tv4lue"),
    ("token: s3cr3tv4lue", "s3cr3tv4lue"),
    ("token: onlyletters", "onlyletters"),
    ("X-Token:abcdef", "abcdef"),
    ('{"token": "s3cr3tv4lue"}', "s3cr3tv4lue"),
    ('{"token": "two words"}', "words"),
    ("token='quoted value'", "value"),
    (f"peer sent {JWT} as its credential", "eyJzdWIiOiJzcGlmZmUifQ"),
    ("Authorization: Basic dXNlcjpwYXNz", "dXNlcjpwYXNz"),
    (KEY, "secret+material"),
    ("-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBg\n-----END PRIVATE KEY-----", "MIIEvQIBADANBg"),
    ("-----BEGIN RSA PRIVATE KEY-----\nMIIEcut-short", "MIIEcut-short"),
])
def test_redact_removes_each_secret_form(text, secret):
    out = logsetup.redact(text)
    assert secret not in out and "REDACTED" in out, out


def test_redact_keeps_plain_words():
    for text in ("no 'authorization: Bearer' token", "refused: bad token",
                 "tokens_file /etc/agent/tokens reloaded"):
        assert logsetup.redact(text) == text


def test_bad_level_names_the_part():
    with pytest.raises(ValueError, match="'loud'"):
        logsetup.parse_levels("info,zds:loud")
    assert logsetup.parse_levels("debug,sds:error") == (logging.DEBUG, {"agent.sds": logging.ERROR})
    with pytest.raises(ValueError, match="'sdss'"):
        logsetup.parse_levels("info,sdss:debug")


@pytest.mark.parametrize("spec", ["=debug", ":debug", "info, =warn", " :error"])
def test_clause_with_a_separator_and_no_scope_is_refused(spec):
    """It used to set the default level, silently, as if the scope had not been typed."""
    with pytest.raises(ValueError, match="no scope before"):
        logsetup.parse_levels(spec)


def _our_modules():
    for package in logsetup.PACKAGES:
        root = importlib.import_module(package)
        yield package
        for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
            yield info.name


def test_logger_names_are_module_paths():
    """Every module's ``log`` is named after the module, so scopes are package paths."""
    checked = 0
    for name in _our_modules():
        module = importlib.import_module(name)
        log = getattr(module, "log", None)
        if isinstance(log, logging.Logger):
            assert log.name == name, f"{name}: logger named {log.name!r}"
            checked += 1
    assert checked >= 30
    from agent.sds import service
    assert service.log.name.startswith("agent.sds.")


def test_documented_scopes_work(capture):
    """README's ``info,sds:warning``: SDS info dropped, its warnings kept, others at info;
    a second setup drops the first one's per-scope level."""
    from agent.sds import cache, service
    from zds import server

    logsetup.setup("info,sds:warning", "text", stream=capture)
    service.log.info("sds-info")
    cache.log.warning("sds-warning")
    server.log.info("zds-info")
    out = capture.getvalue()
    assert "sds-info" not in out and "sds-warning" in out and "zds-info" in out
    logsetup.setup("info", "text", stream=capture)
    service.log.info("sds-info-again")
    assert "sds-info-again" in capture.getvalue()


def test_third_party_stays_at_warning_unless_named(capture):
    logsetup.setup("debug", "text", stream=capture)
    for name in ("pyroute2", "grpc", "asyncio", "aiohttp.access", "watchfiles",
                 "kubernetes_asyncio"):
        logging.getLogger(f"{name}.inner").debug(f"{name}-debug")
    logging.getLogger("cni.enrollment").debug("ours-debug")
    out = capture.getvalue()
    assert "ours-debug" in out and "-debug" not in out.replace("ours-debug", "")
    logsetup.setup("info,pyroute2:debug", "text", stream=capture)
    logging.getLogger("pyroute2.netlink").debug("named-debug")
    assert "named-debug" in capture.getvalue()



@pytest.mark.parametrize("line,kept,gone", [
    # the agent's own refusal reason: nothing secret, must stay readable
    ("no client certificate and no 'authorization: Bearer' token",
     "no client certificate and no 'authorization: Bearer' token", None),
    ("authorization: Bearer abc.def", "authorization: Bearer [REDACTED]", "abc.def"),
    ("authorization: bearer\tabc.def", "[REDACTED]", "abc.def"),
    ("authorization: Bearerabc", "authorization: [REDACTED]", "Bearerabc"),
    ("authorization: s3cr3t", "authorization: [REDACTED]", "s3cr3t"),
    ('{"authorization": "Bearer xyz"}', '"Bearer [REDACTED]"', "xyz"),
])
def test_bearer_scheme_word_is_not_a_secret(line, kept, gone):
    out = logsetup.redact(line)
    assert kept in out
    if gone:
        assert gone not in out
