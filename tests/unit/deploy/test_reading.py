"""How the CLI prints rows: strict JSON (NaN/Inf become null), CSV and TSV."""

from __future__ import annotations

import datetime as dt
import json
import math

import pytest

from probewire.deploy.reading import json_value, render_rows

COLUMNS = ["step", "loss", "groups", "at"]
ROWS = [
    (1, 2.5, {"0": 1e-3}, dt.datetime(2026, 1, 2, 3, 4, 5)),
    (2, math.nan, {}, None),
    (3, math.inf, {"w": -math.inf}, None),
]


def test_json_is_strict_with_non_finite_values_as_null():
    text = render_rows(COLUMNS, ROWS, "json")
    parsed = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict {c}"))
    assert parsed[0] == {"step": 1, "loss": 2.5, "groups": {"0": 1e-3}, "at": "2026-01-02T03:04:05"}
    assert parsed[1]["loss"] is None and parsed[2]["loss"] is None
    assert parsed[2]["groups"] == {"w": None}


@pytest.mark.parametrize("fmt, sep", [("csv", ","), ("tsv", "\t")])
def test_csv_and_tsv_have_a_header_and_one_line_per_row(fmt, sep):
    lines = render_rows(COLUMNS, ROWS, fmt).splitlines()
    assert lines[0] == sep.join(COLUMNS)
    assert lines[2].split(sep)[:2] == ["2", "nan"] and lines[2].split(sep)[3] == ""
    assert len(lines) == 1 + len(ROWS)


def test_json_value_of_numpy_scalars_and_nested_lists():
    import numpy as np

    assert json_value([np.float64("nan"), np.int64(3), (1.0, float("-inf"))]) == [
        None,
        3,
        [1.0, None],
    ]
