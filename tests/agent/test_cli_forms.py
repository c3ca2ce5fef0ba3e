"""The CLI's common forms: ``--version``; ``run --help`` names each setting's kind or
choices and its default; every ``--addr`` takes HOST:PORT (``[v6]:PORT``, a bare host, an
``http://`` URL); output into a closed pipe (``config | head``) exits without a traceback."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
from contextlib import redirect_stdout

import pytest

from agent import cli
from agent.core.hostport import parse_addr

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"ambient-agent {cli.version_string()}")


def test_run_parser_does_not_import_importlib_metadata():
    """Building ``run``'s parser leaves ``importlib.metadata`` unimported (~50 ms at every
    start before the first LIST, issue 28): the version is looked up only for
    ``--version``. A fresh ``-S`` interpreter, as the image runs the agent (the
    development install's ``.pth`` imports it at every start)."""
    import sysconfig
    code = (f"import sys; sys.path[1:1] = [{ROOT!r}, {sysconfig.get_paths()['purelib']!r}]; "
            "from agent import cli; cli.build_parser('run').parse_args(['run']); "
            "print('importlib.metadata' in sys.modules)")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "False", out


def test_run_help_types_defaults_choices():
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    text = " ".join(out.getvalue().split())
    assert "--config-source {files,kubernetes}" in text
    assert "--status-port PORT" in text and "(default: 15020; env STATUS_PORT)" in text
    assert "--ztunnel-wait SECONDS" in text and "--host-probe-snat-ip IP" in text
    assert "--workload-registration {none,local,workloadentry}" in text
    assert "--cni-manage-config BOOL" in text and "(default: false;" in text


@pytest.mark.parametrize("text,want", [
    ("127.0.0.1:15020", ("127.0.0.1", 15020)), ("localhost", ("localhost", 99)),
    ("[::1]:8080", ("::1", 8080)), ("[fd00::1]", ("fd00::1", 99)),
    ("http://127.0.0.1:15020/", ("127.0.0.1", 15020))])
def test_addr_forms(text, want):
    assert parse_addr(text, 99) == want


@pytest.mark.parametrize("text,why", [("h:x", "not a number"), ("::1:80", "[ADDR]:PORT"),
                                      ("[::1", "missing ']'"), ("h:0", "port 0 is not between"),
                                      (":80", "HOST:PORT")])
def test_addr_errors(text, why):
    with pytest.raises(argparse.ArgumentTypeError, match=why.replace("[", r"\[")):
        parse_addr(text, 99)


def test_xds_dump_takes_the_addr_form(capsys):
    for addr in ("127.0.0.1:1", "http://127.0.0.1:1"):
        code = cli.main(["xds", "dump", "--addr", addr, "--timeout", "0.5"])
        assert code != 0
        assert "127.0.0.1:1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["xds", "dump", "--addr", "127.0.0.1:x"])
    assert "port 'x' is not a number" in capsys.readouterr().err


def test_every_addr_flag_uses_the_common_parser():
    """Every subcommand's ``--addr`` converts with agent.core.hostport.parse_addr (same form)."""
    parser = cli.build_parser()
    found = 0
    for sub in parser._subparsers._group_actions[0].choices.values():  # noqa: SLF001
        stack = [sub]
        while stack:
            p = stack.pop()
            for action in p._actions:  # noqa: SLF001
                if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
                    stack += list(action.choices.values())
                elif "--addr" in action.option_strings:
                    found += 1
                    assert getattr(action.type, "__name__", "") == "_addr", p.prog
                    assert action.type("[::1]:9") == "[::1]:9"
    assert found >= 1


def test_closed_pipe_no_traceback():
    read, write = os.pipe()
    os.close(read)  # the reader (head) is gone before we write
    proc = subprocess.run([sys.executable, "-m", "agent.cli", "config", "-o", "json",
                           "--config-file", os.devnull], stdout=write, stderr=subprocess.PIPE,
                          cwd=ROOT, timeout=60, text=True)
    os.close(write)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    assert proc.returncode == 141


def test_run_builds_its_parser_without_importing_the_other_subcommands():
    """Fresh interpreter: this test process imported the subcommand modules already."""
    import subprocess
    import sys
    from pathlib import Path
    probe = ("import sys; from agent import cli; cli.build_parser('run').parse_args(['run']); "
             "print(sorted(m for n, (m, _) in cli.SUBCOMMANDS.items() if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
    # the full parser (help, the other subcommands) still has every subcommand's flags
    from agent import cli
    assert callable(cli.build_parser().parse_args(["precheck"]).func)


@pytest.mark.parametrize("argv,usage", [
    (["run", "--bogus"], "usage: ambient-agent run "),
    (["xds", "dump", "--bogus"], "usage: ambient-agent xds dump "),
    (["status", "--bogus"], "usage: ambient-agent status "),
    (["--bogus"], "usage: ambient-agent [-h]"),
])
def test_an_unknown_flag_is_reported_by_its_subcommand(argv, usage, capsys):
    """A fresh-eyes run: ``run --bogus`` printed the top-level usage (no ``run`` flags in
    it) and ``ambient-agent: error``; the subcommand given now reports it, with its own
    usage and name. Exit 2 either way."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.startswith(usage), err
    prog = usage[len("usage: "):].split(" [")[0].strip()
    assert f"{prog}: error: unrecognized arguments: --bogus" in err, err


def test_a_mistyped_flag_is_one_short_error_with_the_nearest_flag(capsys):
    """``run --status-prot 1`` printed ~70 lines of usage (every setting's flag) before
    the one line saying what was wrong (newuser finding): a long usage is replaced by a
    pointer to ``--help`` and the nearest flag is named; a short one stays."""
    from agent import cli
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "--status-prot", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["usage: ambient-agent run [options]  (`ambient-agent run --help` lists them)",
                   "ambient-agent run: error: unrecognized arguments: --status-prot 1 "
                   "(did you mean --status-port?)"]
    with pytest.raises(SystemExit):
        cli.main(["status", "--bogus"])
    err = capsys.readouterr().err
    assert err.startswith("usage: ambient-agent status [-h]") and "did you mean" not in err
