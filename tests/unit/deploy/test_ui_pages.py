"""The UI's server-rendered HTML (``deploy.ui.pages``): the runs table's filter and sort,
text from the store is escaped, the chart boot data cannot end its script element."""

from __future__ import annotations

import json
import re

from probewire.deploy.ui.pages import charts_page, filter_runs, runs_page, sort_runs, tag_list
from probewire.stream.series import CHARTS

ROWS = [
    {"run_id": "base-1", "status": "finished", "tags": ["sweep", "lr"], "loss": 2.5},
    {"run_id": "base-2", "status": "running", "tags": ["sweep"], "loss": None},
    {"run_id": "moe-7", "status": "crashed", "tags": [], "loss": 3.1},
]


def _ids(rows):
    return [r["run_id"] for r in rows]


def test_filter_by_words_and_tags():
    assert _ids(filter_runs(ROWS, "")) == ["base-1", "base-2", "moe-7"]
    assert _ids(filter_runs(ROWS, "tag:sweep")) == ["base-1", "base-2"]
    assert _ids(filter_runs(ROWS, "tag:lr")) == ["base-1"]
    assert _ids(filter_runs(ROWS, "tag:swe")) == []  # a tag matches whole
    assert _ids(filter_runs(ROWS, "BASE running")) == ["base-2"]
    assert _ids(filter_runs(ROWS, "crashed")) == ["moe-7"]


def test_sort_keeps_missing_values_last():
    assert _ids(sort_runs(ROWS, "loss", desc=False)) == ["base-1", "moe-7", "base-2"]
    assert _ids(sort_runs(ROWS, "loss", desc=True)) == ["moe-7", "base-1", "base-2"]
    assert _ids(sort_runs(ROWS, "no-such-column", desc=True)) == _ids(ROWS)


def test_store_text_is_escaped():
    row = {
        "run_id": "<b>x</b>",
        "status": "running",
        "tags": ["<i>t</i>"],
        "steps": 3,
        "updated_at": None,
    }
    page = runs_page([row], "<q>", "updated_at", True, 1)
    assert "<b>x</b>" not in page and "&lt;b&gt;x&lt;/b&gt;" in page
    assert "<i>t</i>" not in page and "<q>" not in page
    assert "<script" not in page  # the table needs no script


def test_boot_data_cannot_close_its_script():
    page = charts_page("t", "t", ["a</script><script>alert(1)//"], "step", True)
    boot = re.search(r"<script id='boot' type='application/json'>(.*?)</script>", page, re.S)
    assert boot is not None
    data = json.loads(boot.group(1))
    assert data["runs"] == ["a</script><script>alert(1)//"]
    assert [c["key"] for c in data["charts"]] == [c.key for c in CHARTS]
    smooth = {c["key"]: c["smooth"] for c in data["charts"]}
    assert smooth["lr"] is False and smooth["cospike"] is False and smooth["loss"] is True


def test_notes_are_a_form_per_row_or_read_only_with_the_reason():
    row = {**ROWS[0], "note": "<b>lr</b> too high", "user_tags": ["bad"], "run_id": "a/b"}
    page = runs_page([row], "", "updated_at", True, 1)
    assert "<form id='note-0' method='post' action='/run/a%2Fb/note'></form>" in page
    assert "name='note' form='note-0' value='&lt;b&gt;lr&lt;/b&gt; too high'" in page
    assert "name='tags' form='note-0' value='bad'" in page and "<b>lr" not in page
    ro = runs_page([row], "", "updated_at", True, 1, read_only="notes are read-only: why")
    assert "method='post'" not in ro and "name='note'" not in ro
    assert "<td class='l note'>&lt;b&gt;lr&lt;/b&gt; too high</td>" in ro
    assert "<p class='muted' id='notes-read-only'>notes are read-only: why</p>" in ro
    assert tag_list(" a, b,,c  a ") == ["a", "b", "c", "a"]
