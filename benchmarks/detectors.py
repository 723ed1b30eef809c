"""Spike detectors side by side on real recorded runs: probewire against common trainer rules.

    python benchmarks/detectors.py [--quick] [--work-dir DIR] [--reuse] [--out docs/detectors.md]

Runs the 2-rank demo once per fault of ``probewire.deploy.demo.faults`` (fault at
``--fault-step``, ``--after`` steps after it) and ``--healthy-runs`` fault-free runs (other
seeds), reads L and G2 per step back from each store, and replays them through:

* **probewire co-spike**: robust z on log(x) against the rolling median/MAD of the previous
  ``--window`` steps (``probewire.stream.detect.RobustSpikeDetector``, z > 6) on L and on
  G2; fires when both spike on the same step (``CoSpikeTracker``), the stream's
  ``cospike`` page;
* **probewire P0 stream**: the alerts the stream worker actually wrote (every P0 rule:
  co-spike, worst rank, loss by source, step time, memory, replay mismatch, ...);
* **(a) 10x first-100 max**: L above 10x the largest L of the first 100 steps;
* **(b) 2x mean, 5 in a row**: L >= 2x the mean of the previous 100 steps on 5 consecutive
  steps (fires on the 5th);
* **(c) mean + 6 sigma**: L or G2 above mean + 6 std of the previous 128 steps.

Per fault: steps from the fault to the first firing at or after it ("missed" if none; a
firing before the fault counts as a false alarm). Fault-free runs: the number of steps on
which each detector fires. The table is printed and written as markdown to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from rich.console import Console
from rich.table import Table

from probewire.deploy.demo.faults import FAULTS, demo_train_args
from probewire.deploy.demo.run import run_demo
from probewire.deploy.settings import ClickHouseSettings, Settings, StreamSettings
from probewire.stream.signals import DetectorConfig
from probewire.stream.stage2 import Stage2Config
from probewire.stream.detect import CoSpikeTracker, RobustSpikeDetector

DB = "probewire"


@dataclass(slots=True)
class Series:
    label: str
    fault_step: int | None
    steps: np.ndarray
    loss: np.ndarray
    grad: np.ndarray
    alerts: list[tuple[int, str]]


# -- recording ---------------------------------------------------------------------------------
def _sql(store: Path, sql: str) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "probewire.deploy.cli", "sql", "--store",
                          str(store), "--format", "json", sql],
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"probewire sql failed on {store}: {out.stderr.strip()}")
    return json.loads(out.stdout)


def record(work: Path, label: str, steps: int, window: int, train_args: list[str],
           reuse: bool, console: Console) -> tuple[Path, str]:
    """Run one demo into ``work/label`` (or reuse a finished one); return (store, run_id)."""
    base = work / label
    done = base / "done.json"
    if reuse and done.exists():
        meta = json.loads(done.read_text())
        if meta["steps"] == steps and meta["args"] == train_args:
            return base / "store", meta["run_id"]
    settings = Settings(clickhouse=ClickHouseSettings(
        url="chdb:///" + str(base / "store").lstrip("/"), database=DB),
        stream=StreamSettings(stage2=Stage2Config(detectors=DetectorConfig(window=window))))
    started = time.monotonic()
    result = run_demo(settings, ranks=2, steps=steps, work_dir=base / "run",
                      run_id=f"bench-{label}", extra_train_args=train_args, show_progress=False)
    console.print(f"  recorded {label}: {steps} steps in {time.monotonic() - started:.0f}s")
    done.write_text(json.dumps({"steps": steps, "args": train_args, "run_id": result.run_id}))
    return base / "store", result.run_id


def load(store: Path, run_id: str, label: str, fault_step: int | None) -> Series:
    rows = _sql(store, f"SELECT step, loss, grad_norm FROM {DB}.step_metrics FINAL "
                       f"WHERE run_id = '{run_id}' ORDER BY step")
    alerts = _sql(store, f"SELECT step, signal FROM {DB}.alerts WHERE run_id = '{run_id}' "
                         f"ORDER BY step")
    nan = float("nan")
    return Series(label, fault_step, np.array([r["step"] for r in rows]),
                  np.array([nan if r["loss"] is None else r["loss"] for r in rows], float),
                  np.array([nan if r["grad_norm"] is None else r["grad_norm"] for r in rows],
                           float),
                  [(a["step"], a["signal"]) for a in alerts])


# -- detectors: each returns the steps on which it fires ---------------------------------------
def probewire_cospike(s: Series, window: int) -> list[int]:
    det_l = RobustSpikeDetector(window=window, threshold=6.0)
    det_g = RobustSpikeDetector(window=window, threshold=6.0)
    co = CoSpikeTracker()
    fired = []
    for step, l, g in zip(s.steps, s.loss, s.grad):
        if co.update(det_l.update(l), det_g.update(g)).co_spike:
            fired.append(int(step))
    return fired


def probewire_stream(s: Series, window: int) -> list[int]:
    return sorted({step for step, _ in s.alerts})


def rule_10x_first100(s: Series, window: int) -> list[int]:
    if len(s.loss) <= 100:
        return []
    limit = 10 * np.nanmax(s.loss[:100])
    return [int(st) for st, l in zip(s.steps[100:], s.loss[100:]) if not l <= limit]


def rule_2x_mean_5(s: Series, window: int) -> list[int]:
    fired, run = [], 0
    for i in range(100, len(s.loss)):
        run = run + 1 if not s.loss[i] < 2 * np.nanmean(s.loss[i - 100:i]) else 0
        if run >= 5:
            fired.append(int(s.steps[i]))
    return fired


def rule_6sigma(s: Series, window: int) -> list[int]:
    fired = []
    for i in range(128, len(s.loss)):
        for x in (s.loss, s.grad):
            hist = x[i - 128:i]
            if not x[i] <= np.nanmean(hist) + 6 * np.nanstd(hist):
                fired.append(int(s.steps[i]))
                break
    return fired


DETECTORS: dict[str, Callable[[Series, int], list[int]]] = {
    "probewire co-spike (L & G2)": probewire_cospike,
    "probewire P0 stream (all rules)": probewire_stream,
    "(a) L > 10x max(first 100)": rule_10x_first100,
    "(b) L >= 2x mean(100), 5 in a row": rule_2x_mean_5,
    "(c) L or G2 > mean + 6 sigma (128)": rule_6sigma,
}


# -- table -------------------------------------------------------------------------------------
def evaluate(faulty: list[Series], healthy: list[Series], window: int):
    header = ["fault (signal)"] + list(DETECTORS)
    rows, missed, alarms = [], {d: 0 for d in DETECTORS}, {d: 0 for d in DETECTORS}
    for s in faulty:
        row = [f"{s.label} ({FAULTS[s.label].signal})"]
        for name, det in DETECTORS.items():
            fired = det(s, window)
            before = [f for f in fired if f < s.fault_step]
            after = [f for f in fired if f >= s.fault_step]
            alarms[name] += len(before)
            if after:
                cell = f"+{after[0] - s.fault_step}"
                if det is probewire_stream:  # which P0 rules paged first
                    first = sorted({sig for st, sig in s.alerts if st == after[0]})
                    cell += f" ({', '.join(first)})"
            else:
                cell, missed[name] = "missed", missed[name] + 1
            if before:
                cell += f" ({len(before)} early"
                if det is probewire_stream:
                    cell += ": " + ", ".join(sorted({sig for st, sig in s.alerts
                                                      if st < s.fault_step}))
                cell += ")"
            row.append(cell)
        rows.append(row)
    healthy_steps = sum(len(s.steps) for s in healthy)
    fa = {name: sum(len(det(s, window)) for s in healthy) for name, det in DETECTORS.items()}
    rows.append(["**missed faults**"] + [f"{missed[d]}/{len(faulty)}" for d in DETECTORS])
    paged = sorted({f"{sig} ({s.label})" for s in healthy for _, sig in s.alerts})
    rows.append([f"**false alarms, fault-free** ({len(healthy)} runs, {healthy_steps} steps)"]
                + [str(fa[d]) + (f": {', '.join(paged)}" if DETECTORS[d] is probewire_stream
                                 and paged else "") for d in DETECTORS])
    rows.append(["**false alarms before the fault** (fault runs)"]
                + [str(alarms[d]) for d in DETECTORS])
    return header, rows


def markdown(header: list[str], rows: list[list[str]], meta: str) -> str:
    lines = ["# Spike detectors on recorded demo runs", "",
             "Generated by `python benchmarks/detectors.py`; " + meta, "",
             "Cells: steps from the injected fault to the first firing at or after it "
             "(`+0` = on the fault step); `missed` = no firing before the run ends; "
             "`(k early)` = k firings before the fault. Only probewire's P0 stream sees "
             "signals other than L and G2 (worst rank, source ratio, step time, memory, "
             "replay, MaxVio, media scale, residual branch scale), so the L/G2-only rules "
             "cannot be expected to see a straggler, a memory creep, a routing collapse or "
             "a flaky replay; they are listed to show that.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="shorter runs (fault at 130, 2 fault-free runs of 300 steps)")
    p.add_argument("--work-dir", type=Path,
                   default=Path(tempfile.gettempdir()) / "probewire-detectors")
    p.add_argument("--reuse", action="store_true", help="reuse finished runs in --work-dir")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs"
                   / "detectors.md")
    p.add_argument("--window", type=int, default=50, help="probewire detector window")
    p.add_argument("--fault-step", type=int)
    p.add_argument("--after", type=int, default=30, help="steps recorded after the fault")
    p.add_argument("--healthy-runs", type=int, help="fault-free runs per preset "
                   "(default 2, --quick 1)")
    p.add_argument("--healthy-presets", default="tiny,moe,media",
                   help="model presets of the fault-free runs (the faults pick their own)")
    p.add_argument("--healthy-steps", type=int)
    p.add_argument("--faults", default=",".join(FAULTS), help="comma-separated fault names")
    args = p.parse_args()
    fault_step = args.fault_step or (130 if args.quick else 200)
    healthy_steps = args.healthy_steps or (300 if args.quick else 1000)
    healthy_runs = args.healthy_runs or (1 if args.quick else 2)
    presets = [p for p in args.healthy_presets.split(",") if p]
    console = Console()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    meta = (f"window {args.window}, faults at step {fault_step} with {args.after} steps after, "
            f"{healthy_runs} fault-free run(s) of {healthy_steps} steps per preset "
            f"({', '.join(presets)}; seeds 1..), 2 gloo ranks on CPU; each fault runs on "
            f"the preset it needs (tiny unless it needs experts or media).")
    console.print(f"[bold]detectors benchmark[/]: {meta}  work dir {args.work_dir}")
    faulty, healthy = [], []
    for name in filter(None, args.faults.split(",")):
        store, run_id = record(args.work_dir, name, fault_step + args.after, args.window,
                               demo_train_args([f"{name}@{fault_step}"]), args.reuse,
                               console)
        faulty.append(load(store, run_id, name, fault_step))
    for preset in presets:
        for seed in range(1, healthy_runs + 1):
            label = f"healthy-{preset}-seed{seed}"
            store, run_id = record(args.work_dir, label, healthy_steps, args.window,
                                   ["--preset", preset, "--seed", str(seed)], args.reuse,
                                   console)
            healthy.append(load(store, run_id, label, None))
    header, rows = evaluate(faulty, healthy, args.window)
    table = Table(title="steps to detection (fault runs) and false alarms (fault-free runs)")
    for h in header:
        table.add_column(h.replace("**", ""))
    for r in rows:
        table.add_row(*(c.replace("**", "") for c in r))
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown(header, rows, meta))
    console.print(f"written to {args.out}")


if __name__ == "__main__":
    main()
