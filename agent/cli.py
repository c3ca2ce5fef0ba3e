"""``ambient-agent``: the daemon and its operator tools.

Subcommands register themselves in ``SUBCOMMANDS`` (name -> module path). Each module
defines ``add_arguments(parser)`` and ``main(args) -> int``. Every module is imported to
build the parser, so each keeps its top-level imports light (heavy ones inside ``main``)
and ``ambient-agent version`` stays instant.

User errors (bad flags, bad config values, unusable state dir) exit non-zero with one
line naming the setting, the value and the reason; never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import re
import sys
from typing import Any, NoReturn

from agent.core import config as agent_config
from agent.core.errors import ComponentStartError

# name -> (module, help). The module provides add_arguments(parser) and main(args).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("agent.demo.cli", "bring up a node in a box: agent, CNI network, pods, ztunnel, Envoy"),
    "status": ("agent.status.cli", "show a running agent's pods, ztunnels, certificates, xDS clients"),
    "precheck": ("agent.precheck", "check that this node is ready for ambient mode (one line per "
                 "check; exit 1 if any fails)"),
    "cni": ("cni.install", "install or uninstall the istio-cni plugin and its conflist entry"),
    "xds": ("ambient.xds.cli", "dump what a workload xDS server serves (as a ztunnel-like client)"),
    # the operator's kit (issue 27)
    "log-level": ("agent.status.loglevel", "show or change a running agent's log levels "
                  "(SCOPE=LEVEL ...), no restart"),
    "ztunnel-config": ("agent.status.ztunnelconfig", "ztunnel's workloads, services, policies, "
                       "certificates or connections (its config_dump) joined with this agent's view"),
    "cleanup": ("cni.cleanup", "decommission this node (agent stopped): in-pod and host rules, "
                "sets, the conflist entry, the plugin, state; --dry-run"),
    "waypoint": ("ambient.waypoint.cli", "print the Envoy bootstrap of a waypoint this agent serves"),
}


def version_string() -> str:
    """The installed distribution's version (``0+unknown`` when not installed).
    ``importlib.metadata`` is imported here, not at the top: importing it costs ~50 ms,
    which every ``run`` would otherwise pay before its first LIST (issue 28)."""
    from importlib import metadata
    try:
        return metadata.version("ambient-node-agent")
    except metadata.PackageNotFoundError:
        return "0+unknown"


class VersionAction(argparse.Action):
    """``--version``: print ``ambient-agent <version>`` to stdout and exit 0, as
    argparse's own ``version`` action does, with the version looked up only when the flag
    is given (that action takes the string when the parser is built, at every start)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS,
                 default: Any = argparse.SUPPRESS, help: str = "show the version and exit"):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, _option_string: str | None = None) -> None:
        print(f"ambient-agent {version_string()}")
        parser.exit()


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per setting; values stay raw strings until :func:`agent.core.config.load`.
    The help names the value's kind or choices, the default and the environment variable."""
    group = parser.add_argument_group("settings (flag > env > config file > default)")
    for s in agent_config.SETTINGS:
        group.add_argument(s.flag, dest=s.name, default=None, metavar=s.metavar,
                           help=f"{s.help} (default: {s.shown_default}; "
                                f"env {s.env_name})".replace("%", "%%"))


def shown_default(value: object) -> str:
    """A flag's default as ``--help`` shows it: ``none`` for None, "" or an empty list,
    ``a,b`` for a list or tuple, ``true``/``false`` for a bool, else ``str(value)``."""
    if value is None or value == "" or (isinstance(value, (list, tuple)) and not value):
        return "none"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """``--help`` with every value-taking flag's default: a help text that does not name
    its default already (``default:`` or ``%(default)s``) gets `` (default: X)``
    appended (:func:`shown_default`). Switches (``store_true``...) take no value and are
    left as written. Unlike ``argparse.ArgumentDefaultsHelpFormatter`` it shows ``none``
    rather than ``None`` and does not repeat a default the text states."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.nargs == 0 or action.required
                or _STATES_DEFAULT.search(text) or "%(default)" in text
                or action.default is argparse.SUPPRESS):
            return text
        # the text is a %-template already (its own % doubled); the default is not
        return text + f" (default: {shown_default(action.default)})".replace("%", "%%")


#: a help text that names its default in words ("default 15010", "(default)", "default:")
_STATES_DEFAULT = re.compile(r"\bdefault\b", re.IGNORECASE)


USAGE_LINES = 8  # a longer usage is replaced by a pointer to --help in error messages


class Parser(argparse.ArgumentParser):
    """The CLI's parser class: :class:`DefaultsHelpFormatter` unless told otherwise.
    Subparsers (``add_subparsers``) are of the parser's own class, so every subcommand,
    nested ones too (``xds dump``, ``cni install``), shows its flags' defaults."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_args(  # type: ignore[override]
            self, args: Any = None, namespace: Any = None) -> argparse.Namespace:
        """As argparse's, but an unknown flag is reported by the subcommand it was given
        to (``ambient-agent run --bogus`` prints ``run``'s usage and names ``run``), not
        by the top-level parser, whose usage lists no subcommand's flags."""
        ns, extra = self.parse_known_args(args, namespace)
        if extra:
            parser = self.innermost(ns)
            flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
            unknown = next((e.split("=", 1)[0] for e in extra if e.startswith("--")), "")
            close = agent_config.closest(unknown, flags) if unknown else None
            hint = f" (did you mean {close}?)" if close else ""
            parser.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
        return ns

    def error(self, message: str) -> NoReturn:
        """argparse's error (exit 2, ``prog: error: message`` on stderr), with the usage
        only when it is short: ``run``'s names every setting's flag (~70 lines), which
        buried the one line that says what was wrong."""
        usage = self.format_usage()
        if usage.count("\n") <= USAGE_LINES:
            self.print_usage(sys.stderr)
        else:
            print(f"usage: {self.prog} [options]  (`{self.prog} --help` lists them)",
                  file=sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")

    def innermost(self, ns: argparse.Namespace) -> argparse.ArgumentParser:
        """The (sub)parser that parsed the last subcommand named in ``ns``; this parser
        when none was (or a subparsers group has no ``dest`` to tell which)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = getattr(ns, action.dest, None) if action.dest else None
                parser = action.choices.get(chosen) if chosen else None
                if isinstance(parser, Parser):
                    return parser.innermost(ns)
                if parser is not None:
                    return parser
        return self


def load_config(args: argparse.Namespace) -> agent_config.Config:
    flags = {s.name: getattr(args, s.name, None) for s in agent_config.SETTINGS}
    return agent_config.load(flags)


def cmd_run(args: argparse.Namespace) -> int:
    from agent import daemon
    from agent.core import logsetup

    config = load_config(args)
    logsetup.setup(config.log_level, config.log_format)
    return daemon.stopped(asyncio.run(daemon.run(config)))


def cmd_config(args: argparse.Namespace) -> int:
    config = load_config(args)
    if args.output == "json":
        print(json.dumps(config.as_dict(), indent=2, default=str))
        return 0
    width = max(len(n) for n in config.values)
    for name, entry in config.as_dict().items():
        value = entry["value"]
        shown = json.dumps(value) if isinstance(value, (tuple, list, dict)) else value
        print(f"{name:<{width}}  {shown}  ({entry['source']})")
    return 0


def cmd_version(args: argparse.Namespace) -> int:
    print(f"ambient-agent {version_string()}")
    return 0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with ``command`` (the subcommand given), the modules of the
    other subcommands in :data:`SUBCOMMANDS` are not imported (their parsers are listed,
    empty): ``run`` then starts without the status and xDS clients' imports (~15 % of a
    5k-pod cold start's samples at load ~20, py-spy)."""
    parser = Parser(
        prog="ambient-agent",
        description="Istio ambient-mode node agent: CNI, ZDS, SDS, status and workload xDS.")
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser("run", help="run the node agent daemon")
    add_setting_flags(run)
    run.set_defaults(func=cmd_run)
    cfg = sub.add_parser("config", help="print the effective configuration and its sources")
    add_setting_flags(cfg)
    cfg.add_argument("-o", "--output", choices=["text", "json"], default="text",
                     help="text: one line per setting with its value and source; json: an "
                          "object of {value, source} per setting")
    cfg.set_defaults(func=cmd_config)
    ver = sub.add_parser("version", help="print the version")
    ver.set_defaults(func=cmd_version)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if command is None or command == name:
            module = importlib.import_module(module_name)
            p.set_defaults(func=module.main)
            module.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    # The agent forks helpers (iptables-restore, nft) while gRPC threads run; none of the
    # children use gRPC, so gRPC's fork handlers would only add noise and risk.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    # gRPC's C core logs to stderr on its own (e.g. a failed TLS handshake of a stray
    # client); keep that to errors so the agent's own log stays the one to read.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    words = sys.argv[1:] if argv is None else argv
    given = next((w for w in words if not w.startswith("-")), None)
    # the built-in commands need no other subcommand's module; anything else builds all
    parser = build_parser(given if given in ("run", "config", "version") else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except BrokenPipeError:
        # `ambient-agent config | head`: the reader left; not an error worth a traceback.
        # Point stdout at /dev/null so the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141  # 128 + SIGPIPE, what a shell reports for a killed writer
    except agent_config.ConfigError as e:
        print(f"ambient-agent: {e}", file=sys.stderr)
        return 2
    except ComponentStartError as e:
        print(f"ambient-agent: cannot start {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
