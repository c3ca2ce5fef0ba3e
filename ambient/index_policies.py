"""The ambient index's Authorizations: AuthorizationPolicies (:mod:`ambient.translate_authz`),
PeerAuthentications (the static STRICT policy and per-port policies converted from
workload-selector PeerAuthentications, as istiod's ``convertedPeerAuthentications``) and
local ``LocalPolicy`` objects; and, per workload, the ordered policy keys its
``authorization_policies`` lists (:meth:`Policies.policy_keys`)."""

from __future__ import annotations

import logging

from agent.core.yamlsafe import short_text
from ambient import authorization_pb2 as az
from ambient import localconfig
from ambient import translate_authz as tz
from ambient.index_base import BAD_OBJECT, IndexBase, PodKey, policy_selector, subset
from ambient.objects import TranslateError, meta, spec
from ambient.store import StoreEvent

log = logging.getLogger(__name__)


def _by_age(obj: dict) -> tuple[str, str]:
    return (meta(obj).get("creationTimestamp") or "", meta(obj)["name"])


class Policies:
    def __init__(self, base: IndexBase):
        self.base = base
        # namespace -> {policy key: matchLabels} of WORKLOAD_SELECTOR-scoped policies
        self._ap_selectors: dict[str, dict[str, dict[str, str]]] = {}
        # workload-selector PeerAuthentication -> the key of the policy converted from it
        self._pa_converted: dict[PodKey, str] = {}
        # (mesh-wide mode, namespace -> mode) of selector-less PeerAuthentications
        self._pa_modes: tuple[str, dict[str, str]] = ("UNSET", {})
        # PeerAuthentication -> the problems last warned about (one WARN per change)
        self._pa_warned: dict[PodKey, str] = {}
        # keys of selector policies that have a variant for waypoint-bound workloads
        self._variants: set[str] = set()

    # ------------------------------------------------------------------ marks

    def mark_authorization_policy(self, ev: StoreEvent) -> None:
        """The policy is dirty, and the workloads its old and new selectors match (the
        whole mesh for one in the system namespace)."""
        base = self.base
        ns = ev.namespace
        base.dirty.policies.add((ns, ev.name))
        for o in (ev.old, ev.new):
            if o is not None:
                scope_ns = None if ns == base.base_mesh.root_namespace else ns
                base.mark_selected(scope_ns, policy_selector(o), allow_empty=True,
                                   service_entries=True)

    def mark_peer_authentication(self, ev: StoreEvent) -> None:
        """PeerAuthentications are recomputed together; the workloads one covers are
        dirty (everything for a mesh-wide one)."""
        base = self.base
        ns, root = ev.namespace, base.base_mesh.root_namespace
        base.dirty.pa = True
        for o in (ev.old, ev.new):
            if o is None:
                continue
            sel = tz.read_peer_authentication(o).selector
            if sel is None:
                if ns == root:
                    base.dirty.full = True
                else:
                    base.mark_namespace_workloads(ns)
            elif ns != root:
                base.mark_selected(ns, sel, allow_empty=True, service_entries=True)

    def mark_all(self) -> None:
        """Every AuthorizationPolicy, every held non-PeerAuthentication key (a removed
        policy's key is dirty too) and the PeerAuthentications (a full flush)."""
        d = self.base.dirty
        d.policies.update(self.base.keys_of("AuthorizationPolicy"))
        for k in self.base.outputs.authz_bytes:
            if not self.is_pa_key(k):
                ns, _, name = k.partition("/")
                d.policies.add((ns, name.removesuffix(tz.WAYPOINT_VARIANT)))
        d.local.update(("LocalPolicy", ns, name) for ns, name in self.base.keys_of("LocalPolicy"))
        d.pa = True

    # ------------------------------------------------------------------ updates

    def update_policy(self, ns: str, name: str) -> None:
        """Recompute the AuthorizationPolicy ``ns/name`` (unless a LocalPolicy holds it)."""
        base = self.base
        if base.store.get("LocalPolicy", ns, name) is not None:
            return
        key = f"{ns}/{name}"
        self._ap_selectors.get(ns, {}).pop(key, None)
        obj = base.store.get("AuthorizationPolicy", ns, name)
        result = variant = None
        if obj is not None:
            try:
                translated = tz.authorization_policy(obj, base.base_mesh.root_namespace)
                result = translated.policy
                variant = translated.waypoint_variant
                if translated.problems:
                    # counted as rejected parts: the policy itself is still enforced,
                    # closed on the side that is safe for its action
                    base.rejected.labels("AuthorizationPolicy").inc()
                    log.warning("AuthorizationPolicy %s: %s", key,
                                short_text("; ".join(translated.problems)))
                if translated.note:
                    log.info("AuthorizationPolicy %s: %s", key, translated.note)
            except BAD_OBJECT as e:
                # the translator reads every field defensively, so this is a bug; still
                # nothing fails open: the policy denies its whole namespace
                base.rejected.labels("AuthorizationPolicy").inc()
                log.warning("AuthorizationPolicy %s: can't be translated (%s); enforced as a "
                            "DENY of every connection in its namespace", key,
                            short_text(str(e)))
                result = tz.deny_everything(obj, base.base_mesh.root_namespace)
                variant = None
        if obj is not None and result is not None and result.scope == az.WORKLOAD_SELECTOR:
            self._ap_selectors.setdefault(ns, {})[key] = dict(
                (spec(obj).get("selector") or {}).get("matchLabels") or {})
        base.outputs.set_authz(key, result)
        base.outputs.set_authz(key + tz.WAYPOINT_VARIANT, variant if result is not None else None)
        if variant is not None and result is not None:
            self._variants.add(key)
        else:
            self._variants.discard(key)

    def update_local(self, ns: str, name: str) -> None:
        """Recompute the LocalPolicy ``ns/name`` (:func:`ambient.localconfig.policy`)."""
        obj = self.base.store.get("LocalPolicy", ns, name)
        key = f"{ns}/{name}"
        try:
            self.base.outputs.set_authz(key, localconfig.policy(spec(obj), key) if obj else None)
        except BAD_OBJECT as e:
            self.base.reject("LocalPolicy", ns, name, e)

    def update_peer_authentications(self) -> None:
        """Modes, the static STRICT policy and converted per-port policies."""
        base = self.base
        root = base.base_mesh.root_namespace
        pas = sorted(base.store.list("PeerAuthentication"), key=_by_age)
        mesh_mode, ns_modes = "UNSET", dict[str, str]()
        forced: set[str] = set()
        warned: dict[PodKey, str] = {}
        for pa in pas:
            ns, name = meta(pa)["namespace"], meta(pa)["name"]
            read = tz.read_peer_authentication(pa)
            if read.problems:
                # unreadable parts are STRICT for what they cover (never dropped, never
                # PERMISSIVE/DISABLE): one bounded warning per object and change
                text = short_text("; ".join(read.problems))
                warned[(ns, name)] = text
                if self._pa_warned.get((ns, name)) != text:
                    base.rejected.labels("PeerAuthentication").inc()
                    log.warning("PeerAuthentication %s/%s: %s", ns, name, text)
            if read.forced:
                forced.add(ns)
                continue
            if read.selector is not None:
                continue
            if ns == root:
                mesh_mode = mesh_mode if mesh_mode != "UNSET" else read.mode
            else:
                ns_modes.setdefault(ns, read.mode)
        self._pa_warned = warned
        for ns in forced:
            if ns == root:
                mesh_mode = "STRICT"
            else:
                ns_modes[ns] = "STRICT"
        self._pa_modes = (mesh_mode, ns_modes)
        converted: dict[PodKey, str] = {}
        wanted: dict[str, az.Authorization] = {}
        for pa in pas:
            ns, name = meta(pa)["namespace"], meta(pa)["name"]
            if ns == root or tz.read_peer_authentication(pa).selector is None:
                continue
            inherited = ns_modes.get(ns, "UNSET")
            inherited = inherited if inherited != "UNSET" else mesh_mode
            try:
                policy = tz.converted_peer_authentication(pa, inherited)
            except TranslateError as e:
                base.reject("PeerAuthentication", ns, name, e)
                continue
            if policy is not None:
                key = f"{ns}/{policy.name}"
                wanted[key] = policy
                converted[(ns, name)] = key
        if pas:
            wanted[f"{root}/{tz.STATIC_STRICT}"] = tz.static_strict(root)
        outputs = base.outputs
        for key in [k for k in outputs.authz_bytes if self.is_pa_key(k)]:
            if key not in wanted:
                outputs.set_authz(key, None)
        for key, policy in wanted.items():
            outputs.set_authz(key, policy)
        self._pa_converted = converted

    @staticmethod
    def is_pa_key(key: str) -> bool:
        """Whether ``key`` names a policy derived from PeerAuthentications."""
        name = key.split("/", 1)[1]
        return name == tz.STATIC_STRICT or name.startswith(tz.CONVERTED_PREFIX)

    # ------------------------------------------------------------------ reads

    def policy_keys(self, ns: str, lbls: dict[str, str], waypoint_bound: bool = False
                    ) -> list[str]:
        """Sorted selector AuthorizationPolicies, then PeerAuthentication keys. A workload
        bound to a waypoint lists a widened policy's waypoint variant instead
        (:data:`ambient.translate_authz.WAYPOINT_VARIANT`)."""
        root = self.base.base_mesh.root_namespace
        keys = [k for scope in {ns, root}
                for k, sel in self._ap_selectors.get(scope, {}).items() if subset(sel, lbls)]
        keys.sort()
        if waypoint_bound:
            keys = [k + tz.WAYPOINT_VARIANT if k in self._variants else k for k in keys]
        mesh_mode, ns_modes = self._pa_modes
        effective = ns_modes.get(ns, "UNSET")
        effective = effective if effective != "UNSET" else mesh_mode
        workload_pa = None
        for pa in sorted(self.base.store.list("PeerAuthentication", ns), key=_by_age):
            sel = tz.read_peer_authentication(pa).selector
            if sel is not None and ns != root and subset(sel, lbls):
                workload_pa = pa
                break
        if workload_pa is not None:
            mode = tz.pa_top_mode(workload_pa)
            if mode != "UNSET":
                effective = mode
            converted = self._pa_converted.get((ns, meta(workload_pa)["name"]))
            if converted:
                return keys + [converted]
        if effective == "STRICT":
            keys.append(f"{root}/{tz.STATIC_STRICT}")
        return keys
