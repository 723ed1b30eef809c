"""The README's metric table is the one ``seed_map`` generates, and it lists every formed
series of the registry."""

from __future__ import annotations

from pathlib import Path

from probewire.stream.seed_map import SEED_ITEMS, coverage, metric_table
from probewire.stream.series import FORMED

README = Path(__file__).resolve().parents[3] / "README.md"


def test_the_readme_metric_table_is_the_generated_one():
    text = README.read_text()
    begin, end = "<!-- metric-table:begin -->\n", "\n<!-- metric-table:end -->"
    assert begin in text and end in text, "README lacks the metric-table markers"
    assert text.split(begin)[1].split(end)[0] == metric_table(), (
        "regenerate the README table from instrument/seed_map.metric_table()"
    )


def test_every_formed_series_is_listed_and_the_count_adds_up():
    stored = " ".join(i.stored for i in SEED_ITEMS)
    assert all(f"`{s.table}.{s.column}`" in stored for s in FORMED)
    formed, total = coverage()
    assert total == len(SEED_ITEMS) and formed == sum(i.formed for i in SEED_ITEMS) < total
