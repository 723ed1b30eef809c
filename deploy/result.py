"""What a finished run says at the end of ``probewire demo`` and ``probewire run``: its
status, its pages (signal, step, culprit), the metrics it logged of its own
(``user_metrics``) and the next commands, with the run id and the store filled in, ready
to paste."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

__all__ = ["Page", "RunResult", "load_result", "render_result"]


@dataclass(frozen=True, slots=True)
class Page:
    signal: str
    step: int
    culprit: str
    message: str


@dataclass(frozen=True, slots=True)
class RunResult:
    run_id: str
    status: str
    steps: int
    last_step: int
    pages: tuple[Page, ...]
    user_metrics: tuple[str, ...] = ()  # names the run logged with Monitor.log / s.log


def load_result(client: Any, database: str, run_id: str) -> RunResult:
    """The run's row, step count and pages, read with SQL."""
    params = {"run": run_id}
    row = client.query(
        f"SELECT status, last_step FROM {database}.runs FINAL WHERE run_id = {{run:String}}",
        parameters=params,
    ).result_rows
    steps = client.query(
        f"SELECT count() FROM {database}.step_metrics FINAL WHERE run_id = {{run:String}}",
        parameters=params,
    ).result_rows[0][0]
    pages = client.query(
        f"SELECT signal, step, culprit, message FROM {database}.alerts FINAL "
        "WHERE run_id = {run:String} AND severity = 'page' ORDER BY step, "
        "signal",
        parameters=params,
    ).result_rows
    names = client.query(
        f"SELECT DISTINCT name FROM {database}.user_metrics WHERE run_id = {{run:String}} "
        "ORDER BY name",
        parameters=params,
    ).result_rows
    status, last = row[0] if row else ("not seen", 0)
    return RunResult(
        run_id,
        str(status),
        int(steps),
        int(last),
        tuple(Page(str(s), int(t), str(c), str(m)) for s, t, c, m in pages),
        tuple(str(n) for (n,) in names),
    )


def render_result(
    result: RunResult, store_args: str, database: str = "probewire", max_pages: int = 20
) -> str:
    """The text block (``store_args``: ``--store DIR`` or ``--clickhouse-url URL``, or "")."""
    where = f" {store_args.strip()}" if store_args.strip() else ""
    run = shlex.quote(result.run_id)
    lines = [
        f"run {result.run_id}: {result.status}, {result.steps} steps stored "
        f"(last step {result.last_step}), {len(result.pages)} page(s)"
    ]
    if result.pages:
        lines.append(f"  {'signal':<18} {'step':>7}  culprit")
        for page in result.pages[:max_pages]:
            lines.append(f"  {page.signal:<18} {page.step:>7}  {page.culprit or '-'}")
        if len(result.pages) > max_pages:
            lines.append(f"  ... and {len(result.pages) - max_pages} more (table alerts)")
    if result.user_metrics:
        lines.append("your metrics (user_metrics): " + ", ".join(result.user_metrics))
    step = result.pages[0].step if result.pages else result.last_step
    lines += [
        "next:",
        f"  probewire report --run {run}{where}",
        f"  probewire explain --run {run} --step {step}{where}",
        f"  probewire sql{where} "
        + _shell_arg(
            f"SELECT step, loss, grad_norm, lr, step_time_s FROM {database}.step_metrics "
            f"FINAL WHERE run_id = {_sql_string(result.run_id)} ORDER BY step"
        ),
    ]
    if result.user_metrics:
        lines.append(
            f"  probewire sql{where} "
            + _shell_arg(
                f"SELECT step, value FROM {database}.user_metrics FINAL WHERE run_id = "
                f"{_sql_string(result.run_id)} AND name = "
                f"{_sql_string(result.user_metrics[0])} ORDER BY step"
            )
        )
    return "\n".join(lines)


def _sql_string(text: str) -> str:
    """``text`` as a ClickHouse string literal (backslash and quote escaped)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _shell_arg(text: str) -> str:
    """``text`` as one shell word that expands to nothing else: in double quotes when it
    holds none of the characters a shell treats specially there (``$``, backquote,
    backslash, ``"``, ``!``) nor a control character, else ``shlex.quote``."""
    if text.isprintable() and not set(text) & set('$`\\"!'):
        return f'"{text}"'
    return shlex.quote(text)
