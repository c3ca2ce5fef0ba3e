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
import sys
from importlib import metadata

from agent import config as agent_config
from agent.errors import ComponentStartError

# name -> (module, help). The module provides add_arguments(parser) and main(args).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("agent.demo", "bring up a node in a box: agent, CNI network, pods, ztunnel, Envoy"),
    "status": ("agent.status.cli", "show a running agent's pods, ztunnels, certificates, xDS clients"),
    "precheck": ("agent.precheck", "check that this node is ready for ambient mode (one line per "
                 "check; exit 1 if any fails)"),
    "cni": ("cni.install", "install or uninstall the istio-cni plugin and its conflist entry"),
    "xds": ("ambient.xds_cli", "dump what a workload xDS server serves (as a ztunnel-like client)"),
}


def version_string() -> str:
    try:
        return metadata.version("ambient-node-agent")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per setting; values stay raw strings until :func:`agent.config.load`."""
    group = parser.add_argument_group("settings (flag > env > config file > default)")
    for s in agent_config.SETTINGS:
        group.add_argument(s.flag, dest=s.name, default=None, metavar="VALUE",
                           help=f"{s.help} [env {s.env_name}]")


def load_config(args: argparse.Namespace) -> agent_config.Config:
    flags = {s.name: getattr(args, s.name, None) for s in agent_config.SETTINGS}
    return agent_config.load(flags)


def cmd_run(args: argparse.Namespace) -> int:
    from agent import daemon, logsetup

    config = load_config(args)
    logsetup.setup(config.log_level, config.log_format)
    return asyncio.run(daemon.run(config))


def cmd_config(args: argparse.Namespace) -> int:
    config = load_config(args)
    if args.output == "json":
        print(json.dumps(config.as_dict(), indent=2, default=str))
        return 0
    width = max(len(n) for n in config.values)
    for name, entry in config.as_dict().items():
        value = entry["value"]
        shown = json.dumps(value) if isinstance(value, (list, dict)) else value
        print(f"{name:<{width}}  {shown}  ({entry['source']})")
    return 0


def cmd_version(args: argparse.Namespace) -> int:
    print(f"ambient-agent {version_string()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ambient-agent",
        description="Istio ambient-mode node agent: CNI, ZDS, SDS, status and workload xDS.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser("run", help="run the node agent daemon")
    add_setting_flags(run)
    run.set_defaults(func=cmd_run)
    cfg = sub.add_parser("config", help="print the effective configuration and its sources")
    add_setting_flags(cfg)
    cfg.add_argument("-o", "--output", choices=["text", "json"], default="text")
    cfg.set_defaults(func=cmd_config)
    ver = sub.add_parser("version", help="print the version")
    ver.set_defaults(func=cmd_version)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text)
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
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
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
