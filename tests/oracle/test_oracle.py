"""The differential suite: the agent against istiod, the real upstream control plane, on one
API server, read by one client that speaks as ztunnel does (tests/oracle/harness.py).

For each state of tests/oracle/states.py (pods, Services, EndpointSlices, ServiceEntries of
every resolution, WorkloadEntries, AuthorizationPolicies of every action and target kind,
PeerAuthentications incl. port-level, waypoints at namespace/service/workload level, network
gateways, changes and deletes) both servers' Address and Authorization resources in the
state's namespaces are compared field by field after every step and after the state is
deleted. A difference fails the test unless it is an entry of docs/xds.md "Deliberate
differences from istiod" that the case names (:data:`DELIBERATE`: its predicate, reason and
test). Cases known to differ by an open issue item are xfail (non-strict) with that item.

Every difference seen is also appended to ``$ORACLE_DIFFS_FILE`` when set (one JSON line a
difference), which is how the list of differences is kept up to date.
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from tests.oracle import harness as h
from tests.oracle.states import CASES, Case

pytestmark = pytest.mark.timeout(600)
DOCS = os.path.join(h.ROOT, "docs", "xds.md")


def _no_labels_no_selector_policies(d: tuple) -> bool:
    """istiod may give a pod with no labels at all a selector policy of its namespace (seen
    in two of three identical runs: order-dependent); the agent gives it only the policies
    whose selector its labels satisfy, i.e. none. Allowed only in that direction: istiod
    has policies, the agent none, on a pod of the case that has no labels."""
    typ, name, path, istiod, agent = d
    return (typ == "Address" and "/Pod/" in name and name.rsplit("/", 1)[-1] == "bare"
            and path == "workload.authorization_policies" and bool(istiod) and not agent)


def _deny_http_only_denies_all(d: tuple) -> bool:
    """A DENY policy whose only rule has HTTP conditions: istiod sends the rule as one empty
    match (ztunnel skips it: the DENY never fires), the agent no rule (the group matches:
    it denies). Allowed only for that shape: istiod ``[{"matches": [{}]}]``, agent none."""
    typ, name, path, istiod, agent = d
    return (typ == "Authorization" and path.endswith(".rules")
            and istiod == [{"matches": [{}]}] and not agent)


def _port_level_disable_under_inherited_strict(d: tuple) -> bool:
    """A workload PeerAuthentication with only a port-level DISABLE under a STRICT
    namespace: istiod lists its static STRICT policy, the agent the converted policy of that
    PeerAuthentication. Allowed only for exactly that pair of names."""
    typ, name, path, istiod, agent = d
    return (typ == "Address" and path.startswith("workload.authorization_policies")
            and istiod == "istio-system/istio_converted_static_strict"
            and isinstance(agent, str) and "/converted_peer_authentication_" in agent)


# id -> predicate over one difference (type, name, path, istiod value, agent value); an id
# must be an entry of docs/xds.md "Deliberate differences from istiod".
DELIBERATE = {"no-labels-no-selector-policies": _no_labels_no_selector_policies,
              "deny-http-only-denies-all": _deny_http_only_denies_all,
              "port-level-disable-under-inherited-strict":
                  _port_level_disable_under_inherited_strict}


def _documented_ids() -> set[str]:
    text = open(DOCS, encoding="utf-8").read()
    m = re.search(r"^## Deliberate differences from istiod\n(.*?)(?=^## |\Z)", text,
                  re.S | re.M)
    return set(re.findall(r"`([a-z0-9-]+)`", m.group(1))) if m else set()


def test_every_deliberate_difference_is_documented():
    missing = set(DELIBERATE) - _documented_ids()
    assert not missing, f"not in docs/xds.md 'Deliberate differences from istiod': {missing}"
    used = {d for c in CASES for d in c.deliberate}
    assert used <= set(DELIBERATE), used - set(DELIBERATE)


def test_at_least_sixty_states():
    assert len(CASES) >= 60
    assert len({c.id for c in CASES}) == len(CASES)


def _record(case: Case, step: str, diffs: list) -> None:
    path = os.environ.get("ORACLE_DIFFS_FILE")
    if not path or not diffs:
        return
    with open(path, "a", encoding="utf-8") as f:
        for d in diffs:
            f.write(json.dumps({"case": case.id, "step": step, "type": d[0], "name": d[1],
                                "path": d[2], "istiod": d[3], "agent": d[4]},
                               default=str) + "\n")


def _fmt(diffs: list) -> str:
    return "\n".join(f"  {t} {n} {p or '(resource)'}: istiod={json.dumps(a, default=str)} "
                     f"agent={json.dumps(b, default=str)}" for t, n, p, a, b in diffs[:40])


def _params():
    for c in CASES:
        marks = [pytest.mark.xfail(reason=c.xfail, strict=False)] if c.xfail else []
        yield pytest.param(c, id=c.id, marks=marks)


def test_baseline_empty_cluster(oracle):
    """Before any state: the whole snapshot (default/kubernetes, the marker) is the same."""
    oracle.loop.run(oracle.converge())
    diffs = oracle.differences(None)
    assert not diffs, _fmt(diffs)
    names = {t: sorted(v) for t, v in oracle.snapshot("istiod").items()}
    assert names["Address"], "istiod served no Address at all"


@pytest.mark.parametrize("case", list(_params()))
def test_state(oracle, case: Case):
    allowed = [DELIBERATE[d] for d in case.deliberate]
    created: list = []
    failures = []
    served = 0
    t0 = time.monotonic()

    def in_case(side: str) -> int:
        return sum(h.in_scope(n, case.namespaces)
                   for v in oracle.snapshot(side).values() for n in v)

    def check(step: str) -> None:
        nonlocal served
        oracle.loop.run(oracle.converge())
        served = max(served, in_case("istiod"), in_case("agent"))
        diffs = oracle.differences(case.scope)
        _record(case, step, diffs)
        bad = [d for d in diffs if not any(p(d) for p in allowed)]
        if bad:
            failures.append(f"after {step}:\n{_fmt(bad)}")

    try:
        for i, step in enumerate(case.steps):
            for op in step:
                oracle.loop.run(h.run_op(oracle.api, op, created))
            check(f"step {i + 1}")
    finally:
        oracle.loop.run(h.remove(oracle.api, case.namespaces, created))
    check("delete")
    left = {side: in_case(side) for side in oracle.clients}
    if case.empty:
        assert not served, f"{case.id}: expected nothing served for it, got {served}"
    assert not any(left.values()), f"resources of {case.namespaces} left after delete: {left}"
    # the case must have produced something in one of the views, or it compared nothing
    assert served or case.empty, f"{case.id}: neither server served anything for {case.namespaces}"
    assert not failures, f"{case.id} ({time.monotonic() - t0:.1f}s):\n" + "\n".join(failures)


def test_final_snapshot_equal(oracle):
    """After every state was applied and removed, nothing is left over on either side."""
    oracle.loop.run(oracle.converge())
    diffs = oracle.differences(None)
    assert not diffs, _fmt(diffs)
