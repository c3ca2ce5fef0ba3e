"""The waypoints' access-log settings: bad values are refused with the setting named
(the agent does not start on them), good ones give istiod's log entries. No Envoy."""

from __future__ import annotations

import types

import pytest

from agent.core.config import ConfigError
from ambient.waypoint.resources import DEFAULT_ACCESS_LOG_FORMAT, AccessLog
from ambient.xds.server import _access_log


def _cfg(path="/dev/stdout", encoding="text", fmt=""):
    return types.SimpleNamespace(waypoint_access_log_file=path,
                                 waypoint_access_log_encoding=encoding,
                                 waypoint_access_log_format=fmt)


def test_off_unless_a_file_is_set():
    assert _access_log(_cfg(path="")) is None
    assert AccessLog().entries() == []


def test_default_text_entry_and_a_newline_added_to_a_custom_format():
    (entry,) = _access_log(_cfg()).entries({"response_flag_filter": {"flags": ["NR"]}})
    cfg = entry["typed_config"]
    assert entry["name"] == "envoy.access_loggers.file" and cfg["path"] == "/dev/stdout"
    assert cfg["log_format"]["text_format_source"]["inline_string"] == DEFAULT_ACCESS_LOG_FORMAT
    assert entry["filter"] == {"response_flag_filter": {"flags": ["NR"]}}
    (custom,) = AccessLog("/tmp/x", "TEXT", "%REQ_WITHOUT_QUERY(:PATH)%").entries()
    fmt = custom["typed_config"]["log_format"]
    assert fmt["text_format_source"]["inline_string"] == "%REQ_WITHOUT_QUERY(:PATH)%\n"
    assert fmt["formatters"][0]["name"] == "envoy.formatter.req_without_query"


@pytest.mark.parametrize("fmt,why", [("{not json", "not JSON"),
                                     ('["a"]', "JSON object"),
                                     ('{"code": 1}', "JSON object")])
def test_a_bad_json_format_names_the_setting(fmt, why):
    with pytest.raises(ConfigError) as e:
        _access_log(_cfg(encoding="json", fmt=fmt))
    assert "waypoint_access_log_format" in str(e.value) and why in str(e.value)


def test_an_unknown_encoding_is_refused():
    with pytest.raises(ValueError, match="encoding 'XML'"):
        AccessLog("/dev/stdout", "XML")
