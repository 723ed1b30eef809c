"""``probewire ui``: the web pages over the store (runs, a live run, compare, a step).

``queries`` reads (downsampled in SQL by ``sinks.downsample``), ``pages`` renders the HTML
on the server, ``app`` serves both and the JSON the charts of ``static/ui.js`` poll.
"""

from .app import UI_TOKEN_ENV, Notes, Store, make_app, serve

__all__ = ["UI_TOKEN_ENV", "Notes", "Store", "make_app", "serve"]
