"""The seed map: every item of the five seed documents with a status, checked against the
registry and the schema, and the README region and docs/seed-map.md generated from it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from probewire.stream import seed_map
from probewire.stream.seed_map import (
    DOCS,
    SECTIONS,
    SEED_ITEMS,
    SeedItem,
    Status,
    readme_summary,
    seed_map_doc,
    stored_columns,
)
from probewire.stream.series import FORMED, STEP_SERIES, Kind, Series

ROOT = Path(__file__).resolve().parents[3]
REGEN = "regenerate: python -m probewire.stream.seed_map --write"


def test_the_readme_region_is_the_generated_summary():
    """The README between its metric-table markers is ``readme_summary()`` exactly."""
    text = (ROOT / "README.md").read_text()
    begin, end = seed_map.README_BEGIN, seed_map.README_END
    assert begin in text and end in text, "README lacks the metric-table markers"
    assert text.split(begin)[1].split(end)[0] == readme_summary(), REGEN


def test_docs_seed_map_is_the_generated_page():
    """docs/seed-map.md is ``seed_map_doc()`` exactly, and the README links it."""
    assert (ROOT / "docs" / "seed-map.md").read_text() == seed_map_doc(), REGEN.format(
        "--doc > docs/seed-map.md"
    )
    assert "(docs/seed-map.md)" in readme_summary()


def _listed() -> str:
    return " ".join(i.where for i in SEED_ITEMS)


def test_every_formed_series_and_every_seeded_registry_row_is_listed():
    """Each ``series.FORMED`` column, and each ``step_metrics`` row whose seed names an item
    (not a section only), appears as ``table.column`` in some item's ``where``."""
    listed = _listed()
    formed = [f"{f.table}.{f.column}" for f in FORMED]
    named = [
        f"step_metrics.{s}"
        for s in STEP_SERIES
        if (m := seed_map._SECTION.match(s.seed)) is not None and m.group(2)
    ]
    assert not [c for c in formed + named if f"`{c}`" not in listed]
    assert formed and named


def test_every_item_has_a_status_and_partial_or_out_of_scope_say_what_or_why():
    """Full and partial items say where; partial items say what is missing; out-of-scope
    items say why."""
    for item in SEED_ITEMS:
        assert isinstance(item.status, Status), item
        assert item.item.strip(), item
        if item.status is not Status.OUT:
            assert item.where.strip(), f"{item.seed} {item.item}: where?"
        if item.status is not Status.FULL:
            assert item.missing.strip(), f"{item.seed} {item.item}: what is missing, or why?"
        else:
            assert not item.missing, f"{item.seed} {item.item}: full, yet something missing"


def test_every_document_and_every_section_has_items():
    """Documents 000-004 each have items, and every section of each is cited by one."""
    cited = {(i.doc, i.section) for i in SEED_ITEMS}
    cited |= {tuple(a.split(" ", 1)) for i in SEED_ITEMS for a in i.also}
    assert set(DOCS) == {"000", "001", "002", "003", "004"} == set(SECTIONS)
    uncited = [(d, s) for d, sections in SECTIONS.items() for s in sections if (d, s) not in cited]
    assert not uncited
    assert all(any(i.doc == d for i in SEED_ITEMS) for d in DOCS)
    assert cited <= {(d, s) for d, sections in SECTIONS.items() for s in sections}


def test_every_stored_column_and_module_named_exists():
    """A backticked ``table.column`` in ``where`` is a column of that table or view in
    ``sinks.schema`` (the registry builds ``step_metrics``); a backticked path exists, and
    the names cited after it, "`path` (`a`, `B.c`)", occur in that file."""
    stored = stored_columns()
    bad = []
    for token in re.findall(r"`([^`]+)`", _listed()):
        table, _, column = token.partition(".")
        if table in stored and column and column not in stored[table]:
            bad.append(token)
        if "/" in token and not (ROOT / token).exists():
            bad.append(token)
    for path, names in re.findall(r"`([\w.-]+/[\w/.-]+)` \(([^)]*)\)", _listed()):
        text = (ROOT / path).read_text() if (ROOT / path).exists() else ""
        for name in re.findall(r"`([^`]+)`", names):
            if not re.search(rf"\b{re.escape(name.split('.')[-1])}\b", text):
                bad.append(f"{path}: {name}")
    assert not bad


def test_the_view_columns_are_read_from_the_select_list():
    """``stored_columns`` reads a view's output columns (aliases and plain names), nothing
    of its subqueries."""
    view = stored_columns()["tensor_view"]
    assert view == {
        *("run_id", "step", "tensor", "kind", "n", "abs_max", "nonfinite", "rms"),
        *("abs_mean", "zero_frac", "mean", "excess_kurtosis"),
    }
    assert {"heldout_bpb", "loss", "moe_maxvio"} <= stored_columns()["first_screen"]
    assert "sum_sq" not in view and "m2" not in view


@pytest.mark.parametrize(
    ("check", "name"),
    [
        (seed_map._f, "step_metrics.loss_worst"),
        (seed_map._f, "tensor_view.rms"),  # stored, but not a registry series
        (seed_map._c, "tensor_view.rmss"),
        (seed_map._c, "expert_stats.imbalance"),  # a view's column, not the table's
        (seed_map._t, "tensor_veiw"),
        (seed_map._rm, "memory.alocated"),
        (seed_map._rm, "residual.importanc_*"),
    ],
)
def test_a_misnamed_column_table_or_metric_fails(check, name):
    """The helpers that name stored columns, tables and catalog metrics reject a typo."""
    with pytest.raises(ValueError, match=re.escape(name)):
        check(name)


def test_an_item_citing_a_section_its_document_lacks_fails():
    """A seed section, or an ``also`` citation, that is not in ``SECTIONS`` is refused."""
    with pytest.raises(ValueError, match="no section '§13'"):
        seed_map._full("001 §13", "an item", "`step_metrics.loss`")
    with pytest.raises(ValueError, match="no section 'lost'"):
        seed_map._full("001 §3", "an item", "`step_metrics.loss`", ("000 lost",))


def _row(name: str, seed: str) -> tuple[str, Series]:
    return "step_metrics", Series(name, "Nullable(Float64)", kind=Kind.DETECTOR, seed=seed)


def test_a_registry_row_joins_the_item_its_seed_names_or_becomes_a_partial_item():
    """A row naming a listed item is appended to that item's ``where``; a row naming no
    item becomes a partial item of its own; a section-only or listed row changes nothing."""
    items = (
        SeedItem("001", "§3", "global mean loss L", Status.FULL, "`step_metrics.loss`"),
        SeedItem("002", "§2", "moe/x", Status.PARTIAL, "`step_metrics.x`", "pooled"),
    )
    rows = (
        _row("loss_alt", "001 §3 global mean loss L"),
        _row("new_thing", "002 act/new_thing.avg"),
        _row("sectioned", "001 §5"),
        _row("x", "002 moe/x"),
    )
    out = seed_map._with_registry(items, rows)
    assert out[0].where == "`step_metrics.loss`, `step_metrics.loss_alt`"
    assert out[0].status is Status.FULL and out[1] == items[1]
    assert len(out) == 3
    assert (out[2].doc, out[2].item, out[2].status) == ("002", "act/new_thing.avg", "partial")
    assert out[2].where == "`step_metrics.new_thing`" and out[2].missing


def test_issue_37_items_are_partial_with_what_is_missing():
    """The items issue 37 found marked formed: those still open (shard imbalance without a
    placement to read, allocated/reserved components only) are partial and say so; the
    fixed ones name their new columns (ρ per tensor, π formed on the first screen)."""
    by_item = {(i.seed, i.item): i for i in SEED_ITEMS}
    expect = {
        ("001 §7", "shard imbalance over expert-parallel shards"): "falls back",
        ("001 §5", "allocated and reserved memory"): "components only",
    }
    for key, word in expect.items():
        assert by_item[key].status is Status.PARTIAL and word in by_item[key].missing, key
    rho = by_item[("001 §6", "relative update size ρ")]
    assert rho.status is Status.FULL and "tensor_update_ratio.update_ratio" in rho.where
    pi = by_item[("001 §9", "modality token share π^(μ) (P0, every 1–10 steps)")]
    assert "step_metrics.modality_token_share" in pi.where


def test_the_module_prints_the_coverage_line():
    """``python -m probewire.stream.seed_map`` prints the coverage line and nothing else."""
    run = [sys.executable, "-m", "probewire.stream.seed_map"]
    ok = subprocess.run(run, capture_output=True, text=True, check=True)
    assert ok.stdout == seed_map.coverage() + "\n" and not ok.stderr
    assert re.fullmatch(r"Seed map: \d+ items of the five seeds: \d+ full, .*\.\n", ok.stdout)


def test_write_regenerates_both_files_and_leaves_the_rest_of_the_readme(tmp_path):
    """``--write ROOT`` rewrites docs/seed-map.md and only the README's marked region."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "seed-map.md").write_text("stale")
    before, after = "# title\ntext\n", "\n## next\nmore\n"
    readme = before + seed_map.README_BEGIN + "| stale |" + seed_map.README_END + after
    (tmp_path / "README.md").write_text(readme)
    assert seed_map.main(["--write", str(tmp_path)]) == 0
    assert (tmp_path / "docs" / "seed-map.md").read_text() == seed_map_doc()
    expect = before + seed_map.README_BEGIN + readme_summary() + seed_map.README_END + after
    assert (tmp_path / "README.md").read_text() == expect


@pytest.mark.parametrize("argv", [["--tabel"], ["--doc", "extra"], ["--write", "a", "b"]])
def test_wrong_arguments_are_one_line_and_exit_code_2(argv, capsys):
    """A wrong option is refused with one line naming the usage, exit code 2."""
    assert seed_map.main(argv) == 2
    out, err = capsys.readouterr()
    assert not out and err.count("\n") == 1 and "--write" in err


def test_write_without_a_readme_is_one_line_and_exit_code_2(tmp_path, capsys):
    """``--write`` where there is no README with the markers writes nothing and says so."""
    assert seed_map.main(["--write", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert not out and err.count("\n") == 1 and "metric-table markers" in err
    assert list(tmp_path.iterdir()) == []


def test_issue_37_items_fixed_since_are_full_and_name_where():
    """Clipping against the loop's own max_norm (with a dead letter when ranks disagree),
    the final steps kept when the run says it ended or the worker stops, and the network
    bytes summed over nodes: full, naming the code or columns that do it."""
    by_item = {(i.seed, i.item): i for i in SEED_ITEMS}
    expect = {
        ("001 §4", "clip rate over the last W steps against the clip threshold c"): (
            "clip_disagreement"
        ),
        ("003 §3", "gradient clipping at max_norm"): "grad.clip_threshold",
        ("004 §2", "clipping with clip_grad_norm_ at a threshold"): "grad.clip_threshold",
        ("001 §12", "retain the final steps"): "RunPipeline.at_shutdown",
        ("004 §1", "network bandwidth between nodes"): "step_metrics.net_rx_bytes",
    }
    for key, word in expect.items():
        assert by_item[key].status is Status.FULL and word in by_item[key].where, key
