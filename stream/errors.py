"""Config errors live in ``probewire.instrument.plumbing`` (shared with the evaluators, which
do not import ``stream``). Re-exported here for ``stream/stage2.py`` only, until the series
registry change moves its import there (then this module goes)."""

from probewire.instrument.plumbing import ConfigError, check, within

__all__ = ["ConfigError", "check", "within"]
