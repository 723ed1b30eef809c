"""Typed records that move between the stream's stages (plain data, JSON on the wire)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

__all__ = ["Labels", "RankStep", "ReducedStep", "SeriesKey", "series_key"]

Labels = tuple[tuple[str, str], ...]
SeriesKey = tuple[str, Labels]  # (metric name, sorted labels)


def series_key(name: str, labels: Mapping[str, str] | Labels = ()) -> SeriesKey:
    items = labels.items() if isinstance(labels, Mapping) else labels
    return name, tuple(sorted((str(k), str(v)) for k, v in items))


def _encode_key(key: SeriesKey) -> str:
    name, labels = key
    return name + "".join(f"|{k}={v}" for k, v in labels)


def _decode_key(text: str) -> SeriesKey:
    name, *pairs = text.split("|")
    return name, tuple(tuple(p.split("=", 1)) for p in pairs)  # type: ignore[misc]


def _json_float(value: float) -> float | str:
    return value if math.isfinite(value) else repr(value)  # "nan", "inf", "-inf"


@dataclass(slots=True, kw_only=True)
class RankStep:
    """Everything one rank reported for one step (one Kafka message)."""

    run_id: str
    step: int
    rank: int
    world_size: int
    host: str
    coords: dict[str, int]
    values: dict[SeriesKey, float]


@dataclass(slots=True, kw_only=True)
class ReducedStep:
    """Stage 1's output for one (run, step): reduced values plus the per-rank components."""

    run_id: str
    step: int
    world_size: int
    ranks_reporting: list[int]
    ranks_missing: list[int]
    reduced: dict[SeriesKey, float]
    per_rank: dict[int, dict[SeriesKey, float]]
    hosts: dict[int, str] = field(default_factory=dict)
    coords: dict[int, dict[str, int]] = field(default_factory=dict)  # rank -> {dp: i, ...}
    complete_reason: str = "all_ranks"  # or "deadline", "later_step", "late"

    def to_json(self) -> bytes:
        body: dict[str, Any] = asdict(self)
        body["reduced"] = {_encode_key(k): _json_float(v) for k, v in self.reduced.items()}
        body["per_rank"] = {str(r): {_encode_key(k): _json_float(v) for k, v in vals.items()}
                            for r, vals in self.per_rank.items()}
        body["hosts"] = {str(r): h for r, h in self.hosts.items()}
        body["coords"] = {str(r): c for r, c in self.coords.items()}
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, payload: bytes) -> "ReducedStep":
        body = json.loads(payload)
        body["reduced"] = {_decode_key(k): float(v) for k, v in body["reduced"].items()}
        body["per_rank"] = {int(r): {_decode_key(k): float(v) for k, v in vals.items()}
                            for r, vals in body["per_rank"].items()}
        body["hosts"] = {int(r): h for r, h in body.get("hosts", {}).items()}
        body["coords"] = {int(r): c for r, c in body.get("coords", {}).items()}
        return cls(**body)
