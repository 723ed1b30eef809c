"""``probewire explain``: what moved at one step, in the escalation order, and who carries it.

Three parts: ``load`` reads the step's evidence from the store, ``score`` walks the
escalation order over it (the robust z of the stream's detector module), ``render`` prints
it. ``explain`` is load then score.
"""

from __future__ import annotations

from typing import Any

from .load import load
from .model import STAGES, Explanation, Finding, Page, StepNotFound
from .render import render
from .score import score

__all__ = ["STAGES", "Explanation", "Finding", "Page", "StepNotFound", "explain", "render"]


def explain(
    client: Any,
    database: str,
    run_id: str,
    step: int,
    *,
    window: int = 50,
    trend_window: int = 20,
    lookback: int = 10,
    z_threshold: float = 6.0,
    min_change: float = 0.02,
    jump_ratio: float = 3.0,
    layer_history: int = 10,
    min_history: int = 20,
) -> Explanation:
    """Walk the escalation order for ``step`` of ``run_id`` (see ``score``)."""
    loaded = load(
        client,
        database,
        run_id,
        step,
        window=window,
        lookback=lookback,
        layer_history=layer_history,
    )
    return score(
        loaded,
        trend_window=trend_window,
        z_threshold=z_threshold,
        min_change=min_change,
        jump_ratio=jump_ratio,
        min_history=min_history,
    )
