"""Every flag of every subcommand (nested ones too: ``xds dump``, ``cni install``,
``waypoint bootstrap``) has help text, and ``--help`` shows the default of every flag
that takes a value: the test walks argparse's parsers as ``ambient-agent`` builds them."""

from __future__ import annotations

import argparse

import pytest

from agent import cli


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """(command path, parser) for the top level and every subcommand, depth first."""
    out: list[tuple[str, argparse.ArgumentParser]] = []

    def walk(path: str, parser: argparse.ArgumentParser) -> None:
        out.append((path, parser))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(f"{path} {name}", sub)

    walk("ambient-agent", cli.build_parser())
    return out


def _flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._VersionAction,
                                  argparse._SubParsersAction))]


PARSERS = _parsers()


def test_every_subcommand_is_walked():
    paths = {p for p, _ in PARSERS}
    assert {f"ambient-agent {name}" for name in cli.SUBCOMMANDS} <= paths
    assert {"ambient-agent run", "ambient-agent config", "ambient-agent xds dump",
            "ambient-agent cni install", "ambient-agent waypoint bootstrap"} <= paths


@pytest.mark.parametrize("path,parser", PARSERS, ids=[p for p, _ in PARSERS])
def test_every_flag_has_help_and_shows_its_default(path, parser):
    formatter = parser._get_formatter()
    without_help, without_default = [], []
    for action in _flags(parser):
        name = "/".join(action.option_strings) or action.dest
        if not (action.help or "").strip() or action.help == argparse.SUPPRESS:
            without_help.append(name)
            continue
        shown = formatter._expand_help(action)  # what --help prints for it
        if action.required and action.option_strings:  # a required flag: no default
            assert "default" not in shown, (name, shown)
            continue
        if action.option_strings and action.nargs != 0 and "default" not in shown:
            without_default.append(f"{name}: {shown!r}")
        if action.option_strings and action.nargs != 0 and "%(default)" not in action.help \
                and "default" not in action.help.lower():
            # appended by the formatter: the real default, in the CLI's words
            assert f"(default: {cli.shown_default(action.default)})" in shown, (name, shown)
        # said once: a text stating its default gets none appended (newuser: "(default
        # 127.0.0.1:15010) (default: 127.0.0.1,15010)")
        if "default" in action.help.lower() and "default:" not in action.help:
            assert "(default: " not in shown, (name, shown)
    assert not without_help, f"{path}: flags without help: {without_help}"
    assert not without_default, f"{path}: flags whose --help hides the default: " \
                                f"{without_default}"
    parser.format_help()  # renders (no stray % in a help text)


def test_shown_default_forms():
    assert cli.shown_default(None) == cli.shown_default("") == cli.shown_default([]) == "none"
    assert cli.shown_default(["a", "b"]) == "a,b"
    assert cli.shown_default(True) == "true" and cli.shown_default(10.0) == "10.0"


def test_appended_default_is_escaped_for_argparse():
    parser = cli.Parser(prog="t")
    parser.add_argument("--ratio", default="50%", help="share in %% of the total")
    assert "share in % of the total (default: 50%)" in " ".join(parser.format_help().split())


@pytest.mark.parametrize("command", [["xds", "dump"], ["status"]])
def test_timeouts_must_be_positive_seconds(command, capsys):
    """Newuser: ``xds dump --timeout -5`` was taken and reported "no response within
    -5.0s"; it (and ``status``'s) is now a usage error unless it is > 0. ``log-level``
    and ``ztunnel-config`` check theirs in one line of their own (tests/status)."""
    for bad, why in (("-5", "expected seconds > 0"), ("0", "expected seconds > 0"),
                     ("nan", "expected seconds > 0"), ("soon", "is not a number of seconds")):
        with pytest.raises(SystemExit) as e:
            cli.build_parser().parse_args([*command, "--timeout", bad])
        assert e.value.code == 2 and why in capsys.readouterr().err


def test_addr_port_out_of_range_is_named():
    from agent.core.hostport import parse_addr
    with pytest.raises(argparse.ArgumentTypeError, match="port 99999 is not between 1 and 65535"):
        parse_addr("127.0.0.1:99999", 15010)
