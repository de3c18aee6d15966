"""The dashboard: ``GET /`` serves a live page of the whole map, built from files shipped in the package.

The page and its script and style live in ``manager/static`` (package data): nothing is fetched from
the network at run time. They are open without the token (they hold no state); the page asks for the
token once, keeps it for the browser session, and reads the API with it.
"""

from __future__ import annotations

from pathlib import Path

from flask import Blueprint, Response, send_from_directory

STATIC = Path(__file__).resolve().parent / "static"
#: Paths the app serves without a token: the page and its assets.
OPEN_PREFIX = "/ui/"

bp = Blueprint("dashboard", __name__)


@bp.get("/")
def index() -> Response:
    """The dashboard page."""
    return send_from_directory(STATIC, "index.html", max_age=0)


@bp.get("/ui/<path:name>")
def asset(name: str) -> Response:
    """A script, style or icon of the page."""
    return send_from_directory(STATIC, name, max_age=0)
