"""The offsets a consumer skipped in a partition: named once, short gaps only."""

from __future__ import annotations

from probewire.stream.gaps import GapWatch


def test_a_skipped_offset_is_named_once_and_in_order_reads_name_none():
    watch = GapWatch()
    assert [watch.gap(0, o) for o in (5, 6, 7)] == [None, None, None]  # the first: unknown
    assert watch.gap(0, 9) == (8, 9)
    assert watch.gap(0, 10) is None
    assert watch.gap(1, 40) is None and watch.gap(1, 44) == (41, 44)  # per partition


def test_a_redelivery_restarts_the_count_and_a_long_jump_or_a_rebalance_is_no_gap():
    watch = GapWatch(max_gap=64)
    watch.gap(0, 100)
    assert watch.gap(0, 90) is None and watch.gap(0, 91) is None  # redelivered from 90
    assert watch.gap(0, 91 + 66) is None  # 65 skipped: another worker's reads, not a gap
    assert watch.gap(0, 91 + 66 + 65) == (91 + 67, 91 + 66 + 65)  # 64 skipped: a gap
    watch.forget()
    assert watch.gap(0, 500) is None


def test_a_first_message_past_where_the_group_started_follows_a_gap():
    watch = GapWatch()
    watch.begin(3, 20)  # partition 3 assigned: the group reads it from offset 20
    assert watch.gap(3, 22) == (20, 22)  # offsets 20 and 21 never arrived
    watch.begin(4, 7)
    assert watch.gap(4, 7) is None  # the first message where the group started: no gap
    assert watch.gap(5, 9) is None  # a partition with no known start: nothing to compare
    watch.forget()
    assert watch.gap(3, 30) is None


def test_starts_without_a_broker_leave_every_partition_out_within_the_wait():
    """The worker asks for starts while it holds a rebalance open: a broker that does not
    answer costs ``wait_s`` in all, not a wait per partition."""
    import time

    from probewire.deploy.stack import free_port
    from probewire.stream.gaps import GapReader

    port = free_port()  # a loopback port nothing listens on
    reader = GapReader(
        {"bootstrap.servers": f"127.0.0.1:{port}", "log_level": "0"}, "probewire-test", wait_s=0.5
    )
    try:
        started = time.monotonic()
        assert reader.starts("otlp_metrics", range(16)) == {}
        assert time.monotonic() - started < 2.0
    finally:
        reader.close()
