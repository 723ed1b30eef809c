"""The end of `demo` / `run`: pages (signal, step, culprit) and ready-to-paste commands."""

from __future__ import annotations

import ast
import json
import shlex
import subprocess

import pytest

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


def test_a_run_that_logged_its_own_metrics_names_them_and_how_to_read_one():
    result = RunResult("r", "finished", 60, 59, (), ("data/pad_fraction", "val_acc"))
    lines = render_result(result, "--store S").splitlines()
    assert "your metrics (user_metrics): data/pad_fraction, val_acc" in lines
    assert lines[-1] == (
        '  probewire sql --store S "SELECT step, value FROM probewire.user_metrics FINAL '
        "WHERE run_id = 'r' AND name = 'data/pad_fraction' ORDER BY step\""
    )
    assert "user_metrics" not in render_result(RunResult("r", "finished", 1, 0, ()), "")


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


HOSTILE_RUN_IDS = ["$(touch PWNED)", 'it\'s "q" `touch PWNED2` \\ !x', "plain-run.1"]


@pytest.mark.parametrize("run_id", HOSTILE_RUN_IDS, ids=["subshell", "quotes", "plain"])
def test_next_lines_paste_as_one_safe_command_whatever_the_run_id(run_id: str, tmp_path):
    """Each printed "next" line, run by bash (with `probewire` a function printing its
    argv), creates no file and passes the run id whole: report and explain get it as one
    argument, and sql gets one query whose string literal reads back as the run id."""
    store = tmp_path / "my store"
    text = render_result(
        RunResult(run_id, "finished", 3, 2, ()), f"--store {shlex.quote(str(store))}"
    )
    lines = text.splitlines()[text.splitlines().index("next:") + 1 :]
    stub = 'probewire() { python3 -c "import json, sys; print(json.dumps(sys.argv[1:]))" "$@"; }'
    argvs = []
    for line in lines:
        out = subprocess.run(
            ["bash", "-c", f"{stub}\n{line}"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0 and out.stdout.count("\n") == 1, (line, out.stderr)
        argvs.append(json.loads(out.stdout))
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert argvs[0] == ["report", "--run", run_id, "--store", str(store)]
    assert argvs[1] == ["explain", "--run", run_id, "--step", "2", "--store", str(store)]
    assert argvs[2][:3] == ["sql", "--store", str(store)] and len(argvs[2]) == 4
    literal = argvs[2][3].split("WHERE run_id = ", 1)[1].removesuffix(" ORDER BY step")
    assert ast.literal_eval(literal) == run_id  # ClickHouse and Python read '\\' and '\'' alike
