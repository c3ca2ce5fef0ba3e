"""Logging: text/JSON lines, per-component levels, secrets never reach a line."""

from __future__ import annotations

import io
import json
import logging

import pytest

from agent import logsetup

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


def test_bad_level_names_the_part():
    with pytest.raises(ValueError, match="'loud'"):
        logsetup.parse_levels("info,zds:loud")
    assert logsetup.parse_levels("debug,sds:error") == (logging.DEBUG, {"sds": logging.ERROR})


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

