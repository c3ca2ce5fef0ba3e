"""Checks across settings, run by :func:`agent.core.config.load` after every value parsed.

:func:`problems` yields ``(setting, reason)`` for each rule a combination of values
breaks, naming the setting the operator most likely has to change; ``load`` raises a
:class:`agent.core.config.ConfigError` for the first with the value as written and where
it came from. Kept apart from the settings table so that one stays a table.
"""

from __future__ import annotations

import os
from typing import Any, Iterator, Mapping

from agent.core import trusted
from agent.core.config_values import parse_existing_file
from agent.core.scrapetargets import parse_annotations

_UNIX_SOCKETS = ("cni_event_socket", "sds_socket", "ztunnel_uds_address", "admin_socket")
_UNIX_PATH_MAX = 107


def problems(values: Mapping[str, Any], origins: Mapping[str, str]) -> Iterator[tuple[str, str]]:
    """``(setting, reason)`` for each cross-setting rule ``values`` (name -> parsed value)
    break; ``origins`` (name -> ``"default"``, ``"flag --x"``, ...) tells derived defaults
    apart from values an operator gave."""
    if bool(values["ca_cert_file"]) != bool(values["ca_key_file"]):
        one, other = (("ca_cert_file", "ca_key_file") if values["ca_cert_file"]
                      else ("ca_key_file", "ca_cert_file"))
        yield one, f"{other} must be set too (both or neither)"
    # Checked for defaults too: they derive from state_dir, and a long state_dir makes
    # bind() fail later with "AF_UNIX path too long" (sun_path is 108 bytes with NUL).
    for name in _UNIX_SOCKETS:
        if len(os.fsencode(values[name])) > _UNIX_PATH_MAX:
            yield name, (f"Unix socket path longer than {_UNIX_PATH_MAX} bytes"
                         + (" (derived from state_dir: choose a shorter state_dir)"
                            if origins[name] == "default" else ""))
    if values["ca_port"] and values["ca_port"] == values["xds_tls_port"]:
        yield "ca_port", (f"collides with xds_tls_port {values['xds_tls_port']}, which serves "
                          "the CA already (set ca_port 0, or another port for a separate CA "
                          "port)")
    if values["xds_debounce"] > values["xds_debounce_max"]:
        yield "xds_debounce", (f"must not exceed xds_debounce_max "
                               f"({values['xds_debounce_max']:g}s)")
    if origins["prometheus_annotations"] != "default":
        # The status server's parser; needs status_port for the default target.
        try:
            parse_annotations(values["prometheus_annotations"], values["status_port"] or 15020,
                              True)
        except ValueError as e:
            yield "prometheus_annotations", str(e)
    if (values["workload_registration"] == "workloadentry"
            and values["config_source"] != "kubernetes"):
        yield "workload_registration", ("workloadentry needs config_source kubernetes (the "
                                        "API server the WorkloadEntries are written to and "
                                        "watched from)")
    # kubeconfig is read only by the kubernetes source; a stray KUBECONFIG in the
    # operator's shell must not stop an agent that reads files.
    if values["config_source"] == "kubernetes" and values["kubeconfig"]:
        try:
            parse_existing_file(values["kubeconfig"])
        except ValueError as e:
            yield "kubeconfig", str(e)
    if values["tokens_file"]:
        # the TLS ports accept whatever the file maps: a file another user can write
        # (or read) hands out identities (agent.core.trusted; the target of a symlink)
        try:
            problem = trusted.secret_file_path_problem(values["tokens_file"])
        except OSError as e:
            problem = e.strerror or str(e)
        if problem:
            yield "tokens_file", problem + ": it holds bearer tokens"
    yield from _file_trust_checks(values)
    yield from _operator_checks(values, origins)


# files holding a private key: no other user may write or read them (agent.core.trusted)
_SECRET_FILES = {"ca_key_file": "it holds the mesh CA's signing key"}
# certificates and trust bundles: public, but no other user may write them
_PUBLIC_FILES = {"ca_cert_file": "it is the mesh CA's root",
                 "ca_root_cert": "it verifies the Istio CA",
                 "trust_anchors_file": "it adds roots every workload trusts",
                 # bearer tokens: Kubernetes projects them root-owned 0644, so only a
                 # foreign owner or group/other write is refused (a writer could swap in
                 # a token of their choosing)
                 "ca_token_file": "it is the agent's credential to the Istio CA",
                 "xds_token_file": "it is the token plaintext xDS clients must present"}


def _file_trust_checks(values: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """Key files another user owns, may write or read, certificate files and
    ``config_dir`` another user owns or may write (:mod:`agent.core.trusted`; a symlink
    is judged by its target, a path's parents are not judged)."""
    for table, judge in ((_SECRET_FILES, trusted.secret_file_path_problem),
                         (_PUBLIC_FILES, trusted.public_file_path_problem)):
        for name, why in table.items():
            if not values[name]:
                continue
            try:
                problem = judge(values[name])
            except OSError as e:
                problem = e.strerror or str(e)
            if problem:
                yield name, f"{problem}: {why}"
    if values["config_source"] == "files" and os.path.isdir(values["config_dir"]):
        # the files source applies what the directory holds: a writer of it writes policy
        try:
            problem = trusted.dir_problem(values["config_dir"], root_ok=True)
        except OSError as e:
            problem = e.strerror or str(e)
        if problem:
            yield "config_dir", problem + ": its files are the mesh's configuration"


# --- issue 27 "what failed as written": checks an operator met late or as a raw error ---
# (port setting, its bind-address setting; "" = status_address, which means every address)
_PORTS = (("status_port", "status_address"), ("health_port", "status_address"),
          ("monitoring_port", "status_address"), ("xds_port", "xds_address"),
          ("xds_tls_port", "xds_tls_address"), ("ca_port", "ca_listen_address"))
_ANY_ADDRESS = ("", "0.0.0.0", "::", "[::]")


def _operator_checks(values: Mapping[str, Any],
                     origins: Mapping[str, str]) -> Iterator[tuple[str, str]]:
    """Rules whose breach used to surface only at start-up (a port bound twice after
    seconds of start-up, a kubeconfig's YAML parser dump, errno from a missing netns or
    directory, a non-PEM trust anchors file) or not at all (a typo'd ``config_dir`` was
    created empty)."""
    seen: dict[int, tuple[str, str]] = {}
    for port_setting, address_setting in _PORTS:
        port, address = values[port_setting], values[address_setting]
        if not port or (port_setting == "ca_port" and port == values["xds_tls_port"]):
            continue  # off; ca_port == xds_tls_port is reported above
        if port in seen:
            other, other_address = seen[port]
            if (address in _ANY_ADDRESS or other_address in _ANY_ADDRESS
                    or address == other_address):
                yield port_setting, (f"port {port} is also {other}'s: two listeners cannot "
                                     "share a port (choose another, or 0 where it may be off)")
                continue
        seen[port] = (port_setting, address)
    if values["config_source"] == "files" and origins["config_dir"] != "default":
        parent = os.path.dirname(values["config_dir"].rstrip("/")) or "/"
        under_state = (parent + "/").startswith(values["state_dir"].rstrip("/") + "/")
        if not under_state and not os.path.isdir(parent):  # state_dir: the agent creates it
            yield "config_dir", (f"its parent directory {parent} does not exist (a typo? the "
                                 "agent creates only the last component of config_dir)")
    if values["host_rules_netns"]:
        why = _netns_file_problem(values["host_rules_netns"])
        if why:
            yield "host_rules_netns", why
    if values["config_source"] == "kubernetes" and values["kubeconfig"] and os.path.isfile(
            values["kubeconfig"]):
        why = _kubeconfig_problem(values["kubeconfig"])
        if why:
            yield "kubeconfig", why
    if values["trust_anchors_file"]:
        why = _pem_certificates_problem(values["trust_anchors_file"])
        if why:
            yield "trust_anchors_file", why


def _netns_file_problem(path: str) -> str:
    """Why the netns file ``path`` can't be used ("" when it may): missing, or not
    reachable by this user (``/proc/1/ns/net`` as non-root is EACCES, not missing)."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return "no such network namespace file"
    except PermissionError:
        return (f"permission denied (EACCES) reading {path}: the agent needs root (or "
                "CAP_SYS_ADMIN and CAP_NET_ADMIN) to enter a network namespace")
    except OSError as e:
        return f"cannot use it: {e.strerror or e}"
    return ""


def _kubeconfig_problem(path: str) -> str:
    """Why ``path`` is no kubeconfig ("" when it looks like one): one line, never the
    parser's multi-line dump (which may quote a token)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        return "malformed YAML" + (f" at line {mark.line + 1}" if mark else "")
    except (OSError, UnicodeDecodeError) as e:
        return f"cannot read it: {getattr(e, 'strerror', None) or e}"
    if not isinstance(data, dict):
        return "not a kubeconfig: the top level must be a mapping (clusters, users, contexts)"
    if not data.get("clusters") or not isinstance(data.get("clusters"), list):
        return "not a kubeconfig: no clusters list"
    return ""


def _pem_certificates_problem(path: str) -> str:
    """Why ``path`` holds no PEM certificates ("" when it holds at least one and all parse)."""
    from cryptography import x509

    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        return f"cannot read it: {e.strerror or e}"
    if b"-----BEGIN CERTIFICATE-----" not in data:
        return "no PEM certificate in it (expected -----BEGIN CERTIFICATE----- blocks)"
    try:
        x509.load_pem_x509_certificates(data)
    except ValueError as e:
        return f"a PEM certificate in it does not parse ({str(e).splitlines()[0][:120]})"
    return ""
