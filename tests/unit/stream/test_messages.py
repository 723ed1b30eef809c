"""Alert wording: a word said once, a loss in nats/token, a gap as a ratio to L."""

from __future__ import annotations

from probewire.stream.messages import alert_message, describe_value, what_moved


def test_a_kind_equal_to_its_signal_is_said_once() -> None:
    assert what_moved("cospike", "cospike") == "cospike"
    assert what_moved("loss", "spike") == "loss spike"
    message = alert_message("cospike", "cospike", 100, 5.0, 2.5, 7.25, "")
    assert message == "cospike at step 100: 5 against baseline 2.5, z=7.2"
    assert "cospike cospike" not in message


def test_losses_carry_nats_and_the_worst_rank_gap_is_a_ratio_to_the_mean() -> None:
    assert alert_message("loss_worst_rank", "spike", 130, 5.5453, 2.30127, 41.04, "rank 2") == (
        "loss_worst_rank spike at step 130: 5.545 nats/token against baseline "
        "2.301 nats/token, z=41.0; carried by rank 2"
    )
    assert describe_value("loss_worst_rank", "gap", 1.35) == "1.35× L (L_max / L)"
    assert describe_value("loss_by_source", "gap", 1.1) == "1.1× L (L_source / L)"
    assert describe_value("grad_norm", "spike", 12.5) == "12.5"
    assert describe_value("loss", "spike", None) == "n/a"
    assert "n/a" in alert_message("loss", "nonfinite", 3, float("nan"), None, None, "")
