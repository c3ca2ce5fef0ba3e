"""One logging setup for the whole agent: text or JSON lines, a level per component.

``--log-level`` takes a default level and optional per-scope overrides, in the style of
Istio's ``--log_output_level``: ``"info"``, ``"info,zds:debug,sds:warning"``.

Every module logs through ``logging.getLogger(__name__)``, so a logger's name is its
module path and a scope is a package or module path (``zds``, ``cni.enrollment``,
``agent.sds.cache``). The subpackages of ``agent`` also answer to their short name
(:data:`SCOPE_ALIASES`: ``sds`` = ``agent.sds``, ``status`` = ``agent.status``), which
is the form the README documents. Third-party libraries (:data:`THIRD_PARTY`) stay at
WARNING or above unless a scope names them (``debug,pyroute2:debug``), so ``--log-level
debug`` shows the agent's own records, not pyroute2's netlink traffic.

Levels change at run time without a restart (:func:`change_levels`, served as ``POST
/logging`` on the admin socket in the form of ztunnel's admin ``/logging``, and by
``ambient-agent log-level``). A library may reset its own loggers' levels (pyroute2 sets
its root logger to 0 on import), so the handler also carries a :class:`ScopeFilter`
that drops third-party records below their scope's level whatever the logger says.

A redaction filter runs on every record: PEM private keys and bearer tokens are
replaced by ``[REDACTED]`` so they never reach a log line, whatever a caller passes.
A repeat filter (:class:`agent.core.ratelimit.RepeatFilter`) lets an identical WARNING-or-worse
line through once a minute and counts the rest, so nothing can flood the log.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time

from agent.core.ratelimit import RepeatFilter

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING,
          "warning": logging.WARNING, "error": logging.ERROR, "none": logging.CRITICAL + 10}

_PEM_KEY = re.compile(r"-----BEGIN ([A-Z ]*)PRIVATE KEY-----.*?(-----END \1PRIVATE KEY-----|$)",
                      re.S)
_BEARER = re.compile(r"(?i)(bearer\s+)[A-Za-z0-9\-._~+/]+=*")
# A JWT on its own (header.payload.signature, base64url; the header is always a JSON
# object, so it starts "eyJ"), wherever it appears.
_JWT = re.compile(r"\beyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]*")
_FIELD = r'"?(?:token|private_key|authorization)"?\s*[:=]\s*'
# The value of a token-like field, unless it is the auth scheme word itself ("Bearer",
# whose token _BEARER has already replaced; "no 'authorization: Bearer' token" keeps
# its meaning) or an earlier replacement. A quoted value is replaced up to its closing
# quote (spaces included); an unquoted authorization value with another scheme
# ("Basic <credentials>") loses the scheme and the credentials.
_TOKEN_QUOTED = re.compile(r"(?i)(" + _FIELD + r"([\"']))(?!bearer\b|\[REDACTED)"
                           r"(?:\\.|(?!\2).)*\2")
_AUTH_SCHEME = re.compile(r"(?i)(authorization\s*[:=]\s*)(?!bearer\b|\[REDACTED)"
                          r"[A-Za-z][A-Za-z0-9-]*\s+[^\",\s}]+")
_TOKEN_FIELD = re.compile(r"(?i)(" + _FIELD + r")(?!bearer\b|\[REDACTED)[^\",\s}]+")


def redact(text: str) -> str:
    """Replace private keys and tokens in ``text`` with ``[REDACTED]``: PEM private key
    blocks (also one cut short), ``Bearer <token>``, a JWT anywhere, and the value of a
    ``token`` / ``private_key`` / ``authorization`` field (``k=v``, ``k: v``, JSON
    ``"k": "v"``, quoted values whole)."""
    text = _PEM_KEY.sub("[REDACTED PRIVATE KEY]", text)
    text = _BEARER.sub(r"\1[REDACTED]", text)
    text = _JWT.sub("[REDACTED]", text)
    text = _TOKEN_QUOTED.sub(r"\1[REDACTED]\2", text)
    text = _AUTH_SCHEME.sub(r"\1[REDACTED]", text)
    return _TOKEN_FIELD.sub(r"\1[REDACTED]", text)


class RedactingFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (RFC 3339, UTC), level, scope (logger), msg, error."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "scope": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["error"] = redact(record.exc_text or self.formatException(record.exc_info))
        return json.dumps(entry, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        # Redact the whole line: another handler may already have cached an
        # unredacted traceback in record.exc_text.
        return redact(super().format(record))


# Our top-level packages: a scope is one of them or a dotted path below one.
PACKAGES = ("agent", "cni", "zds", "ambient")
# Short scope names for the subpackages of ``agent`` (what the README documents).
SCOPE_ALIASES = {"sds": "agent.sds", "status": "agent.status"}
# Libraries whose loggers stay at WARNING+ unless named in the level spec.
THIRD_PARTY = ("asyncio", "aiohttp", "aiohttp.access", "pyroute2", "watchfiles", "grpc",
               "kubernetes_asyncio", "urllib3")


LEVEL_SPEC_MAX = 1024  # characters of a level spec: the agent's scopes fit many times over
_QUOTE_MAX = 60  # characters of a bad clause quoted back in an error


def _quoted(text: str) -> str:
    """``repr`` of ``text``, cut to :data:`_QUOTE_MAX` characters (an error names the part,
    never echoes kilobytes)."""
    return repr(text if len(text) <= _QUOTE_MAX else text[:_QUOTE_MAX] + "...")


def logger_name(scope: str) -> str:
    """The logger a scope controls: ``"sds"`` -> ``"agent.sds"``, ``"zds.server"`` ->
    ``"zds.server"``. Raises ValueError naming the scope when it is none of ours nor a
    known library (a typo would otherwise silently change nothing)."""
    name = SCOPE_ALIASES.get(scope, scope)
    top = name.split(".", 1)[0]
    if top in PACKAGES or name in THIRD_PARTY or top in THIRD_PARTY:
        return name
    known = ", ".join([*PACKAGES, *SCOPE_ALIASES, *THIRD_PARTY])
    raise ValueError(f"unknown log scope {_quoted(scope)} (use one of {known}, or a module path below one)")


def parse_levels(spec: str, default: int = logging.INFO) -> tuple[int, dict[str, int]]:
    """``"info,sds:debug"`` -> ``(INFO, {"agent.sds": DEBUG})``: the default level and the
    level per logger name (aliases resolved). A clause is ``LEVEL`` (the default) or
    ``SCOPE:LEVEL``; ``SCOPE=LEVEL`` (ztunnel's form) is the same. ``default`` is the
    level when the spec names none. Raises ValueError naming the bad part (quoted at most
    60 characters), or the length when the spec is over :data:`LEVEL_SPEC_MAX` characters."""
    if len(spec) > LEVEL_SPEC_MAX:
        raise ValueError(f"level spec is {len(spec)} characters, more than the "
                         f"{LEVEL_SPEC_MAX} allowed")
    per: dict[str, int] = {}
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        name, sep, level = part.replace("=", ":").rpartition(":")
        if sep and not name.strip():
            # "=debug" or ":debug" is a typo for a scope, not the default level: say so
            which = "=" if "=" in part else ":"
            raise ValueError(f"no scope before {which!r} in "
                             f"{_quoted(part)} (write LEVEL or SCOPE:LEVEL)")
        if level.lower() not in LEVELS:
            raise ValueError(f"unknown level {_quoted(level)} in {_quoted(part)} "
                             f"(use debug, info, warn, error, none)")
        if name:
            per[logger_name(name.strip())] = LEVELS[level.lower()]
        else:
            default = LEVELS[level.lower()]
    return default, per


def setup(level_spec: str = "info", fmt: str = "text", stream=None) -> None:
    """Configure the root logger once (idempotent: replaces our previous handler). The
    levels given here are the start-up levels that ``change_levels(reset=True)`` returns to."""
    default, per = parse_levels(level_spec)
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_ambient_agent", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler._ambient_agent = True  # type: ignore[attr-defined]
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(ScopeFilter())
    handler.addFilter(RedactingFilter())
    handler.addFilter(RepeatFilter())
    root.addHandler(handler)
    _STARTUP.clear()
    _STARTUP.update({"": default, **per})
    _apply(default, per)


def _apply(default: int, per: dict[str, int]) -> None:
    """Set the root level, the named loggers' levels and the third-party floors."""
    logging.getLogger().setLevel(default)
    # A second setup() (tests, the demo) must not keep the first one's per-scope levels.
    for name in _SCOPED:
        if name not in per:
            logging.getLogger(name).setLevel(logging.NOTSET)
    _SCOPED.clear()
    for name, level in per.items():
        logging.getLogger(name).setLevel(level)
        _SCOPED.add(name)
    # Library chatter stays at warning unless asked for by name.
    for noisy in THIRD_PARTY:
        if noisy not in per:
            logging.getLogger(noisy).setLevel(max(default, logging.WARNING))
    _THIRD_PARTY_LEVELS.clear()
    _THIRD_PARTY_LEVELS.update({name: level for name, level in per.items()
                                if name.split(".", 1)[0] in _THIRD_PARTY_TOPS})
    _THIRD_PARTY_LEVELS[""] = max(default, logging.WARNING)


_SCOPED: set[str] = set()
_STARTUP: dict[str, int] = {}  # "" -> the default level; logger name -> level, from setup()
_THIRD_PARTY_TOPS = {name.split(".", 1)[0] for name in THIRD_PARTY}
# What ScopeFilter lets through from libraries: "" -> the floor, else a named scope's level.
_THIRD_PARTY_LEVELS: dict[str, int] = {"": logging.WARNING}


class ScopeFilter(logging.Filter):
    """Drops a third-party record below its scope's level: the most specific named scope
    (``pyroute2.netlink`` over ``pyroute2``), else WARNING or the default if higher. Our
    own records pass (their loggers' levels already decided)."""

    def filter(self, record: logging.LogRecord) -> bool:
        name = record.name
        if name.split(".", 1)[0] not in _THIRD_PARTY_TOPS:
            return True
        levels = _THIRD_PARTY_LEVELS
        while name:
            if name in levels:
                return record.levelno >= levels[name]
            name = name.rpartition(".")[0]
        return record.levelno >= levels[""]


def level_name(level: int) -> str:
    """``logging.DEBUG`` -> ``"debug"``; above CRITICAL -> ``"none"``."""
    if level > logging.CRITICAL:
        return "none"
    return {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warn",
            logging.ERROR: "error", logging.CRITICAL: "error"}.get(level, str(level))


def current_levels() -> dict[str, str]:
    """The levels in force: ``{"": "info", "agent.sds": "debug", ...}`` (``""`` is the
    default; only scopes set by name are listed, third-party floors are implied)."""
    out = {"": level_name(logging.getLogger().level or logging.WARNING)}
    for name in sorted(_SCOPED):
        out[name] = level_name(logging.getLogger(name).level)
    return out


def format_levels(levels: dict[str, str]) -> str:
    """``{"": "info", "zds": "debug"}`` -> ``"zds=debug,info"`` (ztunnel's order: the
    scopes, then the default)."""
    scoped = [f"{name}={level}" for name, level in levels.items() if name]
    return ",".join([*scoped, levels.get("", "info")])


def change_levels(spec: str, reset: bool = False) -> dict[str, str]:
    """Change levels at run time, as ztunnel's ``POST /logging?level=``: ``spec`` is the
    ``--log-level`` form (``"debug"``, ``"zds=debug,sds:warn"``); named scopes change,
    others keep their level; a bare level changes the default. ``reset`` first returns to
    the start-up levels. Returns :func:`current_levels`. Raises ValueError naming the bad
    clause, changing nothing."""
    if reset:
        base_default = _STARTUP.get("", logging.INFO)
        base = {n: v for n, v in _STARTUP.items() if n}
    else:
        base_default = logging.getLogger().level or logging.INFO
        base = {name: logging.getLogger(name).level for name in _SCOPED}
    default, per = parse_levels(spec, default=base_default)  # raises before any change
    _apply(default, {**base, **per})
    return current_levels()
