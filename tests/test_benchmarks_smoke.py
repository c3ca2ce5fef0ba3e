"""Keeps the benchmarks from rotting: every ``benchmarks/bench_*.py`` imports, and the
scale and config-dir change paths run end to end at tiny sizes. Nothing here is timed
or judged (the figures are ``python -m benchmarks``'s job, as ratios to floors)."""

from __future__ import annotations

import asyncio
import importlib
import pkgutil
import shutil
from pathlib import Path

import pytest

import benchmarks
from agent.demo.envoy import EnvoyError, envoy_path
from benchmarks import bench_scale, bench_waypoint, bench_xds, bench_xds_change


def test_every_benchmark_module_imports_and_has_run():
    names = [m.name for m in pkgutil.iter_modules([str(Path(benchmarks.__file__).parent)])
             if m.name.startswith("bench_")]
    assert "bench_scale" in names and "bench_kube_xds" in names
    for name in names:
        assert callable(importlib.import_module(f"benchmarks.{name}").run), name


def test_scale_child_runs_at_a_tiny_size():
    out = bench_scale.child(200)
    assert out["addresses"] == 220 and out["authorizations"] == 10  # 2 ns: 200 pods + 20 svc
    assert "rss_per_workload" in out and out["change"] > 0  # RSS: meaningful only in a fresh process
    assert out["push_1"] > 0 and out["push_100"] > 0


def test_config_dir_change_path_runs_at_a_tiny_size():
    samples = asyncio.run(bench_xds_change.files_latency(100, samples=2, file_debounce_ms=1,
                                                         xds_debounce=0.0))
    assert len(samples) == 2 and all(s > 0 for s in samples)


def test_fuzz_rss_row_runs_at_a_tiny_size():
    before, after = asyncio.run(bench_xds.fuzz_rss(bench_xds.make_index(50, 5), requests=40))
    assert before > 0 and after > 0


def test_istiod_bad_input_corrupts_a_state_dir(tmp_path):
    from benchmarks import bench_istiod
    state = tmp_path / "state"
    (state / "pods").mkdir(parents=True)
    (state / "pods" / "uid1.json").write_text('{"uid": "uid1", "netns": "/proc/9/ns/net"}')
    (state / "iptables-flavor").write_text("nft\n")
    (state / "agent.lock").write_text("")
    assert bench_istiod.corrupt(str(state)) == 4  # 2 cut in half, 2 garbage records added
    assert (state / "pods" / "uid1.json").read_text() == '{"uid": "uid1", "netn'
    assert (state / "iptables-flavor").read_text() == "nf"
    assert sorted(p.name for p in (state / "pods").iterdir()) == [
        "bench-garbage.json", "bench-partial.json", "uid1.json"]


def test_istiod_import_floor_and_its_rows():
    """The floor's interpreter really imports its libraries (an ImportError would raise),
    and both of its rows are built from a run's figures."""
    from benchmarks import bench_istiod
    floor = bench_istiod.import_floor(runs=1)
    assert 0 < floor < 60
    side = {"cold": 2.0, "cold_cut": 1.0, "initial": 0.01, "rss": 100.0, "cpu": 0.05,
            "burst_wall": 0.5, "latency_shipped": [0.1], "latency_cut": [0.01],
            "latency_cut_at_start": [0.02]}
    agent = dict(side, import_floor=floor, corrupt_files=1, slow_lists=1, throttled_429s=1,
                 **{f"{k}_{what}": v for what in ("corrupt", "slow", "throttled")
                    for k, v in (("cold", 2.0), ("why", ""))})
    rows = {r.figure: r for r in bench_istiod.rows(1000, agent, side)}
    floor_row = rows["import floor (Python + grpcio, protobuf, aiohttp) vs istiod's cut cold "
                     "start, at 1k"]
    assert (floor_row.value, floor_row.floor) == (floor, 1.0)
    assert rows["agent's cut cold start vs the import floor, at 1k"].ratio == 1.0 / floor
    early = rows["vs istiod: change latency p50, cut debounce, at once after the cold start, "
                 "at 1k"]
    assert (early.value, early.floor) == (20.0, 20.0)


@pytest.mark.envoy
def test_waypoint_throughput_row_runs_end_to_end():
    """Both waypoints (agent's xDS and the static bootstrap) carry wrk's requests: wrk_rps
    raises on any non-2xx answer or socket error, so a row means every request passed."""
    if shutil.which("wrk") is None:
        pytest.skip("wrk not installed (scripts/install-system-deps.sh)")
    try:
        envoy_path()
    except EnvoyError as e:
        pytest.skip(str(e))
    row, cpu = asyncio.run(bench_waypoint.throughput(seconds=1, rounds=1))
    assert row.value > 0 and row.floor and row.floor > 0
    assert "no waypoint" in row.note and cpu.value > 0 and cpu.floor and cpu.floor > 0
