"""``probewire ui``: the web app (aiohttp) on 127.0.0.1 over the store, read-only.

The store is read through ``deploy.reading.open_client``, the path of ``probewire sql``: a
ClickHouse server by its URL, else the live reader of the worker that owns the embedded
store, else a reader of this process over the idle directory. The engine's ``readonly = 1``
holds either way: the UI never writes. Queries run one at a time on a worker thread; a
failed one reopens the client once (a restarted worker's reader has a new port).

Routes: ``/`` the runs table; ``/run/{id}`` a run's charts, live; ``/compare?run=..`` N
runs overlaid; ``/run/{id}/step/{n}`` a step's detail; ``/run/{id}/anomalies`` its pages
and anomalies; JSON: ``/api/runs``, ``/api/charts?run=..&x=&lo=&hi=`` (``after`` and
``width``: a live update), ``/api/marks?run=..``; ``/static/plotly.min.js`` (the plotly
package's own bundle) and the scripts of ``static/``.

Notes: ``POST /run/{id}/note`` (the runs table's form: a note and tags) never writes the
store either: it publishes a ``note`` event on the runs topic (``instrument.lifecycle.
note_event``), which the stream worker stores in ``runs.note`` / ``runs.tags`` as it
stores the ranks' events. That needs the broker (``--broker``, which ``probewire up``
passes); a UI without one shows the notes read-only and says why.

Access: like the worker's reader (whose token is in a 0600 file), the UI answers only who
holds its token (other local users share the loopback): the URL it prints carries
``?token=``, which sets a same-site, HTTP-only cookie for the rest of the visit; without
it every route is a 403 that says where the URL is.
"""

from __future__ import annotations

import asyncio
import hmac
import threading
from collections.abc import Callable
from importlib import resources
from typing import Any
from urllib.parse import urlencode

from aiohttp import web

from probewire.deploy.reading import json_value

from . import pages, queries

__all__ = ["NO_BROKER", "UI_TOKEN_ENV", "Notes", "Store", "make_app", "serve"]


class Store:
    """The read client of the UI; ``opener`` makes (and remakes) it."""

    def __init__(self, opener: Callable[[], Any], database: str) -> None:
        self._opener, self.database = opener, database
        self._client: Any = None
        self._lock = threading.Lock()

    def read(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(client, database, *args)``, once more on a fresh client when the store
        could not be reached (a worker that restarted serves its reader elsewhere)."""
        from clickhouse_connect.driver.exceptions import OperationalError

        with self._lock:
            try:
                if self._client is None:
                    self._client = self._opener()
                return fn(self._client, self.database, *args, **kwargs)
            except (OSError, OperationalError):
                self._client = self._opener()
                return fn(self._client, self.database, *args, **kwargs)


NO_BROKER = (
    "notes are read-only: this UI has no broker to send them to (`probewire up` gives it "
    "one; or `probewire ui --broker HOST:PORT`)"
)


class Notes:
    """Sends a run's note and tags as a ``note`` event on the runs topic."""

    def __init__(self, client_config: dict[str, str], topic: str) -> None:
        self.client_config, self.topic = client_config, topic

    def send(self, run_id: str, body: bytes, timeout_s: float = 5.0) -> bool:
        """Whether the broker took it within ``timeout_s``."""
        from probewire.instrument.export import KafkaTransport

        transport = KafkaTransport(self.client_config, self.topic)
        try:
            sent = transport.send(run_id.encode(), body)
            return sent and transport.flush(timeout_s) == 0 and not transport.failed
        finally:
            transport.close()


async def _read(request: web.Request, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    store: Store = request.app["store"]
    return await asyncio.get_running_loop().run_in_executor(
        None, lambda: store.read(fn, *args, **kw)
    )


def _json(value: Any) -> web.Response:
    return web.json_response(json_value(value))


def _float(request: web.Request, name: str) -> float | None:
    text = request.query.get(name)
    if text in (None, ""):
        return None
    try:
        return float(text)
    except ValueError:
        raise web.HTTPBadRequest(text=f"{name} must be a number, got {text!r}") from None


def _runs_arg(request: web.Request) -> list[str]:
    runs = [r for r in request.query.getall("run", []) if r]
    if not runs:
        raise web.HTTPBadRequest(text="name at least one run: ?run=ID (repeat to compare)")
    return list(dict.fromkeys(runs))


def _x(request: web.Request) -> str:
    x = request.query.get("x", "step")
    if x not in queries.AXES:
        raise web.HTTPBadRequest(text=f"x must be one of {', '.join(queries.AXES)}")
    return x


async def index(request: web.Request) -> web.Response:
    rows = await _read(request, queries.runs)
    q, sort = request.query.get("q", ""), request.query.get("sort", "updated_at")
    desc = request.query.get("desc", "1") != "0"
    shown = pages.sort_runs(pages.filter_runs(rows, q), sort, desc)
    read_only = "" if request.app["notes"] else NO_BROKER
    page = pages.runs_page(
        shown, q, sort, desc, len(rows), read_only, request.query.get("noted", "")
    )
    return web.Response(text=page, content_type="text/html")


async def set_note(request: web.Request) -> web.Response:
    """The runs table's note form: a ``note`` event on the runs topic, then back to ``/``."""
    from probewire.instrument.lifecycle import note_event
    from probewire.stream.lifecycle import EventError, parse_event

    notes: Notes | None = request.app["notes"]
    if notes is None:
        raise web.HTTPConflict(text=NO_BROKER + "\n")
    run_id = request.match_info["run"]
    form = await request.post()
    body = note_event(run_id, str(form.get("note", "")).strip(), pages.tag_list(form.get("tags")))
    try:
        parse_event(body)  # the worker's own checks: a refused note is one line here
    except EventError as exc:
        raise web.HTTPBadRequest(text=str(exc).replace("run event: ", "") + "\n") from None
    if await _read(request, queries.run_status, run_id) is None:
        raise web.HTTPNotFound(text=f"no run {run_id!r} in the store\n")
    loop = asyncio.get_running_loop()
    if not await loop.run_in_executor(None, notes.send, run_id, body):
        raise web.HTTPServiceUnavailable(
            text=f"the broker ({notes.client_config.get('bootstrap.servers')}) did not take "
            "the note within 5 s: is `probewire up` still running? Try again.\n"
        )
    raise web.HTTPSeeOther(f"/?{urlencode({'noted': run_id})}")


async def run_page(request: web.Request) -> web.Response:
    run_id = request.match_info["run"]
    status = await _read(request, queries.run_status, run_id)
    if status is None:
        raise web.HTTPNotFound(text=f"no run {run_id!r} in the store")
    return web.Response(
        text=pages.charts_page(run_id, f"Run {run_id} ({status})", [run_id], _x(request), True),
        content_type="text/html",
    )


async def compare_page(request: web.Request) -> web.Response:
    runs = _runs_arg(request)
    return web.Response(
        text=pages.charts_page("compare", f"Compare {len(runs)} runs", runs, _x(request), False),
        content_type="text/html",
    )


async def anomalies_page(request: web.Request) -> web.Response:
    run_id = request.match_info["run"]
    alerts = await _read(request, queries.pages, [run_id])
    found = await _read(request, queries.anomalies, [run_id])
    return web.Response(text=pages.anomalies_page(run_id, alerts, found), content_type="text/html")


def _explain(client: Any, db: str, run_id: str, step: int) -> Any:
    from probewire.deploy.explain import StepNotFound, explain

    try:
        return explain(client, db, run_id, step)
    except StepNotFound:
        return None


async def step_page(request: web.Request) -> web.Response:
    run_id = request.match_info["run"]
    try:
        step = int(request.match_info["step"])
    except ValueError:
        raise web.HTTPBadRequest(text="the step is a whole number") from None
    explanation = await _read(request, _explain, run_id, step)
    detail = await _read(request, queries.step_rows, run_id, step)
    return web.Response(
        text=pages.step_page(run_id, step, explanation, detail), content_type="text/html"
    )


async def api_runs(request: web.Request) -> web.Response:
    return _json(await _read(request, queries.runs))


async def api_charts(request: web.Request) -> web.Response:
    runs, x = _runs_arg(request), _x(request)
    lo, hi = _float(request, "lo"), _float(request, "hi")
    after, width = _float(request, "after"), _float(request, "width")
    try:
        data = await _read(request, queries.chart_data, runs, x, lo, hi, after, width)
    except ValueError as exc:
        raise web.HTTPBadRequest(text=str(exc)) from None
    return _json(data)


async def api_marks(request: web.Request) -> web.Response:
    runs = _runs_arg(request)
    return _json(
        {
            "anomalies": await _read(request, queries.anomalies, runs),
            "pages": await _read(request, queries.pages, runs),
        }
    )


_STATIC = resources.files("probewire.deploy.ui") / "static"


async def static(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name == "plotly.min.js":
        body = request.app["plotly"]
    elif name in ("ui.js", "depth.js"):
        body = (_STATIC / name).read_text()
    else:
        raise web.HTTPNotFound()
    return web.Response(
        text=body,
        content_type="application/javascript",
        headers={"Cache-Control": "max-age=3600"},
    )


UI_TOKEN_ENV = "PROBEWIRE_UI_TOKEN"  # the UI's token, set by the launcher (`probewire up`)
_DENIED = (
    "this probewire ui needs its token: open the URL `probewire ui` (or `probewire up`) "
    "printed, with its ?token=...\n"
)


def _cookie(request: web.Request) -> str:
    """The cookie name of this UI (cookies are per host, not per port)."""
    return f"probewire_ui_{request.url.port}"


@web.middleware
async def _gate(request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
    """Only who holds the token reads: the printed URL's ``?token=`` sets a cookie that
    the pages, scripts and JSON requests of the same origin then carry."""
    token: str = request.app["token"]
    given = request.cookies.get(_cookie(request)) or request.query.get("token", "")
    if not hmac.compare_digest(given.encode(), token.encode()):
        return web.Response(status=403, text=_DENIED)
    from clickhouse_connect.driver.exceptions import DatabaseError

    try:
        response = await handler(request)
    except DatabaseError as exc:  # an unmigrated store, say: one line, not a traceback
        text = str(exc).strip().split("server response: ")[-1]
        return web.Response(status=500, text=f"the store refused the query: {text[:300]}\n")
    if request.query.get("token"):
        response.set_cookie(_cookie(request), token, httponly=True, samesite="Strict", path="/")
    return response


def make_app(store: Store, token: str, notes: Notes | None = None) -> web.Application:
    """The application over ``store``, open to requests that carry ``token``; ``notes``
    sends the runs' notes (None: they are read-only)."""
    from plotly.offline import get_plotlyjs

    if not token:
        raise ValueError("the UI needs a token")
    app = web.Application(middlewares=[_gate])
    app["store"], app["plotly"], app["token"] = store, get_plotlyjs(), token
    app["notes"] = notes
    app.router.add_get("/", index)
    app.router.add_get("/compare", compare_page)
    app.router.add_get("/run/{run}", run_page)
    app.router.add_post("/run/{run}/note", set_note)
    app.router.add_get("/run/{run}/anomalies", anomalies_page)
    app.router.add_get("/run/{run}/step/{step}", step_page)
    app.router.add_get("/api/runs", api_runs)
    app.router.add_get("/api/charts", api_charts)
    app.router.add_get("/api/marks", api_marks)
    app.router.add_get("/static/{name}", static)
    return app


def serve(
    store: Store,
    port: int,
    token: str,
    ready: Callable[[str], None] = print,
    notes: Notes | None = None,
) -> None:
    """Serve on 127.0.0.1:``port`` (0: a free one) until interrupted; ``ready`` gets the URL
    to open (with the token)."""

    async def main() -> None:
        runner = web.AppRunner(make_app(store, token, notes), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        bound = runner.addresses[0][1]
        ready(f"http://127.0.0.1:{bound}/?token={token}")
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    asyncio.run(main())
