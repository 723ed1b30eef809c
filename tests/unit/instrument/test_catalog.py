"""The metric catalog: the names the stream and the schema depend on, complete entries,
bounded labels, units in names, and no torch needed to read it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from probewire.instrument.catalog import CATALOG, Group, Priority, Reduction, describe, spec

# name -> (priority, reduction, labels, replicated_over) for the names others depend on;
# gradients are de-duplicated on the rank (each element reported by its owner), so the
# stream sums them over every rank: an FSDP shard must not be taken for a DDP replica
CONTRACT = {
    "loss.sum": ("P0", "sum", ("source",), {"tp"}),
    "loss.tokens": ("P0", "sum", ("source",), {"tp"}),
    "grad.norm_sq": ("P0", "sum", ("group",), set()),
    "grad.abs_sum": ("P1", "sum", ("group",), set()),
    "grad.abs_max": ("P1", "max", ("group",), set()),
    "grad.zeros": ("P1", "sum", ("group",), set()),
    "grad.elements": ("P1", "sum", ("group",), set()),
    "grad.clipped": ("P0", "max", (), {"dp", "tp", "pp", "cp", "ep"}),
    "guard.skipped": ("P1", "max", (), {"dp", "tp", "pp", "cp", "ep"}),
    "guard.replayed": ("P1", "max", (), {"dp", "tp", "pp", "cp", "ep"}),
    "guard.replay_mismatch": ("P1", "max", (), {"dp", "tp", "pp", "cp", "ep"}),
    "step.duration": ("P0", "max", (), set()),
    "flops.step": ("P0", "sum", (), {"tp", "pp"}),
    "memory.peak_allocated": ("P0", "max", (), set()),
    "memory.peak_reserved": ("P0", "max", (), set()),
    "memory.peak_rss": ("P0", "max", (), set()),
    "comm.wait": ("P1", "max", ("op",), set()),
    "comm.calls": ("P1", "sum", ("op",), set()),
    "comm.bytes": ("P1", "sum", ("op",), set()),
    "net.rx": ("P1", "sum", (), set()),
    "net.tx": ("P1", "sum", (), set()),
    "output.logits_abs_max": ("P0", "max", (), set()),
    "output.logits_sum_sq": ("P0", "sum", (), set()),
    "output.logits_n": ("P0", "sum", (), set()),
    "output.top2_gap_sum": ("P1", "sum", (), set()),
    "output.top2_equal": ("P1", "sum", (), set()),
    "output.positions": ("P1", "sum", (), set()),
    "tensor.abs_max": ("P0", "max", ("tensor", "kind"), set()),
    "tensor.sum4": ("P2", "sum", ("tensor", "kind"), set()),
    "export.dropped_total": ("P1", "per_rank", (), set()),
}
RANK_SIDE = (
    "loss.",
    "grad.",
    "guard.",
    "step.duration",
    "flops.",
    "tokens.",
    "memory.",
    "comm.",
    "host.",
    "device.",
    "net.",
    "output.logits",
    "output.top2",
    "output.positions",
    "tensor.",
    "export.",
)  # the §2-§6 and output-layer entries of this issue
UNBOUNDED = {
    "param",
    "parameter",
    "sample",
    "sample_id",
    "token",
    "request",
    "path",
    "host",
    "rank",
    "step",
}  # per-element or per-process identities are never labels


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_the_names_others_depend_on_have_their_agreed_definition(name):
    priority, reduction, labels, replicated = CONTRACT[name]
    s = spec(name)
    assert (s.priority, s.reduction, s.labels) == (Priority(priority), Reduction(reduction), labels)
    assert {g.value for g in s.replicated_over} == replicated


def test_tensor_statistics_cover_the_one_pass_scan():
    for field in ("n", "sum", "sum_sq", "abs_sum", "abs_max", "zeros", "nonfinite", "sum3", "sum4"):
        assert f"tensor.{field}" in CATALOG


@pytest.mark.parametrize("name", sorted(n for n in CATALOG if n.startswith(RANK_SIDE)))
def test_every_rank_side_entry_states_formula_reduction_point_and_seed(name):
    s = CATALOG[name]
    assert len(s.doc) > 40 and s.point and s.seed
    assert set(s.labels) <= {"source", "group", "tensor", "kind", "op"}
    assert all(isinstance(g, Group) for g in s.replicated_over)
    text = describe(name)
    assert s.reduction.value in text and s.point in text and s.seed in text
    # OpenTelemetry naming: the unit is the instrument's unit, never part of its name
    assert not name.endswith(("_s", "_bytes", "_pct", "_w", "_c"))


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_no_entry_labels_an_unbounded_identity(name):
    labels = CATALOG[name].labels
    assert not set(labels) & UNBOUNDED and all(label.isidentifier() for label in labels)


def test_unknown_metric_is_a_clear_error():
    with pytest.raises(KeyError, match="unknown metric 'loss.mean'"):
        spec("loss.mean")


def test_the_catalog_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None; "
        "from probewire.instrument.catalog import CATALOG; "
        "from probewire.instrument.wire import decode_rank_step; print(len(CATALOG))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == len(CATALOG)
