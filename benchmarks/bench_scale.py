"""How the store, the ambient index and workload xDS grow with the cluster (issue 19).

Sizes 1k and 10k pods by default; ``python -m benchmarks --scale-max 100000`` (or env
``AMBIENT_BENCH_SCALE_MAX``) adds 100k (minutes, ~1 GiB). The cluster is
:func:`benchmarks.bench_index.generate`'s: per namespace 100 pods, 10 services (10 %) and
5 AuthorizationPolicies (5 %), every pod selected by one service and one policy.

Each size runs in a fresh interpreter (``python -m benchmarks.bench_scale child N``) so
its RSS starts from the same baseline. There:

- build: ``ObjectStore.apply`` of every object + ``AmbientIndex.start`` (wall time, best
  of 3 builds from fresh objects), and RSS growth from before the objects were made to
  after the first index is built, per workload (store content, store and index
  together). Target <= 4 KiB per workload.
  Floor of the build time: protobuf alone building and serializing one Address per pod
  and service (what the index must produce anyway).
- initial push of every Address and Authorization to 1 and to 100 wildcard clients (raw
  delta streams that parse each response, as in ``bench_xds``), from the first request
  to the last response; floor: protobuf serializing the same responses (each resource
  once, then one response per client). The server is the real ``XdsServer`` on the real
  index, debounce 0.
- one pod change: a label flip that moves the pod to another service and policy,
  ``store.apply`` -> index recomputed (median of 200).

Then growth exponents between consecutive sizes, ``log(value2 / value1) / log(n2 / n1)``:
~1 means linear, ~0 constant. Targets: build <= 1.15 (linear), one-pod change <= 0.15
(constant), RSS per workload reported.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import Result

SIZES = (1_000, 10_000)
BUILD_REPEATS = 3
LARGE = 100_000
CLIENTS = (1, 100)
MAX_ENV = "AMBIENT_BENCH_SCALE_MAX"
_REPO = Path(__file__).resolve().parents[1]


def _rss() -> int:
    import psutil
    gc.collect()
    return psutil.Process().memory_info().rss


def _build_floor(objs: list[dict]) -> float:
    """Protobuf alone: one Workload/Service Address per object, serialized."""
    from benchmarks.bench_index import protobuf_floor
    return protobuf_floor(objs)


def _one_pod_change(store, index, repeat: int = 200) -> float:
    pod = copy.deepcopy(store.get("Pod", "ns0", "pod0"))
    samples = []
    for i in range(repeat):
        pod = copy.deepcopy(pod)
        pod["metadata"]["labels"] = {"app": f"app{i % 2 + 1}"}
        t0 = time.perf_counter()
        store.apply([(pod, "bench")])
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


async def _push(index, clients: int) -> float:
    """Seconds from ``clients`` wildcard requests to the last full response."""
    from ambient.xds.generators import ADDRESS_TYPE, AUTHORIZATION_TYPE
    from ambient.xds.server import XdsServer
    from benchmarks.bench_xds import NODE, RawClient
    from envoy.service.discovery.v3 import discovery_pb2

    server = XdsServer(index, port=0, debounce=0.0, debounce_max=0.0)
    await server.start()
    conns = [RawClient(server.port) for _ in range(clients)]
    want = {ADDRESS_TYPE: len(index.addresses()), AUTHORIZATION_TYPE: len(index.authorizations())}

    async def one(c) -> None:
        for type_url in (ADDRESS_TYPE, AUTHORIZATION_TYPE):
            await c.call.write(discovery_pb2.DeltaDiscoveryRequest(type_url=type_url,
                                                                   node=NODE))
        got = {}
        while len(got) < 2:
            resp = await c.call.read()
            got[resp.type_url] = len(resp.resources)
            await c.call.write(discovery_pb2.DeltaDiscoveryRequest(
                type_url=resp.type_url, response_nonce=resp.nonce))
        if got != want:
            raise RuntimeError(f"initial push incomplete: {got} != {want}")

    try:
        await asyncio.gather(*(c.channel.channel_ready() for c in conns))
        t0 = time.perf_counter()
        await asyncio.gather(*(one(c) for c in conns))
        return time.perf_counter() - t0
    finally:
        for c in conns:
            await c.close()
        await server.stop(0.5)


def _push_floor(index, clients: int) -> float:
    """Protobuf alone: every resource serialized into a Resource once, then one
    DeltaDiscoveryResponse per type serialized per client."""
    from envoy.service.discovery.v3 import discovery_pb2
    from google.protobuf import any_pb2

    from ambient.xds.generators import ADDRESS_TYPE, AUTHORIZATION_TYPE, content_version

    t0 = time.perf_counter()
    per_type = []
    for type_url, items in ((ADDRESS_TYPE, index.addresses()),
                            (AUTHORIZATION_TYPE, index.authorizations())):
        resources = []
        for name, msg in items.items():
            payload = msg.SerializeToString(deterministic=True)
            resources.append(discovery_pb2.Resource(
                name=name, version=content_version(payload),
                resource=any_pb2.Any(type_url=type_url, value=payload)))
        per_type.append((type_url, resources))
    for _ in range(clients):
        for type_url, resources in per_type:
            resp = discovery_pb2.DeltaDiscoveryResponse(type_url=type_url, nonce="n")
            resp.resources.extend(resources)
            resp.SerializeToString()
    return time.perf_counter() - t0


def child(pods: int) -> dict:
    """One size in this (fresh) interpreter; returns the figures as a dict."""
    from ambient.index import AmbientIndex
    from ambient.objects import Mesh
    from ambient.store import ObjectStore
    from benchmarks.bench_index import generate

    def build_once(objs):
        t0 = time.perf_counter()
        store = ObjectStore()
        store.apply([(o, "bench") for o in objs])
        index = AmbientIndex(store, Mesh())
        index.start()
        return time.perf_counter() - t0, store, index

    rss0 = _rss()
    build, store, index = build_once(generate(pods))
    rss1 = _rss()
    for _ in range(BUILD_REPEATS - 1):  # the best of a few builds: one is noisy at 1k
        objs = [copy.deepcopy(o) for o in store.list("Namespace")] + [
            copy.deepcopy(o) for kind in ("Service", "AuthorizationPolicy", "Pod")
            for o in store.list(kind)]
        del store, index
        gc.collect()
        seconds, store, index = build_once(objs)
        build = min(build, seconds)
        del objs
    out = {"pods": pods, "build": build, "build_floor": None,
           "rss_per_workload": (rss1 - rss0) / pods,
           "addresses": len(index.addresses()), "authorizations": len(index.authorizations())}
    out["change"] = _one_pod_change(store, index)
    out["build_floor"] = _build_floor(list(store.list("Pod")) + list(store.list("Service")))
    for clients in CLIENTS:
        out[f"push_{clients}"] = asyncio.run(_push(index, clients))
        out[f"push_floor_{clients}"] = _push_floor(index, clients)
    return out


def _run_child(pods: int) -> dict:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_scale", "child", str(pods)],
                          cwd=_REPO, capture_output=True, text=True, timeout=3600,
                          env={**os.environ, "PYTHONPATH": str(_REPO),
                               "GRPC_VERBOSITY": "ERROR"})
    if proc.returncode != 0:
        raise RuntimeError(f"bench_scale child {pods}: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _exponent(a: dict, b: dict, key: str) -> float:
    return math.log(b[key] / a[key]) / math.log(b["pods"] / a["pods"])


def sizes() -> list[int]:
    top = int(os.environ.get(MAX_ENV) or SIZES[-1])
    return [n for n in (*SIZES, LARGE) if n <= top]


def run() -> list[Result]:
    data = [_run_child(n) for n in sizes()]
    out: list[Result] = []
    for d in data:
        k = f"{d['pods'] // 1000}k"
        out.append(Result(f"scale {k}: build store + index", d["build"], "s", d["build_floor"],
                          "report", None, f"{d['addresses']} addresses, "
                          f"{d['authorizations']} authorizations; floor: protobuf only"))
        rss_kib = d["rss_per_workload"] / 1024
        out.append(Result(f"scale {k}: RSS per workload (store + index)", rss_kib, "KiB",
                          None, "<= 4 KiB", rss_kib <= 4.0,
                          "RSS growth from before the objects to the built index / pods"))
        for clients in CLIENTS:
            out.append(Result(f"scale {k}: initial push to {clients} client(s)",
                              d[f"push_{clients}"], "s", d[f"push_floor_{clients}"], "report",
                              None, "floor: protobuf serialization of the same responses"))
        out.append(Result(f"scale {k}: one pod change", d["change"] * 1e3, "ms", None,
                          "report", None, "label flip: store.apply -> index, median of 200"))
    for a, b in zip(data, data[1:]):
        span = f"{a['pods'] // 1000}k->{b['pods'] // 1000}k"
        e = _exponent(a, b, "build")
        out.append(Result(f"scale {span}: growth exponent, build", e, "", None, "<= 1.15",
                          e <= 1.15, "~1 = linear"))
        e = _exponent(a, b, "change")
        out.append(Result(f"scale {span}: growth exponent, one pod change", e, "", None,
                          "<= 0.15", e <= 0.15, "~0 = independent of cluster size"))
        for clients in CLIENTS:
            out.append(Result(f"scale {span}: growth exponent, push to {clients}",
                              _exponent(a, b, f"push_{clients}"), "", None, "report", None,
                              "~1 = linear in the resources sent"))
    return out


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    print(json.dumps(child(int(sys.argv[2]))))
