"""The rank's Kafka clients log through one logger that lets one line a minute through.

librdkafka retries a down broker every few hundred milliseconds and logs each attempt;
the delivery of every queued message fails the same way. A rank says that once a minute
(``EveryMinute``: the next line says how many it held back), not once per retry: 616
lines for a 20-step run before. What is lost at ``Monitor.close`` is said apart, once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["EveryMinute", "kafka_log"]


class EveryMinute(logging.Filter):
    """Lets one record through per ``interval_s``; the next one says how many it held."""

    def __init__(self, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.interval_s, self.clock = interval_s, clock
        self.last: float | None = None
        self.held = 0

    def filter(self, record: logging.LogRecord) -> bool:
        now = self.clock()
        if self.last is not None and now - self.last < self.interval_s:
            self.held += 1
            return False
        if self.held:
            record.msg = f"{record.getMessage()} (and {self.held} more such line(s) not shown)"
            record.args = None
        self.last, self.held = now, 0
        return True


kafka_log = logging.getLogger("probewire.instrument.kafka")
"""librdkafka's own lines and delivery failures of the rank's producers and consumer."""
kafka_log.addFilter(EveryMinute())
