"""A run's note and tags set in ``probewire ui`` (issue 39) on the real broker, worker and
chdb: the UI that ``LocalStack.start_ui`` starts (with the stack's broker, as ``probewire
up`` does) publishes the runs table's form as a ``note`` event on the runs topic; the
worker stores it; the runs table shows it and ``runs.note`` / ``runs.tags`` hold it. The
UI itself never writes the store."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Producer

from probewire.deploy.settings import ClickHouseSettings, Settings, StreamSettings
from probewire.deploy.stack import LocalStack
from probewire.instrument.lifecycle import run_event
from probewire.instrument.wire import RankIdentity
from probewire.stream.testing import SimRun, own_topics, send

pytestmark = pytest.mark.integration

RUN = SimRun(run_id=f"noted-{uuid.uuid4().hex[:6]}", world_size=2, steps=20, seed=1)
NOTE = "loss spike at 12: lr too high? <check>"


def _settings(store: Path) -> Settings:
    tag = uuid.uuid4().hex[:8]
    return Settings(
        clickhouse=ClickHouseSettings(url="chdb:///" + str(store).lstrip("/")),
        topics=own_topics(tag),
        stream=StreamSettings(app_id=f"pw-test-{tag}", deadline_s=3.0),
    )


def _stored(stack: LocalStack, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    beat: dict = {}
    while time.monotonic() < deadline:
        if stack.heartbeat_path.exists():
            beat = json.loads(stack.heartbeat_path.read_text())
        if beat.get("runs", {}).get(RUN.run_id, {}).get("last_step") == RUN.steps - 1:
            return
        time.sleep(0.3)
    raise AssertionError(f"run {RUN.run_id} not stored; heartbeat: {beat}")


class Browser:
    """Requests that keep the UI's cookie (its printed URL's token sets it), as a browser."""

    def __init__(self) -> None:
        import http.cookiejar

        self._open = urllib.request.build_opener(
            urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar())
        ).open

    def request(self, url: str, fields: dict[str, str] | None = None) -> tuple[int, str]:
        data = None if fields is None else urllib.parse.urlencode(fields).encode()
        try:
            with self._open(urllib.request.Request(url, data=data), timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()


def test_a_note_set_in_the_ui_is_stored_by_the_worker(kafka_bootstrap, scratch_dir, read_store):
    stack = LocalStack(_settings(scratch_dir / "store"), scratch_dir / "run")
    try:
        stack.use_broker(kafka_bootstrap)
        stack.start_worker()
        send(RUN, kafka_bootstrap, stack.settings.topics.metrics, range(RUN.steps))
        ident = RankIdentity(run_id=RUN.run_id, rank=0, world_size=RUN.world_size)
        producer = Producer({"bootstrap.servers": kafka_bootstrap})
        started = run_event(ident, "started", config={"tags": ["sweep"]}, attempt="a1")
        producer.produce(stack.settings.topics.runs, key=RUN.run_id.encode(), value=started)
        producer.flush(10)
        _stored(stack)
        printed = urllib.parse.urlsplit(stack.start_ui())
        base, query = f"http://{printed.netloc}", printed.query  # query: token=...
        browser = Browser()
        status, page = browser.request(f"{base}/?{query}")  # sets the cookie
        assert status == 200 and "form='note-0'" in page and "notes-read-only" not in page
        rid = urllib.parse.quote(RUN.run_id)
        note_url = f"{base}/run/{rid}/note"
        assert Browser().request(note_url, {"note": "n"})[0] == 403  # no token: nothing
        # the worker's own checks, before anything is sent; an unknown run is a 404
        status, body = browser.request(note_url, {"note": "x" * 2001, "tags": ""})
        assert status == 400 and body.count("\n") == 1 and "note must be text" in body
        assert browser.request(f"{base}/run/no-such-run/note", {"note": "n"})[0] == 404
        status, page = browser.request(note_url, {"note": NOTE, "tags": "suspect, lr-high"})
        assert status == 200 and f"the note of {RUN.run_id} was sent" in page
        escaped = "loss spike at 12: lr too high? &lt;check&gt;"
        deadline = time.monotonic() + 60
        while escaped not in page and time.monotonic() < deadline:
            time.sleep(0.5)
            page = browser.request(f"{base}/")[1]
        assert f"value='{escaped}'" in page, page[-3000:]
        assert "value='suspect lr-high'" in page
        for tag in ("sweep", "suspect", "lr-high"):  # the config's and the user's tags
            assert f"<span class='tag'>{tag}</span>" in page
        _, only = browser.request(f"{base}/?q=tag%3Alr-high")
        assert f"href='/run/{RUN.run_id}'" in only
    finally:
        stack.stop()
    rows = read_store(
        scratch_dir / "store",
        f"SELECT note, tags, status, config FROM probewire.runs FINAL "
        f"WHERE run_id = '{RUN.run_id}'",
    )
    assert [(r["note"], list(r["tags"])) for r in rows] == [(NOTE, ["suspect", "lr-high"])]
    assert json.loads(rows[0]["config"]) == {"tags": ["sweep"]}
