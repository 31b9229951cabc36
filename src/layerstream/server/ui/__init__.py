"""The web page at ``/``: static HTML, CSS and JavaScript in this package, no build step, nothing fetched from
elsewhere. It is a client of the public API only (``/health`` and the job routes), so whatever the page does,
a script can do."""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

PAGE_PATH = "/"
STATIC_PATH = "/ui"


def add_web_page(app: FastAPI) -> None:
    static = files(__name__) / "static"
    index = (static / "index.html").read_text(encoding="utf-8")  # read once: it never changes while serving

    @app.get(PAGE_PATH, include_in_schema=False, response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(index, headers={"Cache-Control": "no-cache"})

    app.mount(STATIC_PATH, StaticFiles(packages=[(__name__, "static")]), name="ui")
