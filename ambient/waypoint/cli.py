"""``ambient-agent waypoint bootstrap --gateway NS/NAME``: print the Envoy bootstrap of a
waypoint served by this agent (JSON on stdout, :func:`ambient.waypoint.bootstrap.bootstrap`).

Exit 0 on success, 2 for bad arguments (argparse) or an unreadable ``--ca``/``--token-file``
(one line on stderr naming the option and the file).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import sys

from agent.core.config_values import DNS_SUBDOMAIN, check_namespace, parse_service_account
from ambient.waypoint.bootstrap import BootstrapOptions, bootstrap


def _gateway(text: str) -> tuple[str, str]:
    """``NS/NAME``, each as Kubernetes names them: both end up in the ``~``-separated node
    id and the Envoy cluster name, where a ``~`` or a newline would change their meaning."""
    ns, sep, name = text.partition("/")
    if not sep or not ns or not name or "/" in name:
        raise argparse.ArgumentTypeError(f"--gateway must be NAMESPACE/NAME, got {text!r}")
    try:
        check_namespace(ns)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--gateway: {e}") from None
    return ns, _name(name, "--gateway NAME")


def _name(text: str, option: str) -> str:
    if len(text) > 253 or not DNS_SUBDOMAIN.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{option} {text!r} is not a Kubernetes name (DNS-1123 subdomain: lowercase "
            "letters, digits, '-' and '.', at most 253 characters)")
    return text


def _pod_name(text: str) -> str:
    return _name(text, "--pod-name") if text else ""  # "": the default, NAME-0


def _service_account(text: str) -> str:
    try:
        return parse_service_account(text)  # "": the Gateway's name
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--service-account {text!r}: {e}") from None


def _hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not host:
        raise argparse.ArgumentTypeError(f"--xds-address must be HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"must be a TCP port 1-65535, got {text!r}")
    return int(text)


def _ip(text: str) -> str:
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an IP address: {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="waypoint_command", metavar="ACTION", required=True)
    b = sub.add_parser("bootstrap", help="print a waypoint Envoy's bootstrap (JSON)")
    b.add_argument("--gateway", required=True, type=_gateway, metavar="NS/NAME",
                   help="the waypoint Gateway this Envoy serves")
    b.add_argument("--xds-address", default=("127.0.0.1", 15010), type=_hostport,
                   metavar="HOST:PORT", help="the agent's xDS port (default 127.0.0.1:15010)")
    b.add_argument("--ca", help="mesh root PEM: connect with TLS (the agent's TLS port)")
    b.add_argument("--token-file", help="bearer token sent as authorization on the stream")
    b.add_argument("--server-name", default="istiod.istio-system.svc",
                   help="name checked in the agent's certificate (default %(default)s)")
    b.add_argument("--admin-port", type=_port, default=15000, help="Envoy admin port on 127.0.0.1")
    b.add_argument("--node-ip", type=_ip, default="127.0.0.1", help="IP in the node id")
    b.add_argument("--pod-name", default="", type=_pod_name,
                   help="pod name in the node id (default NAME-0)")
    b.add_argument("--service-account", default="", type=_service_account,
                   help="SERVICE_ACCOUNT (default the "
                   "Gateway name, as istio's waypoint Deployments)")
    b.add_argument("--hbone-bind", type=_ip, default=None,
                   help="address connect_terminate listens on (default 0.0.0.0)")
    b.add_argument("--sotw", action="store_true", help="state-of-the-world ADS (default delta)")


def _read(path: str | None, option: str) -> str:
    if not path:
        return ""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() if option == "--token-file" else f.read()
    except OSError as e:
        print(f"ambient-agent waypoint: {option} {path}: {e.strerror or e}", file=sys.stderr)
        raise SystemExit(2) from None


def main(args: argparse.Namespace) -> int:
    ns, name = args.gateway
    host, port = args.xds_address
    opts = BootstrapOptions(
        namespace=ns, gateway=name, xds_host=host, xds_port=port,
        ca_pem=_read(args.ca, "--ca"), token=_read(args.token_file, "--token-file"),
        server_name=args.server_name, admin_port=args.admin_port, node_ip=args.node_ip,
        pod_name=args.pod_name, service_account=args.service_account,
        hbone_bind=args.hbone_bind or "", delta=not args.sotw)
    json.dump(bootstrap(opts), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0
