"""The ``probewire`` command line.

    probewire demo [--ranks N] [--steps N] [--store DIR]   run the embedded pipeline
    probewire up [--store DIR] [--evaluator]                the local stack for your own run
    probewire run [--store DIR] -- CMD ...                  your command inside the stack
    probewire sync DIR [--store DIR]                        replay offline ranks' spool files
    probewire sql [--store DIR | --clickhouse-url URL] [--format vertical] "SELECT ..."
    probewire runs                                          the runs in the store, one row each
    probewire worker [--role all|stage1|detail]             the stream worker (Faust)
    probewire migrate                                       create / upgrade the schema
    probewire report --run A [--run B ...] [--out DIR]      interactive HTML + PNG per run
    probewire explain --run ID --step N                     what moved first at a step, and who
    probewire health --component worker|evaluator          exit 0 when fresh and progressing

A user mistake prints one line on stderr and exits with code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from rich.table import Table

from probewire.deploy.console import console
from probewire.deploy.health import default_heartbeat_path, read_heartbeat, writer_alive
from probewire.deploy.logs import FORMATS, logging_config
from probewire.deploy.services import PreflightError, open_store, preflight
from probewire.deploy.settings import Settings, SettingsError, load_settings
from probewire.stream.config import ROLES

__all__ = ["main"]

DEFAULT_STORE = "probewire-data"


class UserError(Exception):
    """A mistake the user can fix; printed without a traceback."""


def _store_url(args: argparse.Namespace) -> dict[str, str]:
    url = getattr(args, "clickhouse_url", None) or os.environ.get("CLICKHOUSE_URL")
    if url:
        return {"url": url}
    store = getattr(args, "store", None)
    if store:
        return {"url": "chdb:///" + str(Path(store).resolve()).lstrip("/")}
    return {}


def _check_run_id(args: argparse.Namespace) -> None:
    """A --run-id the store and the printed commands cannot hold is a user error."""
    from probewire.instrument.wire import run_id_problem

    problem = run_id_problem(args.run_id) if args.run_id else None
    if problem is not None:
        raise UserError(f"--run-id {problem}, got {args.run_id!r}")


def _settings(args: argparse.Namespace) -> Settings:
    overrides = {"clickhouse": _store_url(args)}
    if not overrides["clickhouse"] and "PROBEWIRE_CLICKHOUSE__URL" not in os.environ:
        overrides["clickhouse"] = {
            "url": "chdb:///" + str(Path(DEFAULT_STORE).resolve()).lstrip("/")
        }
    return load_settings(getattr(args, "config", None), overrides=overrides)


def _client(settings: Settings, hint: str = "run `probewire demo` first or pass --store DIR"):
    """A client that reads the configured store (a live reader when the worker owns it)."""
    from probewire.deploy.reading import StoreError, open_client

    ch = settings.clickhouse
    try:
        return open_client(ch.url, username=ch.username, password_env=ch.password_env, hint=hint)
    except StoreError as exc:
        raise UserError(str(exc)) from None


def _query(
    settings: Settings, sql: str, parameters: dict | None = None
) -> tuple[list[str], list[tuple]]:
    client = _client(settings)
    from clickhouse_connect.driver.exceptions import ClickHouseError

    try:
        result = client.query(sql, parameters=parameters)
    except ClickHouseError as exc:
        raise UserError(f"query failed: {_error_line(exc)}") from None
    return list(result.column_names), list(result.result_rows)


def _error_line(exc: BaseException) -> str:
    """The engine's own message, one line (a server's reply is wrapped by the client)."""
    text = str(exc).strip()
    if "server response: " in text:
        text = text.split("server response: ", 1)[1]
    return text.splitlines()[0] if text else type(exc).__name__


def _print_table(title: str, columns: list[str], rows: list[tuple]) -> None:
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right", overflow="fold")
    for row in rows:
        table.add_row(*[f"{v:.6g}" if isinstance(v, float) else str(v) for v in row])
    console().print(table)


def cmd_demo(args: argparse.Namespace) -> int:
    from probewire.deploy.services import held_store

    if args.ranks < 1 or args.steps < 1 or args.evaluate_every < 0:
        raise UserError("--ranks and --steps must be >= 1, --evaluate-every >= 0")
    _check_run_id(args)
    settings = _settings(args)
    held = held_store(settings)  # at once: before the demo's imports and its worker's wait
    if held is not None:
        raise UserError(held)
    from probewire.deploy.demo.faults import FaultError, demo_train_args
    from probewire.deploy.demo.run import run_demo
    from probewire.deploy.stack import StackError

    try:
        train_args = demo_train_args(args.fault, args.preset)
    except FaultError as exc:
        raise UserError(str(exc)) from None
    work_dir = Path(args.work_dir or Path(DEFAULT_STORE).resolve().parent / ".probewire-run")
    try:
        result = run_demo(
            settings,
            ranks=args.ranks,
            steps=args.steps,
            work_dir=work_dir,
            run_id=args.run_id,
            evaluate_every=args.evaluate_every,
            extra_train_args=train_args,
        )
    except StackError as exc:
        raise UserError(str(exc)) from None
    columns, rows = _query(
        settings,
        f"""
        SELECT step, tokens, round(loss, 5) AS L, round(loss_worst_rank, 5) AS L_max,
               round(grad_norm, 6) AS G2, round(step_time_s, 4) AS step_time_s,
               ranks_reporting AS ranks
        FROM {settings.clickhouse.database}.step_metrics FINAL
        WHERE run_id = {{run:String}} ORDER BY step DESC LIMIT {{show:UInt32}}""",
        {"run": result.run_id, "show": args.show},
    )
    _print_table(
        f"run {result.run_id}: last {len(rows)} of {result.steps_written} steps "
        f"(read back from ClickHouse; wall {result.wall_s:.1f}s)",
        columns,
        sorted(rows),
    )
    _print_result(settings, result.run_id, args)
    return 0


def _store_args(args: argparse.Namespace) -> str:
    """The store options the next commands need, as the user gave them."""
    import shlex

    if getattr(args, "clickhouse_url", None):
        return f"--clickhouse-url {shlex.quote(args.clickhouse_url)}"
    if getattr(args, "store", None):
        return f"--store {shlex.quote(args.store)}"
    return ""


def _print_result(settings: Settings, run_id: str, args: argparse.Namespace) -> None:
    """The run's status, pages and next commands (``deploy.result``)."""
    from probewire.deploy.result import load_result, render_result

    result = load_result(_client(settings), settings.clickhouse.database, run_id)
    print(render_result(result, _store_args(args), settings.clickhouse.database))


def _work_dir(args: argparse.Namespace, settings: Settings) -> Path:
    """Logs, heartbeats and the session file: --work-dir, else next to an embedded store."""
    if args.work_dir:
        return Path(args.work_dir).resolve()
    url = settings.clickhouse.url
    if url.startswith("chdb:///"):
        store = Path(url[len("chdb://") :])
        return store.parent / f".probewire-{store.name}"
    return Path(".probewire-run").resolve()


def cmd_up(args: argparse.Namespace) -> int:
    from probewire.deploy.session import SessionError, up
    from probewire.deploy.stack import StackError

    if args.sql_port < 0 or args.sql_port > 65535:
        raise UserError("--sql-port must lie in [0, 65535] (0: a free port)")
    if args.ui_port < -1 or args.ui_port > 65535:
        raise UserError("--ui-port must lie in [0, 65535] (0: a free port) or be -1 (no UI)")
    settings = _settings(args)
    try:
        return up(
            settings,
            _work_dir(args, settings),
            evaluator=args.evaluator,
            sql_port=args.sql_port,
            ui_port=args.ui_port,
        )
    except (SessionError, StackError) as exc:
        raise UserError(str(exc)) from None


def cmd_run(args: argparse.Namespace) -> int:
    from probewire.deploy.session import SessionError, run_command
    from probewire.deploy.stack import StackError

    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    if args.sql_port < 0 or args.sql_port > 65535:
        raise UserError("--sql-port must lie in [0, 65535] (0: a free port)")
    _check_run_id(args)
    settings = _settings(args)
    try:
        code = run_command(
            settings,
            _work_dir(args, settings),
            command,
            run_id=args.run_id,
            evaluator=args.evaluator,
            sql_port=args.sql_port,
            report=lambda run_id: _print_result(settings, run_id, args),
        )
    except (SessionError, StackError) as exc:
        raise UserError(str(exc)) from None
    if code != 0:
        say_error(args, f"probewire: the command exited with code {code}")
    return code


def cmd_sync(args: argparse.Namespace) -> int:
    """Replay offline spool files (``deploy.sync``): into the local stack of ``--store``,
    else into the configured Kafka."""
    from probewire.deploy.session import SessionError
    from probewire.deploy.stack import StackError
    from probewire.deploy.sync import sync

    settings = _settings(args) if args.store else load_settings(getattr(args, "config", None))
    try:
        return sync(settings, Path(args.dir), _work_dir(args, settings) if args.store else None)
    except (SessionError, StackError) as exc:
        raise UserError(str(exc)) from None


def _vertical(columns: list[str], rows: list[tuple]) -> str:
    """Rows one column per line (as ClickHouse's ``\\G``): readable at 80 characters
    however many columns a row has."""
    width = max((len(c) for c in columns), default=0)
    out = []
    for i, row in enumerate(rows, 1):
        out.append(f"-- row {i} " + "-" * max(0, 70 - len(str(i))))
        out += [
            f"{c:>{width}}  {f'{v:.6g}' if isinstance(v, float) else v}"
            for c, v in zip(columns, row)
        ]
    return "\n".join(out)


def cmd_sql(args: argparse.Namespace) -> int:
    columns, rows = _query(_settings(args), args.query)
    if args.format == "vertical":
        print(_vertical(columns, rows))
    elif args.format == "table":
        _print_table("", columns, rows)
    else:
        from probewire.deploy.reading import render_rows

        print(render_rows(columns, rows, args.format))
    return 0


_USER_NAMES = (
    "if(length(u.names) > 4, concat(arrayStringConcat(arraySlice(u.names, 1, 4), ' '), "
    "' +', toString(length(u.names) - 4)), arrayStringConcat(u.names, ' '))"
)
"""``probewire runs``' user metrics cell: the run's first four names, then how many more."""


def cmd_runs(args: argparse.Namespace) -> int:
    settings = _settings(args)
    db = settings.clickhouse.database
    columns, rows = _query(
        settings,
        f"""
        SELECT r.run_id AS run, r.status AS status, r.world_size AS ranks,
               s.steps AS steps, s.tokens AS tokens, {_USER_NAMES} AS user_metrics,
               r.updated_at AS updated
        FROM (SELECT * FROM {db}.runs FINAL) AS r
        LEFT JOIN (SELECT run_id, count() AS steps, max(tokens) AS tokens
                   FROM {db}.step_metrics FINAL GROUP BY run_id) AS s ON r.run_id = s.run_id
        LEFT JOIN (SELECT run_id, arraySort(groupUniqArray(name)) AS names
                   FROM {db}.user_metrics GROUP BY run_id) AS u ON r.run_id = u.run_id
        ORDER BY r.updated_at DESC""",
    )
    _print_table(f"runs in {db} (one row per run)", columns, rows)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    import functools

    import faust

    from probewire.deploy.fault_injection import fault_hook
    from probewire.stream.app import create_app
    from probewire.stream.publish import broker_message_limit, check_message_limit

    settings = load_settings(
        args.config, overrides={"stream": {"role": args.role}} if args.role else None
    )
    heartbeat = Path(os.environ.get("PROBEWIRE_HEARTBEAT_FILE") or default_heartbeat_path("worker"))
    if settings.stream.role == "detail":  # the detail never takes CPU from a page
        os.nice(settings.stream.detail_nice)
    owns_store = settings.stream.role == "all"
    _preflight(settings, heartbeat, owns_store)  # a free store, a broker, the topics first
    topics = settings.topics
    check_message_limit(
        settings.stream.max_message_bytes,
        broker_message_limit(settings.kafka.client_config(), [topics.steps, topics.deadletter]),
    )
    app = create_app(
        settings.stream,
        settings.kafka,
        settings.topics,
        functools.partial(open_store, settings, read_port=args.sql_port),
        heartbeat,
        fault_hook(),
    )
    worker = faust.Worker(
        app,
        loglevel=args.loglevel,
        quiet=True,
        redirect_stdouts=False,
        logging_config=logging_config(args.log_format, args.loglevel, "worker"),
    )
    app.probewire_worker.collector.start()  # built: what exists now is frozen (collector)
    try:
        worker.execute_from_commandline()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    else:
        code = 0
    return _worker_exit(worker, app, code)


def _worker_exit(worker: Any, app: Any, code: int) -> int:
    """The worker's exit code: as Faust gave it when a signal stopped it; else (it stopped
    by itself) 1 or Faust's code, with why at error level, so that it is restarted."""
    if worker._signal_stop_time is not None:  # SIGTERM / SIGINT: asked to stop
        return code
    reason = app.crash_reason or worker.crash_reason
    logging.getLogger("probewire.worker").error(
        "probewire: the worker stopped without being asked to (%s); exiting with code %d",
        f"{type(reason).__name__}: {reason}" if reason else "no error reported by Faust",
        code or 1,
    )
    return code or 1


def _preflight(settings: Settings, heartbeat: Path, owns_store: bool = False) -> None:
    try:
        preflight(settings, heartbeat, owns_store=owns_store)
    except PreflightError as exc:
        raise UserError(str(exc)) from None


def cmd_migrate(args: argparse.Namespace) -> int:
    from probewire.sinks.clickhouse import ClickHouseSink, connect

    ch = _settings(args).clickhouse
    version = ClickHouseSink(
        connect(ch.url, username=ch.username, password_env=ch.password_env),
        ch.database,
        ch.retry_max_s,
    ).migrate(sensitive_artifacts=ch.sensitive_artifacts, sensitive_ttl_days=ch.sensitive_ttl_days)
    extra = (
        f", with sensitive_artifacts (TTL {ch.sensitive_ttl_days} days)"
        if ch.sensitive_artifacts
        else ""
    )
    print(f"schema of {ch.database} at version {version}{extra}")
    return 0


MAX_AGE_S = {"worker": 10.0, "evaluator": 60.0}
"""``probewire health``: the oldest heartbeat that passes, per component."""


def say_error(args: argparse.Namespace, text: str) -> None:
    """One line on stderr: as it is, or with ``--log-format json`` one JSON object (the
    same shape as every service's log lines, ``deploy.logs``)."""
    if getattr(args, "log_format", "text") == "json":
        logging.getLogger("probewire.cli").error(text)
    else:
        print(text, file=sys.stderr)


def _store_heartbeat(store: Path, component: str) -> Path:
    """The heartbeat of the ``component`` serving ``store`` (``up`` / ``run`` / ``demo``):
    the one its live session names, else the one in the session's work dir."""
    work_dir = store.parent / f".probewire-{store.name}"
    try:
        named = json.loads((work_dir / "session.json").read_text())["heartbeat"]
    except (OSError, ValueError, KeyError, TypeError):
        named = None
    if component == "worker" and named:
        return Path(named)
    return work_dir / f"{component}.heartbeat"


def cmd_health(args: argparse.Namespace) -> int:
    store = Path(args.store).resolve() if args.store else None
    if args.heartbeat:
        path = Path(args.heartbeat)
    elif store is not None:
        path = _store_heartbeat(store, args.component)
    else:
        path = default_heartbeat_path(args.component)
    beat = read_heartbeat(path)
    if beat is None:
        print(f"{args.component}: no heartbeat at {path}", file=sys.stderr)
        return 1
    pid = beat.get("pid")
    if isinstance(pid, int) and not writer_alive(pid):
        print(f"{args.component}: not running (pid {pid} of {path} is gone)", file=sys.stderr)
        return 1
    age, max_age = time.time() - float(beat["ts"]), args.max_age_s or MAX_AGE_S[args.component]
    if age > max_age:
        say_error(
            args, f"{args.component}: heartbeat {age:.0f}s old (> {max_age:g}s): frozen or stopped"
        )
        return 1
    if beat.get("healthy") is False:  # the worker's verdict on its own progress
        for reason in beat.get("reasons") or ["unhealthy"]:
            print(f"{args.component}: {reason}", file=sys.stderr)
        return 1
    reader = ""
    if store is not None and args.component == "worker":
        from probewire.sinks.readserver import find_reader

        url = find_reader(store)
        reader = f"; live reads at {url}" if url else "; no live reader for the store"
    print(f"{args.component}: {beat.get('status')} ({age:.1f}s ago, {path}){reader}")
    return 0


def _open_store(settings: Settings):
    """A client on the configured store; a missing chdb directory is a user error."""
    return _client(settings, hint="pass --store DIR")


def cmd_report(args: argparse.Namespace) -> int:
    from clickhouse_connect.driver.exceptions import ClickHouseError

    from probewire.deploy.report import RunNotFound, write_report

    settings = _settings(args)
    try:
        html_path, png_paths = write_report(
            _open_store(settings), settings.clickhouse.database, args.run, Path(args.out)
        )
    except (RunNotFound, ValueError) as exc:
        raise UserError(str(exc)) from None
    except ClickHouseError as exc:
        raise UserError(f"query failed: {_error_line(exc)}") from None
    print(f"wrote {html_path} and {', '.join(str(p) for p in png_paths)}")
    return 0


def cmd_ui(args: argparse.Namespace) -> int:
    import secrets

    from probewire.deploy.ui import UI_TOKEN_ENV, Notes, Store, serve

    settings = _settings(args)
    store = Store(lambda: _open_store(settings), settings.clickhouse.database)
    store.read(lambda client, db: None)  # an unreadable store is a one-line error now
    token = os.environ.get(UI_TOKEN_ENV) or secrets.token_urlsafe(24)
    notes = Notes({"bootstrap.servers": args.broker}, settings.topics.runs) if args.broker else None
    try:
        serve(
            store,
            args.port,
            token,
            lambda url: print(f"probewire ui: {url}", flush=True),
            notes,
        )
    except OSError as exc:
        raise UserError(f"cannot serve on 127.0.0.1:{args.port}: {exc.strerror}") from None
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from clickhouse_connect.driver.exceptions import ClickHouseError

    from probewire.deploy.explain import StepNotFound, explain, render

    settings = _settings(args)
    try:
        result = explain(
            _open_store(settings),
            settings.clickhouse.database,
            args.run,
            args.step,
            window=args.window,
            lookback=args.lookback,
            z_threshold=args.z,
        )
    except StepNotFound as exc:
        raise UserError(str(exc)) from None
    except ClickHouseError as exc:
        raise UserError(f"query failed: {_error_line(exc)}") from None
    if args.format == "json":
        import dataclasses

        from probewire.deploy.reading import json_value

        first = result.first
        body = {
            "run_id": result.run_id,
            "step": result.step,
            "tokens": result.tokens,
            "headline": result.headline(),
            "first": None if first is None else first.signal,
            "pages": [dataclasses.asdict(p) for p in result.pages],
            "ranked": [f.signal for f in result.ranked],
            "findings": [dataclasses.asdict(f) for f in result.findings],
        }
        print(json.dumps(json_value(body), allow_nan=False))  # strict: NaN/Inf are null
    else:
        render(result)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from probewire.stream.calibration import COLUMNS, DETECTOR_FIELDS, calibrate_run
    from probewire.stream.heldout import BPB_METRIC

    settings = _settings(args)
    db, run = settings.clickhouse.database, {"run": args.run}
    names, rows = _query(
        settings,
        f"SELECT {', '.join(COLUMNS)} FROM {db}"
        ".step_metrics FINAL WHERE run_id = {run:String} ORDER BY step",
        run,
    )
    if not rows:
        raise UserError(f"run {args.run!r} has no steps in the store")
    series = {name: [row[i] for row in rows] for i, name in enumerate(names)}
    _, residual = _query(
        settings,
        f"SELECT step, ratio FROM {db}.residual_stats FINAL "
        "WHERE run_id = {run:String} ORDER BY step",
        run,
    )
    _, evaluations = _query(
        settings,
        f"SELECT suite, step, value FROM {db}.evaluations FINAL WHERE run_id = {{run:String}} "
        "AND metric = {metric:String} AND reference = 1 ORDER BY suite, step",
        {**run, "metric": BPB_METRIC},
    )
    detectors = settings.stream.stage2.detectors
    window = args.window or detectors.window
    try:
        results = calibrate_run(
            series,
            window,
            args.quantile,
            args.margin,
            detectors,
            residual=[(int(step), ratio) for step, ratio in residual],
            evaluations=[(str(suite), int(step), value) for suite, step, value in evaluations],
        )
    except ValueError as exc:
        raise UserError(f"cannot calibrate on run {args.run!r}: {exc}") from None
    _print_table(
        f"thresholds from run {args.run} (window {window}, {args.margin} x "
        f"quantile {args.quantile} of its robust z, of the level its rule held for k steps, "
        "of the move held over its own baseline, of the loop's gradient norm's mismatch to "
        "G2, of the residual branches' per-step extremes (the smallest: its 1 - quantile, "
        "over the margin), or of the held-out BPB's rise over its recent evaluations)",
        ["setting", "series", "threshold", "steps"],
        [(c.setting, c.column, c.threshold, c.n_steps) for c in results],
    )
    fields = "".join(f"      {DETECTOR_FIELDS[c.setting]}: {c.threshold:.3f}\n" for c in results)
    print("stream:\n  stage2:\n    detectors:\n" + fields, end="")
    return 0


class _Parser(argparse.ArgumentParser):
    """A usage mistake is one line on stderr and exit code 2 (argparse printed the whole
    usage first); ``--help`` is unchanged."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low`` (``explain --step -1`` is a usage error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}")
        return value

    return parse


def _positive(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not > 0")
    return value


def _add_demo(sub: argparse._SubParsersAction) -> None:
    """``probewire demo``: the embedded pipeline on a real training run, faults optional."""
    demo = sub.add_parser("demo", help="run the embedded pipeline on a real 2-rank training run")
    demo.add_argument("--ranks", type=int, default=2)
    demo.add_argument("--steps", type=int, default=200)
    demo.add_argument("--store", help=f"chdb data directory (default ./{DEFAULT_STORE})")
    demo.add_argument("--run-id", help="run id (default: demo-<random>)")
    demo.add_argument("--show", type=int, default=10, help="how many last steps to print")
    demo.add_argument("--work-dir", help="logs and heartbeat of the local stack")
    demo.add_argument(
        "--evaluate-every",
        type=int,
        default=0,
        metavar="N",
        help="checkpoint every N steps and score them with the evaluator",
    )
    demo.add_argument(
        "--preset",
        help="demo model: tiny (dense), moe (experts), media (images), full "
        "(all); default: tiny, or what the --fault needs",
    )
    demo.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="NAME[@STEP][:K=V,...]",
        help="inject a real training fault (repeatable): bad-rank, "
        "source-regression, poisoned-batch, layer-explosion, straggler, "
        "memory-creep, flaky-replay, routing-collapse, ignored-media, "
        "bf16-swallow, nan-weight; easy-batch (must page nothing)",
    )
    demo.set_defaults(func=cmd_demo)


def _add_stack(sub: argparse._SubParsersAction) -> None:
    """``probewire up`` and ``probewire run``: the local stack for the user's own training."""
    for name, text in (
        ("up", "start the local stack for your own training script; Ctrl-C stops it"),
        ("run", "run a training command inside the local stack, then print its pages"),
    ):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--store", help=f"chdb data directory (default ./{DEFAULT_STORE})")
        cmd.add_argument(
            "--evaluator", action="store_true", help="also start the checkpoint evaluator"
        )
        cmd.add_argument(
            "--sql-port",
            type=int,
            default=0,
            help="loopback port of the live read-only SQL endpoint (ClickHouse "
            "HTTP; 0: a free port)",
        )
        cmd.add_argument(
            "--work-dir",
            help="logs, heartbeats and the session file (default: "
            ".probewire-<store name> next to the store)",
        )
        if name == "up":
            cmd.add_argument(
                "--ui-port",
                type=int,
                default=0,
                help="loopback port of the web UI (`probewire ui`; 0: a free port, -1: none)",
            )
        if name == "run":
            cmd.add_argument(
                "--run-id", help="run id (default: run-<random>); exported as PROBEWIRE_RUN_ID"
            )
            cmd.add_argument(
                "cmd",
                nargs=argparse.REMAINDER,
                help="the command, after --: torchrun --nproc-per-node 2 train.py",
            )
        cmd.set_defaults(func=cmd_up if name == "up" else cmd_run)


def _add_sync(sub: argparse._SubParsersAction) -> None:
    """``probewire sync``: replay offline ranks' spool files."""
    sync = sub.add_parser(
        "sync", help="replay the spool files of offline ranks (PROBEWIRE_MODE=offline)"
    )
    sync.add_argument("dir", help="the runs' PROBEWIRE_SPOOL_DIR")
    sync.add_argument("--store", help="chdb data directory: replay through the local stack into it")
    sync.add_argument("--work-dir", help="the local stack's logs (default: next to the store)")
    sync.set_defaults(func=cmd_sync)


def _add_store_reads(sub: argparse._SubParsersAction) -> None:
    """``probewire sql`` and ``probewire runs``: read the store."""
    sql = sub.add_parser("sql", help="run SQL on the store")
    sql.add_argument("query")
    sql.add_argument("--store", help=f"chdb data directory (default ./{DEFAULT_STORE})")
    sql.add_argument("--clickhouse-url", help="http(s):// server instead (env: CLICKHOUSE_URL)")
    sql.add_argument(
        "--format",
        choices=["table", "vertical", "json", "csv", "tsv"],
        default="table",
        help="vertical: one column per line (wide rows such as "
        "first_screen); json is strict: NaN and Inf become null",
    )
    sql.set_defaults(func=cmd_sql)

    runs = sub.add_parser("runs", help="list the runs in the store, one row per run")
    runs.add_argument("--store", help=f"chdb data directory (default ./{DEFAULT_STORE})")
    runs.add_argument("--clickhouse-url", help="http(s):// server instead (env: CLICKHOUSE_URL)")
    runs.set_defaults(func=cmd_runs)


def _add_worker(sub: argparse._SubParsersAction) -> None:
    """``probewire worker``: the stream worker."""
    worker = sub.add_parser("worker", help="run the stream worker (Faust)")
    worker.add_argument("--loglevel", default="warning")
    worker.add_argument(
        "--sql-port",
        type=int,
        default=0,
        help="loopback port of the read-only SQL endpoint of an embedded store "
        "(0: a free port, -1: off)",
    )
    worker.add_argument(
        "--role",
        choices=ROLES,
        help="all: stage 1, stage 2 and the store (the default, or "
        "stream.role); stage1: stage 1 only, no store (more workers "
        "beside the one that owns an embedded store); detail: stage 1 of "
        "the scan-tier detail topic only (with stream.detail_inline: false "
        "on the owner)",
    )
    worker.set_defaults(func=cmd_worker)


def _add_operations(sub: argparse._SubParsersAction) -> None:
    """``probewire migrate``, ``calibrate`` and ``health``: the operator's commands."""
    migrate = sub.add_parser("migrate", help="create or upgrade the ClickHouse schema")
    migrate.add_argument("--store")
    migrate.add_argument("--clickhouse-url")
    migrate.set_defaults(func=cmd_migrate)

    calibrate = sub.add_parser("calibrate", help="derive detector thresholds from a stable run")
    calibrate.add_argument("--run", required=True, help="run id of a stable (healthy) run")
    calibrate.add_argument("--store")
    calibrate.add_argument("--clickhouse-url")
    calibrate.add_argument("--window", type=int, help="detector window (default: settings)")
    calibrate.add_argument("--quantile", type=float, default=0.999)
    calibrate.add_argument("--margin", type=float, default=1.5)
    calibrate.set_defaults(func=cmd_calibrate)

    health = sub.add_parser("health", help="exit 0 when a service's heartbeat is fresh")
    health.add_argument("--component", choices=["worker", "evaluator"], required=True)
    health.add_argument("--heartbeat", help="heartbeat file (default: per component)")
    health.add_argument(
        "--store", help="the chdb store an `up` / `run` serves: its heartbeat and reader"
    )
    health.add_argument(
        "--max-age-s",
        type=float,
        help="oldest heartbeat that passes (default: worker 10, evaluator 60; the worker "
        "writes it every second, the evaluator every 2 s between checkpoints)",
    )
    health.set_defaults(func=cmd_health)


def _add_views(sub: argparse._SubParsersAction) -> None:
    """``probewire report`` and ``probewire explain``: a run on pages and at one step."""
    report = sub.add_parser(
        "report",
        help="write runs as one interactive HTML page (runs "
        "overlaid) and a PNG first screen per run",
    )
    report.add_argument(
        "--run", required=True, action="append", help="run id (repeat to compare runs on one axis)"
    )
    report.add_argument("--store", help=f"chdb data directory (default ./{DEFAULT_STORE})")
    report.add_argument("--clickhouse-url", help="http(s):// server instead (env: CLICKHOUSE_URL)")
    report.add_argument("--out", default="probewire-report", help="output directory")
    report.set_defaults(func=cmd_report)

    ui = sub.add_parser(
        "ui", help="serve the web pages (runs, a live run, compare, a step) on 127.0.0.1"
    )
    ui.add_argument("--store", help=f"chdb data directory (default ./{DEFAULT_STORE})")
    ui.add_argument("--clickhouse-url", help="http(s):// server instead (env: CLICKHOUSE_URL)")
    ui.add_argument("--port", type=_at_least(0), default=8765, help="loopback port (0: a free one)")
    ui.add_argument(
        "--broker",
        help="Kafka bootstrap HOST:PORT the runs' notes are sent to (`probewire up` passes its "
        "own); without it notes are read-only",
    )
    ui.set_defaults(func=cmd_ui)

    explain = sub.add_parser("explain", help="walk the escalation order at one step of a run")
    explain.add_argument("--run", required=True, help="run id")
    explain.add_argument("--step", type=_at_least(0), required=True)
    explain.add_argument("--store", help=f"chdb data directory (default ./{DEFAULT_STORE})")
    explain.add_argument("--clickhouse-url", help="http(s):// server instead (env: CLICKHOUSE_URL)")
    explain.add_argument(
        "--window", type=_at_least(3), default=50, help="history steps per baseline"
    )
    explain.add_argument(
        "--lookback", type=_at_least(1), default=10, help="steps scanned for the onset"
    )
    explain.add_argument("--z", type=_positive, default=6.0, help="robust z that counts as moved")
    explain.add_argument("--format", choices=["table", "json"], default="table")
    explain.set_defaults(func=cmd_explain)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="probewire", description="Training-health monitor.")
    parser.add_argument("--config", help="settings file (YAML/JSON); env: PROBEWIRE_CONFIG")
    parser.add_argument(
        "--log-format",
        choices=FORMATS,
        default="text",
        help="json: one JSON object per line, for every service",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    _add_demo(sub)
    _add_stack(sub)
    _add_sync(sub)
    _add_store_reads(sub)
    _add_worker(sub)
    _add_operations(sub)
    _add_views(sub)
    from probewire.evaluators.cli import add_evaluator_parser

    add_evaluator_parser(
        sub,
        lambda path: load_settings(path).evaluator_setup(),
        lambda path: _preflight(load_settings(path), default_heartbeat_path("evaluator")),
    )
    return parser


def _terminate(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # run the `finally` blocks that stop child processes


def _stacks_on_sigusr1() -> None:
    """``kill -USR1 PID`` prints every thread's stack to stderr (a command that will not
    stop says where it waits); not where stderr is no file (the CLI called in-process)."""
    import faulthandler

    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (AttributeError, ValueError, OSError):  # io.UnsupportedOperation is an OSError
        pass


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import logging.config

    level = getattr(args, "loglevel", None) or "warning"
    logging.config.dictConfig(logging_config(args.log_format, level, args.command))
    if args.command != "worker":  # the Faust worker installs its own handlers
        signal.signal(signal.SIGTERM, _terminate)
        # a background job of a shell script starts with SIGINT ignored, and Python then
        # keeps it ignored: `kill -INT` (Ctrl-C's signal) would not stop demo, up or run
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _stacks_on_sigusr1()
    try:
        return args.func(args)
    except BrokenPipeError:  # piped into `head`, which closed the pipe: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 1
    except (UserError, SettingsError) as exc:
        say_error(args, f"probewire: error: {exc}")
        return 2
    except KeyboardInterrupt:
        say_error(args, "probewire: interrupted; stopped every process it started")
        return 130


if __name__ == "__main__":
    sys.exit(main())
