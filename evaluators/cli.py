"""``probewire evaluator``: the command that runs the evaluator service.

    probewire [--config FILE] evaluator [--once] [--data-dir DIR] [--suites a,b,c] ...

``deploy/cli.py`` (the composition root) registers it with ``add_evaluator_parser(sub,
setup)``, where ``setup(config_path)`` loads the settings and builds the evaluator's
``EvaluatorSetup``. A configuration mistake (bad factory path, missing data, unknown
suite) prints one line and exits 2; a service failure (results undeliverable) exits 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import Any

from probewire.instrument.plumbing import ConfigError

from .config import EvaluatorSetup
from .records import DEFAULT_SUITES, SUITE_NAMES  # torch-free: `probewire health` stays fast

__all__ = ["add_evaluator_parser", "cmd_evaluator"]


def add_evaluator_parser(
    subparsers: Any,
    setup: Callable[[str | None], EvaluatorSetup],
    preflight: Callable[[str | None], None] = lambda path: None,
) -> argparse.ArgumentParser:
    """Register ``evaluator`` on an ``add_subparsers()`` object; return its parser.
    ``setup(path)`` builds the service's configs from the settings file ``path`` (None:
    the default) and raises ``ConfigError`` naming a bad field; ``preflight(path)`` checks
    what the service needs outside itself (the broker), after the configuration is valid."""
    p = subparsers.add_parser("evaluator", help="score checkpoints announced on Kafka")
    p.add_argument(
        "--once", action="store_true", help="process the checkpoints already queued, then exit"
    )
    # every option but --once/--progress/--loglevel defaults to its evaluator.* setting
    p.add_argument(
        "--data-dir",
        help="evaluation sets (default: evaluator.data_dir, else "
        "./probewire-evals); missing demo sets are generated",
    )
    p.add_argument(
        "--suites",
        help=f"comma-separated, from {', '.join(SUITE_NAMES)} "
        f"(default: evaluator.suites, {','.join(DEFAULT_SUITES)})",
    )
    p.add_argument(
        "--reference-stream",
        choices=["auto", "raw", "ema"],
        help="weights stream marked reference=1 (default: evaluator."
        "reference_stream, auto: EMA when present)",
    )
    p.add_argument(
        "--group-id",
        help="consumer group (default: evaluator.group_id, else <stream.app_id>.evaluator)",
    )
    p.add_argument(
        "--tokenizer", help="module:callable returning the tokenizer (default: evaluator.tokenizer)"
    )
    p.add_argument(
        "--context-len",
        type=int,
        help="model context (default: evaluator.context_len, 0 reads the model)",
    )
    p.add_argument("--batch-size", type=int, help="default: evaluator.batch_size")
    p.add_argument("--device", help="torch device for the models (default: evaluator.device)")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bars (default: when stderr is a terminal)",
    )
    p.add_argument("--loglevel", default="info")
    p.set_defaults(func=cmd_evaluator, evaluator_setup=setup, evaluator_preflight=preflight)
    return p


def cmd_evaluator(args: argparse.Namespace) -> int:
    from .records import EvaluationError
    from .service import EvaluatorOptions, EvaluatorService, ServiceError

    logging.basicConfig(
        level=args.loglevel.upper(),  # a no-op where the CLI set it up
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger().setLevel(args.loglevel.upper())
    try:
        setup = args.evaluator_setup(getattr(args, "config", None))
        if not setup.config.enabled:
            print(
                "probewire evaluator: disabled (evaluator.enabled=false); nothing to do",
                file=sys.stderr,
            )
            return 0
        ev = setup.config

        def pick(flag: Any, setting: Any) -> Any:
            return setting if flag is None else flag

        context_len = pick(args.context_len, ev.context_len)
        options = EvaluatorOptions(
            suites=tuple(s.strip() for s in pick(args.suites, ev.suites).split(",") if s.strip()),
            data_dir=args.data_dir,
            group_id=pick(args.group_id, setup.group_id),
            reference_stream=pick(args.reference_stream, ev.reference_stream),
            tokenizer=pick(args.tokenizer, ev.tokenizer),
            context_len=context_len or None,
            batch_size=pick(args.batch_size, ev.batch_size),
            device=pick(args.device, ev.device),
            show_progress=sys.stderr.isatty() if args.progress is None else args.progress,
        )
        service = EvaluatorService(
            setup,
            options,
            preflight=lambda: args.evaluator_preflight(getattr(args, "config", None)),
        )
    except (EvaluationError, ConfigError) as exc:
        print(f"probewire: error: {exc}", file=sys.stderr)
        return 2
    try:
        stats = service.run(once=args.once)
    except (EvaluationError, ServiceError) as exc:
        print(f"probewire: error: {exc}", file=sys.stderr)
        return 1
    print(
        f"probewire evaluator: {stats.messages} checkpoint message(s): {stats.evaluated} "
        f"evaluated, {stats.skipped} skipped by cadence, {stats.failed} failed; "
        f"{stats.records} record(s) published",
        file=sys.stderr,
    )
    return 0
