"""The end of `demo` / `run`: pages (signal, step, culprit) and ready-to-paste commands."""

from __future__ import annotations

from probewire.deploy.result import Page, RunResult, render_result
from probewire.deploy.session import session_env, status_line
from probewire.deploy.settings import Settings


def test_pages_and_next_commands_name_the_run_the_store_and_the_first_page():
    result = RunResult(
        "r 1",
        "finished",
        200,
        199,
        (Page("loss_worst_rank", 120, "rank 1", "..."), Page("cospike", 121, "", "...")),
    )
    text = render_result(result, "--store /data/s", "probewire")
    lines = text.splitlines()
    assert lines[0] == "run r 1: finished, 200 steps stored (last step 199), 2 page(s)"
    assert lines[2].split() == ["loss_worst_rank", "120", "rank", "1"]
    assert lines[3].split() == ["cospike", "121", "-"]
    assert "  probewire report --run 'r 1' --store /data/s" in lines
    assert "  probewire explain --run 'r 1' --step 120 --store /data/s" in lines
    assert any(line.startswith('  probewire sql --store /data/s "SELECT') for line in lines)


def test_a_run_without_pages_points_explain_at_its_last_step():
    text = render_result(RunResult("r", "crashed", 3, 2, ()), "")
    assert "run r: crashed, 3 steps stored (last step 2), 0 page(s)" in text
    assert "  probewire explain --run r --step 2" in text.splitlines()


def test_status_line_and_the_environment_a_script_needs():
    beat = {
        "runs": {
            "a": {"steps_written": 10, "alerts": 1, "status": "running", "last_step": 9},
            "b": {"steps_written": 5, "status": "finished", "last_step": 4},
        }
    }
    assert status_line(beat) == (
        "runs 2 · steps stored 15 · pages 1 · a running at step 9 · b finished at step 4"
    )
    assert status_line(None) == "worker starting"
    env = session_env(Settings(), "127.0.0.1:9", "r1")
    assert env["PROBEWIRE_KAFKA__BOOTSTRAP"] == "127.0.0.1:9" and env["PROBEWIRE_RUN_ID"] == "r1"
    assert env["PROBEWIRE_TOPICS__RUNS"] == "probewire.runs"
