"""Checks across settings, run by :func:`agent.core.config.load` after every value parsed.

:func:`problems` yields ``(setting, reason)`` for each rule a combination of values
breaks, naming the setting the operator most likely has to change; ``load`` raises a
:class:`agent.core.config.ConfigError` for the first with the value as written and where
it came from. Kept apart from the settings table so that one stays a table.
"""

from __future__ import annotations

import os
from typing import Any, Iterator, Mapping

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
