"""``ambient-agent xds dump``: connect to a workload xDS server as a ztunnel-like delta
client and print what it serves as JSON (``google.protobuf.json_format``).

Output: ``{"<type URL>": {"<resource name>": {...message as JSON...}}}``. Exit 0 on
success, 1 when the server could not be reached or refused the stream (one line on
stderr with the gRPC status), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import ipaddress
import json
import os
import sys
from typing import Any

import grpc
from google.protobuf import json_format

from agent.core.argtypes import positive_seconds
from ambient.xds.client import DEFAULT_NODE_ID, ClientTls, DeltaXdsClient
from ambient.xds.generators import SHORT_NAMES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="xds_command", metavar="ACTION", required=True)
    dump = sub.add_parser("dump", help="print the resources a workload xDS server serves")
    dump.add_argument("--addr", default="127.0.0.1:15010", type=_addr,
                      help="the xDS server, HOST:PORT (default %(default)s)")
    dump.add_argument("--type", dest="types", action="append", default=[],
                      choices=sorted(SHORT_NAMES) + ["all"],
                      help="resource type (repeatable; default: address and authorization)")
    dump.add_argument("--node-id", default=DEFAULT_NODE_ID, help="Node.id to present")
    dump.add_argument("--node-name", default="", help="NODE_NAME node metadata")
    dump.add_argument("--on-demand", action="append", default=[], metavar="KEY",
                      help="instead of wildcard, look up KEY (network/IP, ns/hostname or uid)")
    dump.add_argument("--ca", help="mesh root PEM (enables TLS)")
    dump.add_argument("--cert", help="client certificate chain PEM (mTLS)")
    dump.add_argument("--key", help="client private key PEM (mTLS)")
    dump.add_argument("--server-name", help="TLS name to verify instead of the address host")
    dump.add_argument("--token-file", help="send 'authorization: Bearer <file content>'")
    dump.add_argument("--timeout", type=positive_seconds, default=10.0,
                      help="seconds to wait for the server (default %(default)s)")


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


async def dump(args: argparse.Namespace) -> dict:
    names = args.types or ["address", "authorization"]
    types = list(SHORT_NAMES.values()) if "all" in names else [SHORT_NAMES[n] for n in names]
    tls = None
    if args.ca:
        tls = ClientTls(_read(args.ca) or b"", _read(args.cert), _read(args.key), args.server_name)
    token = (_read(args.token_file) or b"").decode().strip() if args.token_file else None
    metadata = {"NODE_NAME": args.node_name} if args.node_name else {}
    client = DeltaXdsClient(args.addr, node_id=args.node_id, metadata=metadata, tls=tls,
                            token=token, types=types, on_demand=bool(args.on_demand))
    try:
        await client.connect()
        await client.wait_synced(args.timeout)
        for key in args.on_demand:
            for type_url in types:
                if type_url in (SHORT_NAMES["address"], SHORT_NAMES["workload"]):
                    await client.request(key, type_url, args.timeout)
        lookups = [t for t in types if t in (SHORT_NAMES["address"], SHORT_NAMES["workload"])]
        args.missed = [key for key in args.on_demand
                       if lookups and not any(key in client.resources(t) for t in lookups)]
        return {t: {name: readable(json_format.MessageToDict(msg))
                    for name, msg in sorted(client.resources(t).items())} for t in types}
    finally:
        await client.close()


def _addr(text: str) -> str:
    """``--addr`` as every subcommand takes it (:func:`agent.core.hostport.parse_addr`)."""
    from agent.core.hostport import format_addr, parse_addr

    return format_addr(*parse_addr(text, 15010))


_IP_FIELDS = {"address", "addresses"}


def readable(value: Any) -> Any:
    """JSON of a workload/authorization message with IP ``bytes`` fields (``address``,
    ``addresses``; 4 or 16 bytes, base64 in proto JSON) shown as IP text."""
    if isinstance(value, dict):
        return {k: (_ip_text(v) if k in _IP_FIELDS else readable(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [readable(v) for v in value]
    return value


def _ip_text(value: Any) -> Any:
    if isinstance(value, list):
        return [_ip_text(v) for v in value]
    if not isinstance(value, str):
        return readable(value)
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return value
    return str(ipaddress.ip_address(raw)) if len(raw) in (4, 16) else value


def main(args: argparse.Namespace) -> int:
    try:
        for path in (args.ca, args.cert, args.key, args.token_file):
            _read(path)
    except OSError as e:
        print(f"ambient-agent xds: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    problem = _pem_problem(args)
    if problem:
        print(f"ambient-agent xds: {problem}", file=sys.stderr)
        return 2
    args.missed = []
    try:
        out = asyncio.run(dump(args))
    except grpc.RpcError as e:
        print(f"ambient-agent xds: {args.addr}: {e.code().name}: {e.details()}"
              f"{_hint(args, e.code())}", file=sys.stderr)
        return 1
    except (TimeoutError, asyncio.TimeoutError):
        print(f"ambient-agent xds: {args.addr}: no response within {args.timeout}s",
              file=sys.stderr)
        return 1
    try:
        json.dump(out, sys.stdout, indent=2, sort_keys=True)
        print(flush=True)
    except BrokenPipeError:  # `| head`: the reader is gone, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    for key in args.missed:
        print(f"ambient-agent xds: --on-demand {key}: {args.addr} has no address or workload "
              "by that name", file=sys.stderr)
    return 1 if args.missed else 0


def _hint(args: argparse.Namespace, code: grpc.StatusCode) -> str:
    """What the usual cause of a failed call is, for the two ways of getting the agent's
    TLS port wrong ("" when neither applies): without ``--ca`` the TLS port just closes
    the plaintext connection (UNAVAILABLE "Socket closed"); with it but no credentials
    the agent refuses the call, which the client may only see as INTERNAL."""
    if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL,
                    grpc.StatusCode.UNAUTHENTICATED):
        return ""
    if not args.ca:
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return ""
        return (" (if this is the agent's TLS port, 15012 by default, pass --ca <mesh root "
                "PEM>; the plaintext port is 15010)")
    if not args.cert and not args.token_file:
        return (" (the TLS port needs a client certificate, --cert/--key, or a bearer "
                "token, --token-file; neither was given: the agent's log names the reason)")
    return ""


def _pem_problem(args: argparse.Namespace) -> str:
    """Why ``--ca``/``--cert``/``--key`` can't be used ("" when they can): checked before
    gRPC sees them, whose own refusal is several C-core log lines."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    for flag, path in (("--ca", args.ca), ("--cert", args.cert)):
        if not path:
            continue
        data = _read(path) or b""
        try:
            if b"-----BEGIN CERTIFICATE-----" not in data:
                raise ValueError("no -----BEGIN CERTIFICATE----- block")
            x509.load_pem_x509_certificates(data)
        except ValueError as e:
            return f"{flag} {path}: not a PEM certificate ({str(e).splitlines()[0][:100]})"
    if args.key:
        try:
            serialization.load_pem_private_key(_read(args.key) or b"", password=None)
        except (ValueError, TypeError) as e:
            return f"--key {args.key}: not an unencrypted PEM private key ({str(e)[:100]})"
    if bool(args.cert) != bool(args.key):
        return "--cert and --key go together"
    return ""
