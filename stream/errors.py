"""The one error a component's config raises: it names the field, so the settings tree can
say where it sits (``stream.stage2.detectors.window: must be >= 3``). A leaf: it imports
nothing of probewire, and every package may import it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["ConfigError", "check", "within"]


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type, or out of range."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def check(cond: bool, field: str, message: str) -> None:
    if not cond:
        raise ConfigError(field, message)


@contextmanager
def within(prefix: str) -> Iterator[None]:
    """Re-raise a ConfigError of a nested config with its field path under ``prefix``."""
    try:
        yield
    except ConfigError as exc:
        raise ConfigError(f"{prefix}.{exc.field}", exc.message) from None
