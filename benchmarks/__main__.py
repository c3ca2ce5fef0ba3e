"""``python -m benchmarks [--only NAME] [--json PATH] [--scale-max PODS]``: run every
``benchmarks/bench_*.py``.

Each module defines ``run() -> list[benchmarks.common.Result]`` (sync or async). The
runner prints one table (figure, value, floor, ratio, target, pass/fail) and writes the
same rows as JSON (default ``benchmarks/results.json``). Exit status 1 if any judged
figure failed or a benchmark crashed.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import json
import os
import pkgutil
import sys
import traceback
from pathlib import Path

from benchmarks.common import Result


def _fmt(v, unit=""):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}{(' ' + unit) if unit else ''}"
    return f"{v}{(' ' + unit) if unit else ''}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("--only", action="append", default=[],
                        help="run only bench_<NAME> (repeatable)")
    parser.add_argument("--json", default=str(Path(__file__).with_name("results.json")))
    parser.add_argument("--scale-max", type=int, default=0, metavar="PODS",
                        help="largest cluster bench_scale builds (default 10000; 100000 adds "
                             "the 100k size: minutes, ~1 GiB)")
    args = parser.parse_args(argv)
    if args.scale_max:
        os.environ["AMBIENT_BENCH_SCALE_MAX"] = str(args.scale_max)
    names = sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)])
                   if m.name.startswith("bench_"))
    if args.only:
        names = [n for n in names if n.removeprefix("bench_") in args.only or n in args.only]
    rows: list[dict] = []
    failed = False
    for name in names:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        try:
            module = importlib.import_module(f"benchmarks.{name}")
            out = module.run()
            results: list[Result] = asyncio.run(out) if inspect.isawaitable(out) else out
        except Exception as e:  # noqa: BLE001 - a crashed benchmark is a failed row
            traceback.print_exc()
            rows.append({"benchmark": name, "figure": f"{name} crashed: {e}", "passed": False})
            failed = True
            continue
        for r in results:
            rows.append({"benchmark": name, **r.as_dict()})
            failed |= r.passed is False
    header = f"{'figure':<58} {'value':>14} {'floor':>14} {'ratio':>7}  {'target':<16} result"
    print(header)
    print("-" * len(header))
    for row in rows:
        verdict = {True: "pass", False: "FAIL", None: "report"}[row.get("passed")]
        print(f"{row['figure'][:58]:<58} {_fmt(row.get('value'), row.get('unit', '')):>14} "
              f"{_fmt(row.get('floor'), row.get('unit', '')):>14} {_fmt(row.get('ratio')):>7}  "
              f"{row.get('target', ''):<16} {verdict}")
    Path(args.json).write_text(json.dumps(rows, indent=2, default=str))
    print(f"\nwrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
