"""Workload xDS change latency through the real path (issue 19).

A file change in ``--config-dir`` to a ztunnel-like client holding it: the directory
source (``ambient.source_files.DirectorySource``, watchfiles, the agent's 50 ms file
debounce), the store, the ambient index, the xDS server with the agent's default push
debounce (``xds_debounce`` 0.1 s, ``xds_debounce_max`` 1 s) and the reference delta
client (``ambient.xds.client.DeltaXdsClient``, wildcard Address + Authorization, as
ztunnel subscribes), all in this process on one event loop.

The cluster is :func:`benchmarks.bench_index.generate`'s (per namespace 100 pods, 10
services, 5 AuthorizationPolicies: 10 % services, 5 % policies), one YAML file per
namespace, so a change rewrites a file of the same size at every cluster size. One
change = namespace ``ns0``'s file rewritten (``os.replace``) with ``pod0``'s ``app``
label flipped between ``app0`` and ``app1``, which moves it between two services; it is
timed from just before the rename to the client holding pod0's workload with the new
service. Samples alternate the two versions; the first few are warm-up.

Figures: p50 and p99 at 1k and at 10k pods, once with the agent's debounces and once
with both set to (nearly) 0, which leaves the work itself plus watchfiles' 20 ms event
poll. Floors: at 1k, the two configured quiet periods (file debounce + xDS debounce:
what any change waits by design, reported); at 10k, the same figure at 1k: target
ratio <= 1.3 (the cost is per change, not per cluster); with no debounces only the p50
is judged (a p99 of tens of ms there is watchfiles' polling and scheduling noise). The
Kubernetes path (an API
write to the client holding it) is in ``bench_kube``, which runs the real API server.
The server-only figures (fake index, debounce 0, initial push) are in ``bench_xds``.
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import tempfile
import time

import yaml

from ambient.index import AmbientIndex
from ambient.objects import Mesh
from ambient.source_files import DirectorySource
from ambient.store import ObjectStore
from ambient.xds.client import DeltaXdsClient
from ambient.xds.server import XdsServer
from benchmarks.bench_index import generate
from benchmarks.common import Result, percentile, ratio_result

FILE_DEBOUNCE_MS = 50        # DirectorySource's default, as the agent runs it
XDS_DEBOUNCE, XDS_DEBOUNCE_MAX = 0.1, 1.0  # the agent's xds_debounce defaults
SAMPLES, WARMUP = 40, 4
POD = "Kubernetes//Pod/ns0/pod0"


def write_cluster(directory: str, pods: int) -> tuple[str, list[str]]:
    """One YAML file per namespace under ``directory``; returns ``(path of ns0's file,
    [its text with pod0 in app1, its text with pod0 in app0 (as written)])``."""
    by_ns: dict[str, list[dict]] = {}
    for obj in generate(pods):
        ns = obj["metadata"].get("namespace") or obj["metadata"]["name"]
        by_ns.setdefault(ns, []).append(obj)
    texts = []
    for ns, objs in by_ns.items():
        text = yaml.safe_dump_all(objs, sort_keys=False)
        with open(os.path.join(directory, f"{ns}.yaml"), "w") as f:
            f.write(text)
        if ns == "ns0":
            texts.append(text)
            pod0 = next(o for o in objs if o["kind"] == "Pod" and o["metadata"]["name"] == "pod0")
            pod0["metadata"]["labels"]["app"] = "app1"
            texts.insert(0, yaml.safe_dump_all(objs, sort_keys=False))
    return os.path.join(directory, "ns0.yaml"), texts


def _holds(client: DeltaXdsClient, service: str, pod: str = POD) -> bool:
    return _service_of(client, pod) == service


def _service_of(client: DeltaXdsClient, pod: str = POD) -> str | None:
    """The ``svc<N>`` the workload ``pod`` belongs to in what the client holds, if any."""
    addr = client.resources().get(pod)
    if addr is None:
        return None
    keys = list(addr.workload.services)
    return keys[0].split("/", 1)[1].split(".", 1)[0] if keys else ""


async def files_latency(pods: int, samples: int = SAMPLES, file_debounce_ms: int = FILE_DEBOUNCE_MS,
                        xds_debounce: float = XDS_DEBOUNCE) -> list[float]:
    """Seconds from a file rename to the client holding the change, ``samples`` times."""
    loop = asyncio.get_running_loop()

    async def run_blocking(fn, *args):
        return await loop.run_in_executor(None, fn, *args)

    tmp = tempfile.mkdtemp(prefix="bench-xds-")
    try:
        path, texts = await asyncio.to_thread(write_cluster, tmp, pods)
        store = ObjectStore()
        source = DirectorySource(store, tmp, run_blocking, debounce_ms=file_debounce_ms)
        await source.start()
        index = AmbientIndex(store, Mesh())
        index.start()
        server = XdsServer(index, port=0, debounce=xds_debounce,
                           debounce_max=max(xds_debounce, XDS_DEBOUNCE_MAX))
        await server.start()
        client = DeltaXdsClient(f"127.0.0.1:{server.port}")
        try:
            await client.connect()
            await client.wait_synced(timeout=120)
            await client.wait_for(POD, timeout=60)
            out = []
            for i in range(samples + WARMUP):
                text, want = texts[i % 2], ("svc1" if i % 2 == 0 else "svc0")
                tmp_path = f"{path}.{i}.tmp"  # not a watched suffix: only the rename counts
                with open(tmp_path, "w") as f:
                    f.write(text)
                t0 = time.perf_counter()
                os.replace(tmp_path, path)
                await client.wait(functools.partial(_holds, client, want), timeout=30)
                out.append(time.perf_counter() - t0)
            return out[WARMUP:]
        finally:
            await client.close()
            await server.stop(0.5)
            index.stop()
            await source.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _reported(figure, value, floor, unit, _max_ratio, note) -> Result:
    return Result(figure, value, unit, floor, "report", None, note)


async def run() -> list[Result]:
    ms = 1e3
    quiet = FILE_DEBOUNCE_MS + XDS_DEBOUNCE * 1e3
    results = []
    for label, kw, floor_note in (
            ("agent debounces", {}, f"floor: the two debounces ({quiet:g} ms, waited by design)"),
            ("debounces 0", {"file_debounce_ms": 1, "xds_debounce": 0.0},
             "floor: none (watchfiles polls its events every 20 ms)")):
        small = await files_latency(1_000, **kw)
        large = await files_latency(10_000, **kw)
        note = (f"file rename -> DirectorySource -> index -> xDS -> reference client; "
                f"{SAMPLES} changes, {label}")
        for p in (50, 99):
            s, lg = percentile(small, p) * ms, percentile(large, p) * ms
            results.append(Result(f"xds change via config-dir file ({label}), p{p} at 1k",
                                  s, "ms", quiet if not kw else None, "report", None,
                                  note + "; " + floor_note))
            judged = not kw or p == 50  # debounces 0, p99: scheduler noise; reported
            results.append((ratio_result if judged else _reported)(
                f"xds change via config-dir file ({label}), p{p} at 10k", lg, s, "ms", 1.3,
                "floor: the same figure at 1k pods"))
    return results


if __name__ == "__main__":
    for r in asyncio.run(run()):
        print(r.as_dict())
