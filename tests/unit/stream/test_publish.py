"""The message limit checked at start against what the broker states (``publish``)."""

from __future__ import annotations

import pytest

from probewire.instrument.plumbing import ConfigError
from probewire.stream.publish import RECORD_OVERHEAD_BYTES, check_message_limit


def test_a_limit_the_broker_does_not_state_is_not_checked():
    check_message_limit(100_000_000, None)


def test_a_message_that_fits_with_its_record_overhead_passes():
    check_message_limit(1_000_000, (1_048_588, "probewire.steps"))  # Kafka's default
    check_message_limit(50_000 - RECORD_OVERHEAD_BYTES, (50_000, "t"))


def test_a_message_over_the_topics_limit_is_one_error_naming_the_field_and_the_fix():
    with pytest.raises(ConfigError) as info:
        check_message_limit(50_000 - RECORD_OVERHEAD_BYTES + 1, (50_000, "probewire.steps"))
    assert info.value.field == "stream.max_message_bytes"
    assert "\n" not in str(info.value)
    assert f"set it to at most {50_000 - RECORD_OVERHEAD_BYTES}" in str(info.value)
