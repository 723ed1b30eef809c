"""``probewire evaluator``: the command that runs the evaluator service.

    probewire [--config FILE] evaluator [--once] [--data-dir DIR] [--suites a,b,c] ...

``deploy/cli.py`` registers it with ``add_evaluator_parser(sub)``. Until then (and in
tests) ``python -m probewire.evaluators.cli [--config FILE] evaluator ...`` is the same
command. A configuration mistake (bad factory path, missing data, unknown suite) prints
one line and exits 2; a service failure (results undeliverable) exits 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from probewire.deploy.settings import SettingsError, load_settings

from .records import DEFAULT_SUITES, SUITE_NAMES  # torch-free: `probewire health` stays fast

__all__ = ["add_evaluator_parser", "cmd_evaluator", "main"]


def add_evaluator_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``evaluator`` on an ``add_subparsers()`` object; return its parser."""
    p = subparsers.add_parser("evaluator", help="score checkpoints announced on Kafka")
    p.add_argument("--once", action="store_true",
                   help="process the checkpoints already queued, then exit")
    # every option but --once/--progress/--loglevel defaults to its evaluator.* setting
    p.add_argument("--data-dir", help="evaluation sets (default: evaluator.data_dir, else "
                                      "./probewire-evals); missing demo sets are generated")
    p.add_argument("--suites", help=f"comma-separated, from {', '.join(SUITE_NAMES)} "
                                    f"(default: evaluator.suites, {','.join(DEFAULT_SUITES)})")
    p.add_argument("--reference-stream", choices=["auto", "raw", "ema"],
                   help="weights stream marked reference=1 (default: evaluator."
                        "reference_stream, auto: EMA when present)")
    p.add_argument("--group-id", help="consumer group (default: evaluator.group_id, else "
                                      "<stream.app_id>.evaluator)")
    p.add_argument("--tokenizer", help="module:callable returning the tokenizer (default: "
                                       "evaluator.tokenizer)")
    p.add_argument("--context-len", type=int,
                   help="model context (default: evaluator.context_len, 0 reads the model)")
    p.add_argument("--batch-size", type=int, help="default: evaluator.batch_size")
    p.add_argument("--device", help="torch device for the models (default: evaluator.device)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bars (default: when stderr is a terminal)")
    p.add_argument("--loglevel", default="info")
    p.set_defaults(func=cmd_evaluator)
    return p


def cmd_evaluator(args: argparse.Namespace) -> int:
    from .records import EvaluationError
    from .service import EvaluatorOptions, EvaluatorService, ServiceError

    logging.basicConfig(level=args.loglevel.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = load_settings(getattr(args, "config", None))
        if not settings.evaluator.enabled:
            print("probewire evaluator: disabled (evaluator.enabled=false); nothing to do",
                  file=sys.stderr)
            return 0
        ev = settings.evaluator

        def pick(flag: Any, setting: Any) -> Any:
            return setting if flag is None else flag

        context_len = pick(args.context_len, ev.context_len)
        options = EvaluatorOptions(
            suites=tuple(s.strip() for s in pick(args.suites, ev.suites).split(",")
                         if s.strip()),
            data_dir=args.data_dir, group_id=pick(args.group_id, ev.group_id or None),
            reference_stream=pick(args.reference_stream, ev.reference_stream),
            tokenizer=pick(args.tokenizer, ev.tokenizer),
            context_len=context_len or None, batch_size=pick(args.batch_size, ev.batch_size),
            device=pick(args.device, ev.device),
            show_progress=sys.stderr.isatty() if args.progress is None else args.progress)
        service = EvaluatorService(settings, options)
    except (EvaluationError, SettingsError) as exc:
        print(f"probewire: error: {exc}", file=sys.stderr)
        return 2
    try:
        stats = service.run(once=args.once)
    except (EvaluationError, ServiceError) as exc:
        print(f"probewire: error: {exc}", file=sys.stderr)
        return 1
    print(f"probewire evaluator: {stats.messages} checkpoint message(s): {stats.evaluated} "
          f"evaluated, {stats.skipped} skipped by cadence, {stats.failed} failed; "
          f"{stats.records} record(s) published", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="probewire", description="Checkpoint evaluator.")
    parser.add_argument("--config", help="settings file (YAML/JSON); env: PROBEWIRE_CONFIG")
    add_evaluator_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
