"""CNI network config files: pick the primary one, chain ``istio-cni`` in, take it out.

Pure functions over parsed JSON (no I/O besides reading a directory in
:func:`find_primary`), so every case of ``docs/cni.md`` is a
golden-file test (``tests/cni/testdata/``).

Where we differ from Istio's installer, on purpose:
- A single-plugin ``.conf`` becomes a ``.conflist`` that keeps the ``.conf``'s
  ``cniVersion`` and ``name`` (Istio forces ``0.3.1`` and ``k8s-pod-network``, which
  changes the network name runtimes such as podman select by) and keeps the plugin
  object verbatim, every key included. Our entry records ``converted_from_conf`` so
  uninstall can restore the single-plugin ``.conf``: we remove what we added (the
  restored file has the same JSON content, in this module's formatting).
- Output is Go's ``json.MarshalIndent`` shape Istio writes: sorted keys, 2-space
  indent, trailing newline; so reinstalling gives the same bytes.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from typing import Any

log = logging.getLogger(__name__)

PLUGIN_TYPE = "istio-cni"
CONVERTED_KEY = "converted_from_conf"
DEFAULT_NETWORK_NAME = "k8s-pod-network"
DEFAULT_CNI_VERSION = "0.3.1"
CONFIG_SUFFIXES = (".conf", ".conflist", ".json")


class ConflistError(ValueError):
    """A network config can't be chained into; the message names the file or field."""


def dumps(config: dict) -> bytes:
    """Serialise like Istio (Go MarshalIndent of a map): sorted keys, indent 2, newline."""
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


def is_conflist(config: Any) -> bool:
    return isinstance(config, dict) and "plugins" in config


def rejection_reason(name: str, data: bytes) -> str | None:
    """Why file ``name`` (its bytes) is skipped as a network config, one short phrase
    (``"invalid JSON at line 3: Expecting ',' delimiter"``), or None when it is usable."""
    return _parse_with_reason(name, data)[1]


def _parse_with_reason(name: str, data: bytes) -> tuple[dict | None, str | None]:
    try:
        config = json.loads(data)
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 text ({e.reason} at byte {e.start})"
    except json.JSONDecodeError as e:
        return None, f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}"
    if not isinstance(config, dict):
        return None, f"top level is a JSON {type(config).__name__}, not an object"
    if name.endswith(".conflist"):
        plugins = config.get("plugins")
        if not isinstance(config.get("name"), str) or not config["name"]:
            return None, "field 'name' is missing or empty"
        if not isinstance(plugins, list) or not plugins:
            return None, "field 'plugins' is missing, empty or not an array"
        if not all(isinstance(p, dict) for p in plugins):
            return None, "field 'plugins' holds a non-object entry"
        return config, None
    if not isinstance(config.get("type"), str) or not config["type"]:
        return None, "field 'type' is missing or empty (a single-plugin config needs one)"
    return config, None


def explain_no_primary(conf_dir: str, conf_name: str = "") -> str:
    """One line saying why :func:`find_primary` found nothing in ``conf_dir``: every file
    considered and why it was rejected (``"no valid CNI network config in /etc/cni/net.d:
    10-x.conflist: invalid JSON at line 3 column 1: ..."``)."""
    head = f"no valid CNI network config in {conf_dir}"
    if conf_name:
        head += f" named {conf_name}"
    try:
        names = sorted(os.listdir(conf_dir))
    except FileNotFoundError:
        return f"{head}: the directory does not exist"
    except OSError as e:
        return f"{head}: cannot list it: {e.strerror}"
    if conf_name:
        stem, ext = os.path.splitext(conf_name)
        twins = {".conf": ".conflist", ".conflist": ".conf"}
        wanted = {conf_name} | ({stem + twins[ext]} if ext in twins else set())
        names = [n for n in names if n in wanted]
        if not names:
            return f"{head}: no such file"
    reasons = []
    for name in names:
        path = os.path.join(conf_dir, name)
        if not conf_name and not name.endswith(CONFIG_SUFFIXES):
            continue  # not a config file name: the runtime never reads it either
        if not os.path.isfile(path):
            reasons.append(f"{name}: not a regular file")
            continue
        try:
            with open(path, "rb") as f:
                why = rejection_reason(name, f.read())
        except OSError as e:
            why = f"unreadable: {e.strerror}"
        reasons.append(f"{name}: {why or 'valid'}")
    if not reasons:
        return (f"{head}: the directory has no *.conf, *.conflist or *.json file "
                "(is the primary CNI plugin installed yet?)")
    return f"{head}: " + "; ".join(reasons)


def find_primary(conf_dir: str, conf_name: str = "") -> str | None:
    """The path of the config to chain into, or None when there is none yet.

    ``conf_name`` given: that file, or its ``.conf``/``.conflist`` counterpart (we may have
    renamed it). Otherwise the lexicographically first valid ``*.conf``/``*.conflist``/
    ``*.json`` file, as the runtime picks it (libcni ``ConfFiles`` + sort).
    """
    if conf_name:
        stem, ext = os.path.splitext(conf_name)
        candidates = [conf_name]
        if ext == ".conf":
            candidates.append(stem + ".conflist")
        elif ext == ".conflist":
            candidates.append(stem + ".conf")
        for name in candidates:
            if os.path.isfile(os.path.join(conf_dir, name)):
                return os.path.join(conf_dir, name)
        return None
    try:
        names = sorted(os.listdir(conf_dir))
    except FileNotFoundError:
        return None
    for name in names:
        path = os.path.join(conf_dir, name)
        if not name.endswith(CONFIG_SUFFIXES) or not os.path.isfile(path):
            continue
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            continue
        why = rejection_reason(name, data)
        if why is None:
            return path
        # a runtime skips it too (libcni), but the operator should know why it was passed over
        log.warning("CNI config %s skipped while looking for the primary network: %s",
                    path, why)
    return None


def plugin_entry(run_dir: str, exclude_namespaces: list[str] | None = None,
                 log_level: str = "info", ambient_default: bool = False,
                 pod_namespace: str = "") -> dict:
    """Our plugin's entry (upstream's plugin config keys + ``ambient_default``). ``run_dir``
    holds the
    agent's ``pluginevent.sock``."""
    return {
        "type": PLUGIN_TYPE,
        "name": PLUGIN_TYPE,
        "plugin_log_level": log_level,
        "cni_agent_run_dir": run_dir,
        "ambient_enabled": True,
        "ambient_default": ambient_default,
        "exclude_namespaces": list(exclude_namespaces or []) or None,
        "pod_namespace": pod_namespace,
    }


def insert(existing: Any, entry: dict) -> dict:
    """``existing`` (a parsed ``.conf`` or ``.conflist``) with ``entry`` chained last.

    A list: the first ``istio-cni`` plugin is dropped, ``entry`` appended. A single
    network: wrapped as a list (keeping its ``cniVersion`` and ``name``), marked
    ``converted_from_conf``. Raises :class:`ConflistError` for arrays, non-objects and
    lists without a valid ``plugins`` array (Istio's ``invalid-arr``/``invalid-map`` cases).
    """
    if not isinstance(existing, dict):
        raise ConflistError(f"network config must be a JSON object, got "
                            f"{type(existing).__name__}")
    entry = {k: v for k, v in entry.items() if k != "cniVersion"}
    if "type" in existing and "plugins" not in existing:
        return {
            "cniVersion": existing.get("cniVersion", DEFAULT_CNI_VERSION),
            "name": existing.get("name") or DEFAULT_NETWORK_NAME,
            "plugins": [copy.deepcopy(existing), {**entry, CONVERTED_KEY: True}],
        }
    plugins = existing.get("plugins")
    if not isinstance(plugins, list) or not all(isinstance(p, dict) for p in plugins):
        raise ConflistError(f"network config list has no valid 'plugins' array: "
                            f"{json.dumps(plugins)[:100]}")
    out = copy.deepcopy(existing)
    kept: list[dict] = []
    converted = False
    dropped = False
    for plugin in out["plugins"]:
        if not dropped and plugin.get("type") == PLUGIN_TYPE:
            dropped = True
            converted = bool(plugin.get(CONVERTED_KEY))
            continue
        kept.append(plugin)
    out["plugins"] = kept + [{**entry, CONVERTED_KEY: True} if converted else entry]
    return out


def remove(config: dict) -> tuple[dict, bool]:
    """Undo :func:`insert`: returns ``(config, restore_as_conf)``.

    Every ``istio-cni`` plugin is removed. When our entry says the list was converted
    from a ``.conf`` and exactly one plugin remains, that plugin object (verbatim) is
    returned with ``restore_as_conf=True``.
    """
    if not is_conflist(config) or not isinstance(config.get("plugins"), list):
        return config, False
    ours = [p for p in config["plugins"] if isinstance(p, dict) and p.get("type") == PLUGIN_TYPE]
    rest = [p for p in config["plugins"] if p not in ours]
    if any(p.get(CONVERTED_KEY) for p in ours) and len(rest) == 1:
        return copy.deepcopy(rest[0]), True
    out = copy.deepcopy(config)
    out["plugins"] = rest
    return out, False


def chain_problem(config: Any, entry: dict) -> str | None:
    """Why ``config`` (the primary file, parsed) does not chain our ``entry`` correctly;
    None when it does. Mirrors Istio's ``checkValidCNIConfig`` for the chained mode, and
    also requires our entry to be last (after the interface plugin) and current."""
    if not is_conflist(config):
        return "primary config is a single-plugin .conf (not chained)"
    plugins = config.get("plugins")
    if not isinstance(plugins, list) or not plugins:
        return "primary config has no plugins"
    types = [p.get("type") if isinstance(p, dict) else None for p in plugins]
    if any(not isinstance(t, str) for t in types):
        return "primary config has a plugin without a string type"
    if PLUGIN_TYPE not in types:
        return "istio-cni is missing from the plugin chain"
    if types.count(PLUGIN_TYPE) > 1:
        return "istio-cni appears more than once in the plugin chain"
    last = plugins[-1]
    if last.get("type") != PLUGIN_TYPE:
        return "istio-cni is not the last plugin of the chain"
    want = {k: v for k, v in entry.items() if k != "cniVersion"}
    have = {k: v for k, v in last.items() if k != CONVERTED_KEY}
    if have != want:
        return "istio-cni entry differs from the desired settings"
    return None
