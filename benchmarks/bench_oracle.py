"""The differential suite's states as a benchmark: the agent and istiod side by side.

The same harness and states as ``tests/oracle/`` (one test kube-apiserver, istiod built by
``scripts/istiod-test.sh``, the agent as a process, one ztunnel-like delta xDS client per
server). For every state, after each step: the seconds until each server's client sees
the step (the marker Service bumped after the step's objects: its new port served means
the server processed the step), summed over all steps of all states; and the bytes of the
Address and Authorization resources each server holds for the state's namespaces after
its last step (protobuf ``ByteSize``), summed. Both are reported with istiod's figure as
the floor (ratio = agent / istiod); the number of states whose resources differed is
reported too (the tests judge those, not this). Needs root and Go, like the tests;
skipped otherwise. ``python -m benchmarks --only oracle``.
"""

from __future__ import annotations

import asyncio
import subprocess
import tempfile
import time

from benchmarks.common import Result


def _size(oracle, side: str, scope: tuple[str, ...]) -> int:
    from tests.oracle import harness as h
    from tests.ztunnel_exact import xds as zx
    res = oracle.clients[side].resources
    return sum(m.ByteSize() for typ in (zx.ADDRESS_TYPE, zx.AUTHORIZATION_TYPE)
               for n, m in res[typ].items() if h.in_scope(n, scope))


async def _step_times(oracle) -> dict[str, float]:
    """Bump the marker; seconds until each side serves it (each side timed on its own)."""
    from tests.kube import cluster as kc
    t0 = time.monotonic()
    oracle.marker_seq += 1
    port = 20000 + oracle.marker_seq
    await kc.apply(oracle.api, oracle._marker(oracle.marker_seq))
    seen: dict[str, float] = {}
    deadline = t0 + 90
    while len(seen) < len(oracle.clients):
        for side in oracle.clients:
            if side not in seen and oracle._marker_seen(side, port):
                seen[side] = time.monotonic() - t0
        if time.monotonic() > deadline:
            raise TimeoutError(f"marker port {port} not served by "
                               f"{sorted(set(oracle.clients) - set(seen))}")
        await asyncio.sleep(0.01)
    return seen


def run() -> list[Result]:
    from tests.oracle import harness as h
    from tests.oracle.states import CASES
    why = h.why_not()
    if why:
        return [Result("oracle states: step time, agent vs istiod", float("nan"), "s",
                       note=f"skipped: {why}")]
    subprocess.run(["bash", h.ISTIOD_SCRIPT, "build"], check=True, env=h.script_env(),
                   stdout=subprocess.DEVNULL)
    oracle = h.Oracle(tempfile.mkdtemp(prefix="bench-oracle-"))
    times = {"agent": 0.0, "istiod": 0.0}
    sizes = {"agent": 0, "istiod": 0}
    differing = steps = 0
    try:
        oracle.start()
        oracle.loop.run(oracle.converge())
        for case in CASES:
            created: list = []
            try:
                for i, step in enumerate(case.steps):
                    for op in step:
                        oracle.loop.run(h.run_op(oracle.api, op, created))
                    for side, t in oracle.loop.run(_step_times(oracle)).items():
                        times[side] += t
                    steps += 1
                    oracle.loop.run(oracle.converge())
                    if i == len(case.steps) - 1:
                        for side in sizes:
                            sizes[side] += _size(oracle, side, case.scope)
                        differing += bool(oracle.differences(case.scope))
            finally:
                oracle.loop.run(h.remove(oracle.api, case.namespaces, created))
        oracle.loop.run(oracle.converge())
    finally:
        oracle.stop()
    note = f"{len(CASES)} states, {steps} steps"
    return [
        Result("oracle states: seconds to serve every step (floor istiod)", times["agent"],
               "s", times["istiod"], "report", None, note),
        Result("oracle states: bytes served for the states (floor istiod)",
               float(sizes["agent"]), "B", float(sizes["istiod"]), "report", None, note),
        Result("oracle states whose resources differed (tests judge them)", float(differing),
               "states", None, "report", None, note),
    ]
