"""The Alertmanager webhook: the JSON a real HTTP endpoint receives; failures contained."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from probewire.stream.alerting import AlertmanagerWebhook

ALERT = {
    "run_id": "r1",
    "step": 50,
    "signal": "cospike",
    "severity": "page",
    "value": 9.1,
    "baseline": 3.0,
    "z": 12.0,
    "tokens": 1234,
    "ranks": [2, 5],
    "message": "cospike at step 50",
    "next_steps": ["gradient norm and spikes", "step time"],
}


def test_posts_alertmanager_json_to_a_loopback_server():
    received: list = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.handle_request, daemon=True)
    thread.start()
    hook = AlertmanagerWebhook(f"http://127.0.0.1:{server.server_port}/api/v2/alerts")
    assert hook.post([ALERT]) is True
    thread.join(5)
    server.server_close()
    (body,) = received
    assert body[0]["labels"] == {
        "alertname": "probewire_cospike",
        "run_id": "r1",
        "signal": "cospike",
        "severity": "page",
    }
    assert (
        body[0]["annotations"]["ranks"] == "2,5"
        and "step time" in body[0]["annotations"]["description"]
    )
    assert hook.sent == 1 and hook.failed == 0


def test_unreachable_webhook_is_counted_not_raised():
    hook = AlertmanagerWebhook("http://127.0.0.1:9/api/v2/alerts", timeout_s=1.0)
    assert hook.post([ALERT]) is False and hook.failed == 1


def test_no_url_means_no_webhook():
    assert AlertmanagerWebhook("").post([ALERT]) is True


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:9/hooks/T000/B000/s3cret-token?key=s3cret-key",  # unreachable
        "http://alice:s3cret-pw@127.0.0.1:9/api/v2/alerts",  # user info
        "http://alice:s3cret-pw@127.0.0.1/api/v2/alerts",  # refused
        "http://127.0.0.1:s3cret/api",  # not a valid URL
    ],
)
def test_a_failing_webhook_never_logs_its_secret(url, caplog):
    with caplog.at_level(logging.WARNING):
        assert AlertmanagerWebhook(url, timeout_s=1.0).post([ALERT]) is False
    assert caplog.records and "s3cret" not in caplog.text
    assert "127.0.0.1" in caplog.text
