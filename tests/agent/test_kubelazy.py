"""agent/core/kubelazy.py: kubernetes_asyncio's classes load on first use and are the
very objects an eager import gives. Run in fresh interpreters (the lazy packages can only
be installed before anything imports the library, and this test process has)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import asyncio, json, sys
lazy = sys.argv[1] == "lazy"
if lazy:
    from agent.core import kubelazy
    assert kubelazy.install()
    assert kubelazy.install()  # idempotent
from kubernetes_asyncio import client as kclient, config as kconfig, watch as kwatch
from kubernetes_asyncio.client.exceptions import ApiException
import kubernetes_asyncio.client.models

loaded_before_use = sum(1 for m in sys.modules if m.startswith("kubernetes_asyncio."))
names = {n: f"{o.__module__}.{o.__qualname__}" for n, o in {
    "ApiClient": kclient.ApiClient, "Configuration": kclient.Configuration,
    "CoreV1Api": kclient.CoreV1Api, "AuthenticationV1Api": kclient.AuthenticationV1Api,
    "CustomObjectsApi": kclient.CustomObjectsApi, "V1Pod": kclient.V1Pod,
    "models.V1ObjectMeta": kubernetes_asyncio.client.models.V1ObjectMeta,
    "Watch": kwatch.Watch, "ApiException": ApiException,
    "load_kube_config": kconfig.load_kube_config}.items()}
try:
    kclient.NoSuchClass
    missing = "no error"
except AttributeError as e:
    missing = "AttributeError"

async def main():
    api = kclient.ApiClient(kclient.Configuration())
    try:
        pod = api._ApiClient__deserialize(  # how typed API calls build their results
            {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c"}]}}, "V1Pod")
        return [type(pod).__name__, pod.metadata.name, type(pod.spec.containers[0]).__name__]
    finally:
        await api.close()

print(json.dumps({"names": names, "missing": missing, "pod": asyncio.run(main()),
                  "loaded": loaded_before_use}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_lazy_packages_give_the_eager_import_objects_and_load_far_fewer_modules():
    lazy, eager = _probe("lazy"), _probe("eager")
    assert lazy["names"] == eager["names"]
    assert lazy["pod"] == eager["pod"] == ["V1Pod", "p", "V1Container"]
    assert lazy["missing"] == eager["missing"] == "AttributeError"
    assert eager["loaded"] > 500  # every API group and model module
    assert lazy["loaded"] < 100, lazy["loaded"]


DEFERRED = r"""
import sys, threading
from agent.core import kubelazy
assert kubelazy.install()
from kubernetes_asyncio.client import configuration  # imports urllib3 at its top
import urllib3
before = type(urllib3).__name__, "urllib3.util" in sys.modules
got, errors = [], []
start = threading.Barrier(8)

def use():
    start.wait()
    try:
        got.append(urllib3.util.make_headers(basic_auth="a:b")["authorization"])
    except Exception as e:  # noqa: BLE001
        errors.append(repr(e))

threads = [threading.Thread(target=use) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
from urllib3 import PoolManager
import urllib3.exceptions
print(before, type(urllib3).__name__, sorted(set(got)), errors,
      PoolManager.__module__, urllib3.exceptions.HTTPError.__module__)
"""


def test_urllib3_body_runs_on_first_use_once_under_eight_threads():
    """``kubelazy`` defers urllib3 (kubernetes_asyncio's configuration imports it for one
    helper the agent never calls): importing it runs nothing; eight threads using it at
    once all get the real module, and ``from urllib3 import ...`` works afterwards."""
    out = subprocess.run([sys.executable, "-c", DEFERRED], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[0] == ("('_DeferredModule', False) module ['Basic YTpi'] [] "
                                          "urllib3.poolmanager urllib3.exceptions"), out.stdout
