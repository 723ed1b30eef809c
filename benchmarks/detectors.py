"""Spike detectors side by side on real recorded runs: probewire against common trainer rules.

    python benchmarks/detectors.py [--quick] [--work-dir DIR] [--reuse] [--out docs/detectors.md]

Runs the 2-rank demo once per fault of ``probewire.deploy.demo.faults`` (fault at
``--fault-step``, ``--after`` steps after it), once per scenario that must page nothing
(``easy-batch``), and fault-free runs: one of ``--long-steps`` steps (tiny preset) and
``--healthy-runs`` of ``--healthy-steps`` per other preset (other seeds). All runs go
through one broker, worker and store (``Gallery``, one run id each) and are read back in
one process; L and G2 per step are replayed through:

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
firing before the fault counts as a false alarm). Scenarios and fault-free runs: the
number of steps on which each detector fires. The table is printed and written as
markdown to ``--out``.

A second table holds the faults of issue 38 on simulated synchronous DDP ranks
(``probewire.stream.testing.SimRun``, 4 ranks, stage 1 and stage 2 in this process, the
default detector settings but ``--window``): a co-spike at step 20, a rank 1.3x slower for
20 steps, one rank's loss shifted 10%, a loop that norms only its local shard, a residual
branch whose R_b jumps 200x, a gradient group whose G_max collapses 1e-5x, a held-out BPB
10% up (every run also sends the branches, the groups and a BPB evaluation every 50 steps,
healthy); a host-wide bursty load and a loop with a correct global norm that must page nothing; a
fault-free run of ``--sim-steps`` steps and the first 100 steps of it. ``--simulated-only``
writes only that table (below the ``## Simulated`` heading of ``--out``, the recorded
table above it kept).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from probewire.deploy.demo.faults import FAULTS, SCENARIOS, demo_train_args
from probewire.deploy.demo.gallery import Gallery, read_gallery
from probewire.stream.detect import CoSpikeTracker, RobustSpikeDetector
from probewire.stream.series import StepMetrics as SM
from probewire.stream.signals import DetectorConfig
from probewire.stream.stage2 import Stage2Config
from probewire.stream.testing import SimRun, stage2_in_process

DB = "probewire"


@dataclass(slots=True)
class Series:
    label: str
    fault_step: int | None
    steps: np.ndarray
    loss: np.ndarray
    grad: np.ndarray
    alerts: list[tuple[int, str]]
    signal: str | None = None  # the signal that must page (None: the demo fault's)


@dataclass(frozen=True, slots=True)
class Planned:
    label: str
    steps: int
    args: list[str]
    fault_step: int | None = None


# -- recording ---------------------------------------------------------------------------------
def record(
    work: Path, plan: list[Planned], window: int, reuse: bool, console: Console
) -> list[Series]:
    """Train every planned run through one stack (reusing runs already in ``work``'s store
    with the same steps and arguments when ``reuse``), then read them all back."""
    done_file = work / "done.json"
    done = json.loads(done_file.read_text()) if reuse and done_file.exists() else {}
    if not reuse and (work / "store").exists():
        raise SystemExit(f"{work / 'store'} exists: pass --reuse or another --work-dir")
    with Gallery(work, window=window, database=DB) as gallery:
        for run in plan:
            if done.get(run.label) == {"steps": run.steps, "args": run.args}:
                continue
            started = time.monotonic()
            gallery.run(
                f"bench-{run.label}",
                steps=run.steps,
                train_args=run.args,
                timeout_s=max(900.0, run.steps * 1.0),
            )
            console.print(
                f"  recorded {run.label}: {run.steps} steps in {time.monotonic() - started:.0f}s"
            )
            done[run.label] = {"steps": run.steps, "args": run.args}
            done_file.write_text(json.dumps(done))
    read = read_gallery(
        gallery.store,
        {
            "steps": f"SELECT run_id, step, loss, {SM.grad_norm} FROM {DB}.step_metrics FINAL "
            "ORDER BY run_id, step",
            "alerts": f"SELECT run_id, step, signal FROM {DB}.alerts FINAL ORDER BY run_id, step",
        },
        database=DB,
        timeout_s=1800,
    )
    out = []
    nan = float("nan")
    for run in plan:
        run_id = f"bench-{run.label}"
        rows = [r for r in read["sql"]["steps"] if r["run_id"] == run_id]
        out.append(
            Series(
                run.label,
                run.fault_step,
                np.array([r["step"] for r in rows]),
                np.array([nan if r["loss"] is None else r["loss"] for r in rows], float),
                np.array([nan if (g := r[SM.grad_norm]) is None else g for r in rows], float),
                [(a["step"], a["signal"]) for a in read["sql"]["alerts"] if a["run_id"] == run_id],
            )
        )
    return out


# -- detectors: each returns the steps on which it fires ---------------------------------------
def probewire_cospike(s: Series, window: int) -> list[int]:
    det_l = RobustSpikeDetector(window=window, threshold=6.0)
    det_g = RobustSpikeDetector(window=window, threshold=6.0)
    co = CoSpikeTracker()
    fired = []
    for step, loss, grad in zip(s.steps, s.loss, s.grad):
        if co.update(det_l.update(loss), det_g.update(grad)).co_spike:
            fired.append(int(step))
    return fired


def probewire_stream(s: Series, window: int) -> list[int]:
    return sorted({step for step, _ in s.alerts})


def rule_10x_first100(s: Series, window: int) -> list[int]:
    if len(s.loss) <= 100:
        return []
    limit = 10 * np.nanmax(s.loss[:100])
    return [int(st) for st, loss in zip(s.steps[100:], s.loss[100:]) if not loss <= limit]


def rule_2x_mean_5(s: Series, window: int) -> list[int]:
    fired, run = [], 0
    for i in range(100, len(s.loss)):
        run = run + 1 if not s.loss[i] < 2 * np.nanmean(s.loss[i - 100 : i]) else 0
        if run >= 5:
            fired.append(int(s.steps[i]))
    return fired


def rule_6sigma(s: Series, window: int) -> list[int]:
    fired = []
    for i in range(128, len(s.loss)):
        for x in (s.loss, s.grad):
            hist = x[i - 128 : i]
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
def evaluate(faulty: list[Series], scenarios: list[Series], healthy: list[Series], window: int):
    header = ["fault (signal)"] + list(DETECTORS)
    rows, missed, alarms = [], {d: 0 for d in DETECTORS}, {d: 0 for d in DETECTORS}
    for s in scenarios:  # must page nothing: the cell counts firings from the scenario on
        row = [f"{s.label} (pages nothing)"]
        for det in DETECTORS.values():
            fired = [f for f in det(s, window) if f >= s.fault_step]
            cell = str(len(fired))
            if fired and det is probewire_stream:
                cell += ": " + ", ".join(sorted({sig for st, sig in s.alerts}))
            row.append(cell)
        rows.append(row)
    for s in faulty:
        row = [f"{s.label} ({s.signal or FAULTS[s.label].signal})"]
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
                    cell += ": " + ", ".join(
                        sorted({sig for st, sig in s.alerts if st < s.fault_step})
                    )
                cell += ")"
            row.append(cell)
        rows.append(row)
    healthy_steps = sum(len(s.steps) for s in healthy)
    longest = max((len(s.steps) for s in healthy), default=0)
    fa = {name: sum(len(det(s, window)) for s in healthy) for name, det in DETECTORS.items()}
    rows.append(["**missed faults**"] + [f"{missed[d]}/{len(faulty)}" for d in DETECTORS])
    paged = sorted({f"{sig} ({s.label})" for s in healthy for _, sig in s.alerts})
    rows.append(
        [
            f"**false alarms, fault-free** ({len(healthy)} runs, {healthy_steps} steps, "
            f"the longest {longest})"
        ]
        + [
            str(fa[d])
            + (f": {', '.join(paged)}" if DETECTORS[d] is probewire_stream and paged else "")
            for d in DETECTORS
        ]
    )
    early_pages = Counter(
        (st, sig) for s in faulty for st, sig in set(s.alerts) if st < (s.fault_step or 0)
    )
    where = ", ".join(f"{sig} at step {st} x{n}" for (st, sig), n in sorted(early_pages.items()))
    rows.append(
        ["**firings before the fault** (fault runs)"]
        + [
            str(alarms[d]) + (f" ({where})" if DETECTORS[d] is probewire_stream and where else "")
            for d in DETECTORS
        ]
    )
    early = {
        name: sum(f < 100 for s in healthy for f in det(s, window))
        for name, det in DETECTORS.items()
    }
    rows.append(
        [f"**firings in the first 100 steps** ({len(healthy)} fault-free runs)"]
        + [str(early[d]) for d in DETECTORS]
    )
    return header, rows


# -- simulated DDP ranks: the faults of issue 38 ------------------------------------------------
# every simulated run also sends two residual branches and two gradient groups, and gets a
# held-out BPB evaluation every 50 steps (factor 1: healthy)
_SIM = SimRun(
    run_id="",
    world_size=4,
    steps=200,
    seed=1,
    ddp=True,
    residual=(0, 1.0),
    vanish=(0, 1.0),
    bpb=(0, 1.0),
)
SIM_FAULTS = {  # label: (fault step, the signal that must page, the run)
    "sim-early-cospike": (20, SM.cospike, dataclasses.replace(_SIM, steps=60, cospike_step=20)),
    "sim-straggler-1.3x-20-steps": (
        150,
        "step_time",
        dataclasses.replace(_SIM, slow=(1, 150, 20, 1.3)),
    ),
    "sim-rank-loss-shift-10%": (
        150,
        "loss_rank_shift",
        dataclasses.replace(_SIM, shift=(2, 150, 1.1)),
    ),
    "sim-local-shard-norm": (
        0,
        "grad_norm_audit",
        dataclasses.replace(_SIM, steps=60, clip_norm="local"),
    ),
    "sim-residual-branch-200x": (
        150,
        "residual_scale",
        dataclasses.replace(_SIM, residual=(150, 200.0)),
    ),
    "sim-group-gmax-collapse-1e-5": (
        150,
        "vanishing_gradients",
        dataclasses.replace(_SIM, vanish=(150, 1e-5)),
    ),
    "sim-heldout-bpb-rise-10%": (
        400,
        "heldout_bpb",
        dataclasses.replace(_SIM, steps=600, bpb=(400, 1.1)),
    ),
}
SIM_QUIET = {  # must page nothing
    "scenario-sim-loaded-host": dataclasses.replace(_SIM, steps=1000, burner=True),
    "scenario-sim-global-norm": dataclasses.replace(_SIM, clip_norm="global"),
}


def _sim_series(label: str, run: SimRun, window: int, fault_step: int | None, signal=None):
    config = Stage2Config(detectors=DetectorConfig(window=window))
    rows = stage2_in_process(dataclasses.replace(run, run_id=label), config)
    steps = rows["step_metrics"]
    nan = float("nan")
    return Series(
        label,
        fault_step,
        np.array([r["step"] for r in steps]),
        np.array([nan if r[SM.loss] is None else r[SM.loss] for r in steps], float),
        np.array([nan if r[SM.grad_norm] is None else r[SM.grad_norm] for r in steps], float),
        [(a["step"], a["signal"]) for a in rows.get("alerts", [])],
        signal,
    )


def simulated(window: int, sim_steps: int) -> tuple[list[Series], list[Series], list[Series]]:
    """(fault runs, must-page-nothing scenarios, fault-free runs) on simulated DDP ranks:
    the fault-free run of ``sim_steps`` steps and its first 100 steps as a run of its own."""
    faulty = [_sim_series(k, run, window, step, sig) for k, (step, sig, run) in SIM_FAULTS.items()]
    quiet = [_sim_series(k, run, window, 0) for k, run in SIM_QUIET.items()]
    long = _sim_series(
        f"healthy-sim-{sim_steps}", dataclasses.replace(_SIM, steps=sim_steps), window, None
    )
    first = _sim_series("healthy-sim-first-100", dataclasses.replace(_SIM, steps=100), window, None)
    return faulty, quiet, [long, first]


SIM_HEADING = "## Simulated DDP ranks: the faults of issue 38"


def markdown(header: list[str], rows: list[list[str]], meta: str) -> str:
    lines = [
        "# Spike detectors on recorded demo runs",
        "",
        "Generated by `python benchmarks/detectors.py`; " + meta,
        "",
        "Cells: steps from the injected fault to the first firing at or after it "
        "(`+0` = on the fault step); `missed` = no firing before the run ends; "
        "`(k early)` = k firings before the fault; a `(pages nothing)` row counts the "
        "firings from its scenario's step on (0 is right). Only probewire's P0 stream sees "
        "signals other than L and G2 (worst rank, source ratio, step time, memory, "
        "replay, MaxVio, media scale, residual branch scale), so the L/G2-only rules "
        "cannot be expected to see a straggler, a memory creep, a routing collapse or "
        "a flaky replay; they are listed to show that.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = _parser().parse_args()
    if args.simulated_only:
        simulated_only(args)
        return
    fault_step = args.fault_step or (130 if args.quick else 200)
    long_steps = args.long_steps or (300 if args.quick else 5000)
    healthy_steps = args.healthy_steps or (300 if args.quick else 1000)
    presets = [p for p in args.healthy_presets.split(",") if p]
    console = Console()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    meta = (
        f"window {args.window}, faults at step {fault_step} with {args.after} steps after, "
        f"fault-free runs: {long_steps} steps (tiny, seed 1) and {args.healthy_runs} of "
        f"{healthy_steps} steps per preset ({', '.join(presets)}; seeds 1..), 2 gloo ranks "
        f"on CPU, one broker/worker/store for all runs; each fault runs on the preset it "
        f"needs (tiny unless it needs experts or media)."
    )
    console.print(f"[bold]detectors benchmark[/]: {meta}  work dir {args.work_dir}")
    plan = _plan(args, fault_step, long_steps, healthy_steps, presets)
    recorded = record(args.work_dir, plan, args.window, args.reuse, console)
    faulty = [s for s in recorded if s.label in FAULTS]
    scenarios = [s for s in recorded if s.label.startswith("scenario-")]
    healthy = [s for s in recorded if s.label.startswith("healthy-")]
    header, rows = evaluate(faulty, scenarios, healthy, args.window)
    table = Table(title="steps to detection (fault runs) and false alarms (fault-free runs)")
    for h in header:
        table.add_column(h.replace("**", ""))
    for r in rows:
        table.add_row(*(c.replace("**", "") for c in r))
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown(header, rows, meta) + "\n" + sim_table(args, console))
    console.print(f"written to {args.out}")


def sim_table(args: argparse.Namespace, console: Console) -> str:
    """The simulated section: the table of ``simulated`` as markdown, printed too."""
    header, rows = evaluate(*simulated(args.window, args.sim_steps), args.window)
    table = Table(title="issue 38 faults on 4 simulated DDP ranks")
    for h in header:
        table.add_column(h.replace("**", ""))
    for r in rows:
        table.add_row(*(c.replace("**", "") for c in r))
    console.print(table)
    meta = (
        f"window {args.window}, default detector settings otherwise; 4 simulated synchronous "
        "DDP ranks (`stream.testing.SimRun`, seed 1) through stage 1 and stage 2 in process; "
        f"the fault-free run has {args.sim_steps} steps, and its first 100 steps are also "
        "scored as a run of their own (the early regime)."
    )
    body = markdown(header, rows, meta).split("\n", 2)[2]  # without the first heading
    return f"{SIM_HEADING}\n\nGenerated by `python benchmarks/detectors.py --simulated-only`; {body.split('; ', 1)[1]}"


def simulated_only(args: argparse.Namespace) -> None:
    """Rewrite only the simulated section of ``--out``; the recorded table above it stays."""
    console = Console()
    kept = args.out.read_text().split(SIM_HEADING)[0].rstrip("\n") if args.out.exists() else ""
    args.out.write_text((kept + "\n\n" if kept else "") + sim_table(args, console))
    console.print(f"written to {args.out}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="shorter runs (fault at 130, fault-free runs of 300 steps)",
    )
    p.add_argument(
        "--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "probewire-detectors"
    )
    p.add_argument("--reuse", action="store_true", help="reuse finished runs in --work-dir")
    p.add_argument(
        "--simulated-only",
        action="store_true",
        help="only the simulated DDP table (no demo training), below the recorded one in --out",
    )
    p.add_argument(
        "--sim-steps", type=int, default=5000, help="steps of the simulated fault-free run"
    )
    p.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "detectors.md"
    )
    p.add_argument("--window", type=int, default=50, help="probewire detector window")
    p.add_argument("--fault-step", type=int)
    p.add_argument("--after", type=int, default=30, help="steps recorded after the fault")
    p.add_argument(
        "--long-steps",
        type=int,
        help="the long fault-free run (tiny preset, seed 1; default 5000, --quick 300)",
    )
    p.add_argument("--healthy-runs", type=int, default=1, help="fault-free runs per other preset")
    p.add_argument(
        "--healthy-presets", default="moe,media", help="model presets of the other fault-free runs"
    )
    p.add_argument("--healthy-steps", type=int, help="steps of those (default 1000)")
    p.add_argument("--faults", default=",".join(FAULTS), help="comma-separated fault names")
    p.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help="comma-separated scenarios that must page nothing",
    )
    return p


def _plan(
    args: argparse.Namespace,
    fault_step: int,
    long_steps: int,
    healthy_steps: int,
    presets: list[str],
) -> list[Planned]:
    """The runs to record: each fault and each must-page-nothing scenario at ``fault_step``,
    the long fault-free tiny run and the fault-free runs of the other presets."""
    plan = [
        Planned(n, fault_step + args.after, demo_train_args([f"{n}@{fault_step}"]), fault_step)
        for n in filter(None, args.faults.split(","))
    ]
    plan += [
        Planned(
            f"scenario-{n}",
            fault_step + args.after,
            demo_train_args([f"{n}@{fault_step}"]),
            fault_step,
        )
        for n in filter(None, args.scenarios.split(","))
    ]
    plan.append(Planned("healthy-tiny-seed1", long_steps, ["--preset", "tiny", "--seed", "1"]))
    plan += [
        Planned(
            f"healthy-{preset}-seed{seed}", healthy_steps, ["--preset", preset, "--seed", str(seed)]
        )
        for preset in presets
        for seed in range(1, args.healthy_runs + 1)
    ]
    return plan


if __name__ == "__main__":
    main()
