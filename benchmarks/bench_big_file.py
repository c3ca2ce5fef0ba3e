"""One pod changed inside a 5,000-pod YAML file (issue 28): the time from the file's
rename to a ztunnel-like xDS client holding the change, against the time libyaml
(``yaml.CSafeLoader``) needs just to parse that file, measured in the same run.

The file holds :func:`benchmarks.bench_index.generate`'s cluster for 5,000 pods (50
namespaces, each with 100 pods, 10 services, 5 AuthorizationPolicies), as multi-document
YAML. A change flips ``pod0``'s ``app`` label in ``ns0`` (moving it between two services)
and rewrites the whole file (``os.replace``); it is timed from just before the rename to
the reference delta client (``ambient.xds.client.DeltaXdsClient``) holding pod0's
workload with the new service. The path is the agent's: ``DirectorySource`` (watchfiles),
the store, the ambient index, the xDS server, with both debounces cut to (nearly) 0, so
what is measured is the work. Floor: the median wall time of
``yaml.load_all(text, yaml.CSafeLoader)`` over the same text, one parse measured just
before each sample (interleaved, so a load spike on the machine skews both alike).
Target: the median change latency <= 1.5x that floor (the source re-parses only the
changed document's chunk, then only the changed objects are recomputed).
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import statistics
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
from benchmarks.bench_xds_change import POD, _holds
from benchmarks.common import Result, ratio_result

PODS = 5_000
SAMPLES, WARMUP = 12, 2
MAX_RATIO = 1.5


def _texts(pods: int) -> list[str]:
    """[the file with pod0 in app1, the file as generated (pod0 in app0)]."""
    objs = generate(pods)
    original = yaml.safe_dump_all(objs, sort_keys=False)
    pod0 = next(o for o in objs if o["kind"] == "Pod" and o["metadata"]["name"] == "pod0"
                and o["metadata"]["namespace"] == "ns0")
    pod0["metadata"]["labels"]["app"] = "app1"
    return [yaml.safe_dump_all(objs, sort_keys=False), original]


def parse_floor(text: str, repeat: int = 5) -> float:
    """Median seconds libyaml's safe loader takes to load every document of ``text``."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        list(yaml.load_all(text, Loader=loader))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def change_latency(texts: list[str], samples: int = SAMPLES
                         ) -> tuple[list[float], list[float]]:
    """``(latencies, floors)`` in seconds, one floor (:func:`parse_floor` of the text
    about to be written, once) measured just before each latency sample."""
    loop = asyncio.get_running_loop()

    async def run_blocking(fn, *args):
        return await loop.run_in_executor(None, fn, *args)

    tmp = tempfile.mkdtemp(prefix="bench-bigfile-")
    path = os.path.join(tmp, "cluster.yaml")
    try:
        with open(path, "w") as f:
            f.write(texts[1])
        store = ObjectStore()
        source = DirectorySource(store, tmp, run_blocking, debounce_ms=1)
        await source.start()
        index = AmbientIndex(store, Mesh())
        index.start()
        server = XdsServer(index, port=0, debounce=0.0, debounce_max=0.0)
        await server.start()
        client = DeltaXdsClient(f"127.0.0.1:{server.port}")
        try:
            await client.connect()
            await client.wait_synced(timeout=300)
            await client.wait_for(POD, timeout=120)
            out, floors = [], []
            for i in range(samples + WARMUP):
                text, want = texts[i % 2], ("svc1" if i % 2 == 0 else "svc0")
                floors.append(parse_floor(text, repeat=1))
                staged = f"{path}.{i}.tmp"
                with open(staged, "w") as f:
                    f.write(text)
                t0 = time.perf_counter()
                os.replace(staged, path)
                await client.wait(functools.partial(_holds, client, want), timeout=60)
                out.append(time.perf_counter() - t0)
            return out[WARMUP:], floors[WARMUP:]
        finally:
            await client.close()
            await server.stop(0.5)
            index.stop()
            await source.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


async def run() -> list[Result]:
    texts = await asyncio.to_thread(_texts, PODS)
    samples, floors = await change_latency(texts)
    value, floor = statistics.median(samples), statistics.median(floors)
    ms = 1e3
    return [
        Result(f"libyaml parse of a {PODS // 1000}k-pod YAML file ({len(texts[1]) >> 20} MiB)",
               floor * ms, "ms", None, "report", None,
               f"yaml.load_all(text, CSafeLoader), median of {len(floors)}, one "
               f"measured before each change"),
        ratio_result(f"one pod changed in a {PODS // 1000}k-pod YAML file -> xDS client, p50",
                     value * ms, floor * ms, "ms", MAX_RATIO,
                     f"file rename -> DirectorySource -> store -> index -> xDS -> reference "
                     f"client, debounces 0, {SAMPLES} changes; floor: the libyaml parse"),
        Result(f"one pod changed in a {PODS // 1000}k-pod YAML file -> xDS client, max",
               max(samples) * ms, "ms", floor * ms, "report", None, "same samples"),
    ]


if __name__ == "__main__":
    for r in asyncio.run(run()):
        print(r.as_dict())
