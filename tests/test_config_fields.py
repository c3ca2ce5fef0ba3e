"""The typed Config generated from the settings table: drift check, types, immutability."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from agent.core import config as agent_config, config_fields

REPO_ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location(
        "gen_config_fields", REPO_ROOT / "scripts" / "gen_config_fields.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_module_matches_the_settings_table():
    """Adding, renaming or retyping a setting without regenerating fails here."""
    assert (REPO_ROOT / "agent/core/config_fields.py").read_text() == _generator().render(), (
        "agent/core/config_fields.py is stale: run python scripts/gen_config_fields.py")


def test_check_mode_reports_drift(tmp_path, monkeypatch):
    gen = _generator()
    stale = tmp_path / "config_fields.py"
    stale.write_text("# not what the table gives\n")
    monkeypatch.setattr(gen, "TARGET", stale)
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    assert gen.main(["--check"]) == 1
    assert subprocess.run([sys.executable, str(REPO_ROOT / "scripts/gen_config_fields.py"),
                           "--check"], cwd=REPO_ROOT).returncode == 0


def test_one_field_per_setting_in_table_order():
    names = [f.name for f in dataclasses.fields(config_fields.Settings)]
    assert names == [s.name for s in agent_config.SETTINGS]


_RUNTIME = {"str": str, "int": int, "float": float, "bool": bool,
            "tuple[str, ...]": tuple}


def _check_type(name, annotation, value):
    if annotation.startswith("Literal["):
        allowed = typing.get_args(eval(annotation, vars(typing)))  # noqa: S307 - our own text
        assert value in allowed, (name, value, allowed)
    elif annotation == "Any":
        return
    else:
        want = _RUNTIME[annotation]
        # an int default of a float setting (ca_port 0 is int) is fine for float only
        ok = isinstance(value, want) or (want is float and type(value) is int)
        assert ok and not (want is int and isinstance(value, bool)), (name, value, annotation)
        if want is tuple:
            assert all(isinstance(v, str) for v in value), (name, value)


def test_defaults_and_parsed_values_have_the_declared_types(tmp_path):
    """Built-in defaults bypass the parsers, so they must already have the parsed type."""
    hints = {f.name: f.type for f in dataclasses.fields(config_fields.Settings)}
    defaults = agent_config.load({"state_dir": str(tmp_path), "config_file": "/dev/null"},
                                 env={})
    for name, annotation in hints.items():
        _check_type(name, annotation, getattr(defaults, name))
    given = agent_config.load({"state_dir": str(tmp_path), "config_file": "/dev/null",
                               "exclude_namespaces": "a,b", "xds_port": "1234",
                               "shutdown_grace": "2s", "ambient_ipv6": "false",
                               "log_format": "JSON"}, env={})
    for name, annotation in hints.items():
        _check_type(name, annotation, getattr(given, name))
    assert given.exclude_namespaces == ("a", "b") and given.log_format == "json"


def test_config_is_immutable(tmp_path):
    config = agent_config.load({"state_dir": str(tmp_path), "config_file": "/dev/null"}, env={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.xds_port = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.origins["xds_port"] = "flag"  # type: ignore[index]
    changed = config.replace(xds_port=1)
    assert (changed.xds_port, changed.origins["xds_port"]) == (1, "override")
    assert (config.xds_port, config.origins["xds_port"]) == (15010, "default")
    with pytest.raises(KeyError):
        config.replace(no_such_setting=1)
    with pytest.raises(AttributeError):
        config.no_such_setting  # noqa: B018
