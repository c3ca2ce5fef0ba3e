"""AuthorizationPolicies aimed at a waypoint -> Envoy RBAC filter configs, as istiod's
``pilot/pkg/security/authz`` builds them for a waypoint's inbound chains.

Shape (dicts in protobuf JSON form, parsed into protos by :mod:`.resources`):

- one RBAC filter per action present, DENY before ALLOW (AUDIT and CUSTOM are not
  supported here: one warning naming the policy, the policy is skipped); no ALLOW policy
  means no ALLOW filter (everything allowed that no DENY matched); an ALLOW policy with
  no rules allows nothing;
- one RBAC ``policies`` entry per rule, named ``ns[<ns>]-policy[<name>]-rule[<i>]``;
  ``permissions`` one per ``to`` entry (``any`` without ``to``), ``principals`` one per
  ``from`` entry (``any`` without ``from``), each the AND of its fields, each field the
  OR of its values, ``not*`` fields negated; ``when`` conditions are ANDed into both;
- principals match the HBONE peer identity the ``connect_terminate`` listener stores in
  the filter state ``io.istio.peer_principal`` (``spiffe://`` + the value; ``*`` is
  presence, ``prefix*`` and ``*suffix`` as Istio), namespaces as the regex
  ``.*/ns/<ns>/.*``; source IPs as ``direct_remote_ip`` / ``remote_ip`` (the client
  address ``connect_terminate`` carries through);
- HTTP fields (``methods``, ``paths``, ``hosts``, ``request.headers[...]`` conditions)
  on TCP chains, and fields not supported at all (``requestPrincipals``, JWT
  conditions, ...): as istiod, an ALLOW rule using one is dropped (allows less), a DENY
  rule ignores that condition (denies more), with one problem naming the field.
"""

from __future__ import annotations

import re
from typing import Any

from ambient.objects import meta, spec

RBAC_HTTP = "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC"
RBAC_NETWORK = "type.googleapis.com/envoy.extensions.filters.network.rbac.v3.RBAC"
PEER_PRINCIPAL = "io.istio.peer_principal"

HTTP_OPERATION = ("hosts", "notHosts", "methods", "notMethods", "paths", "notPaths")
SOURCE_FIELDS = ("principals", "notPrincipals", "namespaces", "notNamespaces", "ipBlocks",
                 "notIpBlocks", "remoteIpBlocks", "notRemoteIpBlocks")
UNSUPPORTED_SOURCE = ("requestPrincipals", "notRequestPrincipals", "serviceAccounts",
                      "notServiceAccounts")
OPERATION_FIELDS = ("ports", "notPorts", *HTTP_OPERATION)


class _Unsupported(Exception):
    def __init__(self, what: str, path: str = ""):
        self.what, self.path = what, path


class _Invalid(ValueError):
    """A value that does not convert; the message names the field and the value."""


def string_match(value: str, *, ignore_case: bool = False, prefix: str = "") -> dict:
    """Istio's string rule: ``*`` any (presence), ``x*`` prefix, ``*x`` suffix, else exact;
    ``prefix`` is prepended to the value (``spiffe://`` for principals)."""
    out: dict[str, Any]
    if value == "*":
        out = {"safe_regex": {"regex": ".+"}} if not prefix else {"prefix": prefix}
    elif value.endswith("*"):
        out = {"prefix": prefix + value[:-1]}
    elif value.startswith("*"):
        out = {"suffix": value[1:]}
    else:
        out = {"exact": prefix + value}
    if ignore_case:
        out["ignore_case"] = True
    return out


def _or(ids: list[dict], kind: str) -> dict:
    return ids[0] if len(ids) == 1 else {"or_ids" if kind == "principal" else "or_rules":
                                        {"ids" if kind == "principal" else "rules": ids}}


def _not(x: dict, kind: str) -> dict:
    return {"not_id": x} if kind == "principal" else {"not_rule": x}


def _cidr(text: str) -> dict:
    addr, _, length = str(text).partition("/")
    if not length:
        length = "128" if ":" in addr else "32"
    if not length.isdigit():
        raise ValueError(text)
    return {"address_prefix": addr, "prefix_len": int(length)}


def _principal_values(field: str, values: list[str]) -> list[dict]:
    if field in ("principals", "notPrincipals"):
        return [{"filter_state": {"key": PEER_PRINCIPAL,
                                  "string_match": string_match(v, prefix="spiffe://")}}
                for v in values]
    if field in ("namespaces", "notNamespaces"):
        out = []
        for v in values:
            if v == "*":
                m = {"safe_regex": {"regex": ".*/ns/.*"}}
            else:
                pattern = re.escape(v.rstrip("*")) + (".*" if v.endswith("*") else "")
                m = {"safe_regex": {"regex": f".*/ns/{pattern}/.*"}}
            out.append({"filter_state": {"key": PEER_PRINCIPAL, "string_match": m}})
        return out
    if field in ("ipBlocks", "notIpBlocks"):
        return [{"direct_remote_ip": _cidr(v)} for v in values]
    if field in ("remoteIpBlocks", "notRemoteIpBlocks"):
        return [{"remote_ip": _cidr(v)} for v in values]
    raise _Unsupported(field)


def _permission_values(field: str, values: list[str], http: bool) -> list[dict]:
    if field in ("ports", "notPorts"):
        out = []
        for v in values:
            if not str(v).isdigit() or not 0 < int(v) <= 65535:
                raise ValueError(v)
            out.append({"destination_port": int(v)})
        return out
    if not http:
        raise _Unsupported(field)
    if field in ("methods", "notMethods"):
        return [{"header": {"name": ":method", "string_match": string_match(v)}} for v in values]
    if field in ("paths", "notPaths"):
        return [{"url_path": {"path": string_match(v)}} for v in values]
    if field in ("hosts", "notHosts"):
        return [{"header": {"name": ":authority",
                            "string_match": string_match(v, ignore_case=True)}} for v in values]
    raise _Unsupported(field)


_HEADER_KEY = re.compile(r"^request\.headers\[(.+)\]$")


def _condition(key: str, values: list[str], http: bool) -> tuple[str, list[dict]]:
    """``(kind, ids)`` for one ``when`` key: kind ``principal`` or ``permission``."""
    m = _HEADER_KEY.match(key)
    if m:
        if not http:
            raise _Unsupported(f"when.key {key}")
        return "principal", [{"header": {"name": m.group(1), "string_match": string_match(v)}}
                             for v in values]
    if key == "source.principal":
        return "principal", _principal_values("principals", values)
    if key == "source.namespace":
        return "principal", _principal_values("namespaces", values)
    if key == "source.ip":
        return "principal", _principal_values("ipBlocks", values)
    if key == "remote.ip":
        return "principal", _principal_values("remoteIpBlocks", values)
    if key == "destination.port":
        return "permission", _permission_values("ports", values, http)
    raise _Unsupported(f"when.key {key}")


def _strings(value: Any, path: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, (str, int)) for v in value):
        raise _Invalid(f"field {path!r} must be a list of strings, got {value!r}")
    return [str(v) for v in value]


class RuleBuilder:
    """Builds the RBAC policies of one AuthorizationPolicy; ``problems`` collects what
    was dropped or widened, each naming the policy and the field."""

    def __init__(self, policy: dict, http: bool):
        self.policy, self.http = policy, http
        self.ns = meta(policy).get("namespace", "")
        self.name = meta(policy).get("name", "")
        self.problems: list[str] = []

    def _where(self, path: str) -> str:
        return f"AuthorizationPolicy {self.ns}/{self.name}: field {path!r}"

    def rules(self, action: str) -> dict[str, dict]:
        out = {}
        rules = spec(self.policy).get("rules")
        if rules is None:
            rules = []
        if not isinstance(rules, list):
            self.problems.append(f"{self._where('spec.rules')} must be a list: policy matches "
                                 f"{'nothing' if action == 'ALLOW' else 'everything'}")
            rules = [] if action == "ALLOW" else [{}]
        for i, rule in enumerate(rules):
            built = self._rule(rule if isinstance(rule, dict) else {}, f"spec.rules[{i}]",
                               action)
            if built is not None:
                out[f"ns[{self.ns}]-policy[{self.name}]-rule[{i}]"] = built
        return out

    def _rule(self, rule: dict, path: str, action: str) -> dict | None:
        deny = action == "DENY"
        try:
            principals = self._side(rule.get("from"), f"{path}.from", "source", deny)
            permissions = self._side(rule.get("to"), f"{path}.to", "operation", deny)
            extra_p: list[dict] = []
            extra_perm: list[dict] = []
            for j, cond in enumerate(rule.get("when") or []):
                cpath = f"{path}.when[{j}]"
                if not isinstance(cond, dict) or not isinstance(cond.get("key"), str):
                    raise ValueError(f"field {cpath!r} must have a string key")
                try:
                    kind: str = ""
                    vals: list[dict] = []
                    pos = cond.get("values")
                    neg = cond.get("notValues")
                    if pos is not None:
                        kind, vals = _checked(cpath, self._cond, cond["key"], pos,
                                              cpath + ".values")
                        (extra_p if kind == "principal" else extra_perm).append(_or(vals, kind))
                    if neg is not None:
                        kind, vals = _checked(cpath, self._cond, cond["key"], neg,
                                              cpath + ".notValues")
                        target = extra_p if kind == "principal" else extra_perm
                        target.append(_not(_or(vals, kind), kind))
                except _Unsupported as u:
                    if not deny:
                        raise
                    self.problems.append(f"{self._where(cpath)} ({u.what}) is not enforced "
                                         f"here: the condition is taken as matching (this "
                                         f"DENY denies more)")
        except _Unsupported as u:
            self.problems.append(f"{self._where(u.path or path)} ({u.what}) is not supported "
                                 f"here: the rule is dropped (this ALLOW allows less)")
            return None
        except ValueError as e:
            self.problems.append(f"AuthorizationPolicy {self.ns}/{self.name}: {e}: rule "
                                 f"{path} {'is dropped' if not deny else 'matches everything'}")
            if not deny:
                return None
            return {"permissions": [{"any": True}], "principals": [{"any": True}]}
        if extra_p:
            principals = [{"and_ids": {"ids": [p, *extra_p]}} for p in principals]
        if extra_perm:
            permissions = [{"and_rules": {"rules": [p, *extra_perm]}} for p in permissions]
        return {"permissions": permissions, "principals": principals}

    def _cond(self, key: str, values: Any, path: str) -> tuple[str, list[dict]]:
        return _condition(key, _strings(values, path), self.http)

    def _side(self, entries: Any, path: str, key: str, deny: bool) -> list[dict]:
        kind = "principal" if key == "source" else "permission"
        any_: dict[str, Any] = {"any": True}
        if entries is None:
            return [any_]
        if not isinstance(entries, list):
            raise ValueError(f"field {path!r} must be a list")
        out = []
        for j, entry in enumerate(entries):
            body = entry.get(key) if isinstance(entry, dict) else None
            if not isinstance(body, dict):
                raise ValueError(f"field '{path}[{j}].{key}' must be a mapping")
            ands = []
            for fname, value in body.items():
                fpath = f"{path}[{j}].{key}.{fname}"
                try:
                    if key == "source":
                        if fname in UNSUPPORTED_SOURCE or fname not in SOURCE_FIELDS:
                            raise _Unsupported(fname, fpath)
                        ids = _checked(fpath, _principal_values, fname, _strings(value, fpath))
                    else:
                        if fname not in OPERATION_FIELDS:
                            raise _Unsupported(fname, fpath)
                        ids = _checked(fpath, _permission_values, fname,
                                       _strings(value, fpath), self.http)
                except _Unsupported as u:
                    if not deny:
                        raise
                    self.problems.append(f"{self._where(fpath)} ({u.what}) is not enforced "
                                         f"here: taken as matching (this DENY denies more)")
                    continue
                if not ids:
                    continue
                combined = _or(ids, kind)
                ands.append(_not(combined, kind) if fname.startswith("not") else combined)
            if not ands:
                out.append(any_)
            elif len(ands) == 1:
                out.append(ands[0])
            else:
                out.append({"and_ids": {"ids": ands}} if kind == "principal"
                           else {"and_rules": {"rules": ands}})
        return out or [any_]


def _checked(path: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)``, with errors re-raised naming ``path``: unsupported -> :class:`_Unsupported`
    carrying it, a value that does not convert -> :class:`_Invalid` naming it and the value."""
    try:
        return fn(*args)
    except _Unsupported as u:
        raise _Unsupported(u.what, u.path or path) from None
    except _Invalid:
        raise
    except ValueError as e:
        raise _Invalid(f"field {path!r} value {str(e)!r} is not valid") from None


def rbac_filters(policies: list[dict], *, http: bool) -> tuple[list[dict], list[str]]:
    """``(filters, problems)``: the RBAC HTTP (``http``) or network filters for
    ``policies`` (AuthorizationPolicy dicts), DENY first, then ALLOW. ``filters`` are
    ``{"name": ..., "typed_config": {...}}`` dicts; empty when there is no policy."""
    by_action: dict[str, dict[str, dict]] = {}
    problems: list[str] = []
    for pol in policies:
        action = spec(pol).get("action") or "ALLOW"
        where = f"AuthorizationPolicy {meta(pol).get('namespace')}/{meta(pol).get('name')}"
        if action not in ("ALLOW", "DENY"):
            problems.append(f"{where}: field 'spec.action' {action!r} is not supported on "
                            f"waypoints here: policy skipped")
            continue
        if annotations_dry_run(pol):
            problems.append(f"{where}: dry-run policies are not supported: policy skipped")
            continue
        builder = RuleBuilder(pol, http)
        rules = builder.rules(action)
        problems.extend(builder.problems)
        by_action.setdefault(action, {}).update(rules)
    filters = []
    type_url = RBAC_HTTP if http else RBAC_NETWORK
    name = "envoy.filters.http.rbac" if http else "envoy.filters.network.rbac"
    for action in ("DENY", "ALLOW"):
        if action not in by_action:
            continue
        config: dict[str, Any] = {"@type": type_url, "rules": {
            "action": action, "policies": by_action[action]}}
        if not http:
            config["stat_prefix"] = "tcp."
        filters.append({"name": name, "typed_config": config})
    return filters, problems


def annotations_dry_run(pol: dict) -> bool:
    ann = meta(pol).get("annotations") or {}
    return str(ann.get("istio.io/dry-run", "")).lower() == "true"
