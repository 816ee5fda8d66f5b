"""Serving the volunteer page over aiohttp: the static files, ``config.json`` and the shards.

    GET /volunteer                -> redirect to /volunteer/
    GET /volunteer/               the page
    GET /volunteer/config.json    {relay_url, binding_hex, shards_url, ...} for the page
    GET /volunteer/js/..., /volunteer/vendor/...   the modules and vendored libraries
    GET /volunteer/shards/...     an export-onnx folder, when one is configured

``binding_hex`` is the relay's ``tls-server-end-point`` channel binding (SHA-256 of its
certificate): a page cannot read the certificate of its WebSocket's TLS session, so it takes the
binding from its own origin, fetched over that same TLS connection to the same host (relay.md
section 5). Every response carries COOP/COEP so the page is cross-origin isolated.
"""

from __future__ import annotations

import mimetypes
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

STATIC = Path(__file__).with_name("static")
PREFIX = "/volunteer"
_TYPES = {".mjs": "text/javascript", ".js": "text/javascript", ".wasm": "application/wasm", ".html": "text/html",
          ".json": "application/json", ".onnx": "application/octet-stream", ".data": "application/octet-stream",
          ".md": "text/plain", "": "text/plain"}
_HEADERS = {"Cross-Origin-Opener-Policy": "same-origin", "Cross-Origin-Embedder-Policy": "require-corp",
            "Cross-Origin-Resource-Policy": "same-origin", "Cache-Control": "no-cache",
            "X-Content-Type-Options": "nosniff"}


@dataclass
class VolunteerSite:
    relay_url: Callable[[], str]  # wss://HOST:PORT devices dial (the relay's public URL)
    binding: Callable[[], bytes]  # the relay's channel binding (empty without TLS)
    shards_dir: str | None = None  # an export-onnx folder served at /volunteer/shards/
    shards_url: str | None = None  # or where the page downloads its shards from (any HTTP server, CORS)
    capacity_bytes: int | None = None  # what the page announces (default: the size of its shards)

    def config(self) -> dict[str, Any]:
        shards = self.shards_url or (f"{PREFIX}/shards/" if self.shards_dir else None)
        return {"relay_url": self.relay_url(), "binding_hex": self.binding().hex(), "shards_url": shards,
                "capacity_bytes": self.capacity_bytes}


def _file(root: Path, rel: str) -> web.StreamResponse:
    path = (root / rel).resolve()
    if not path.is_relative_to(root.resolve()) or not path.is_file():
        raise web.HTTPNotFound(text="no such file")
    ctype = _TYPES.get(path.suffix) or mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return web.FileResponse(path, headers={**_HEADERS, "Content-Type": ctype})


def add_volunteer_routes(app: web.Application, site: VolunteerSite) -> None:
    """Add the page's routes to ``app`` (before any catch-all route such as the relay's ``/{peer}``)."""

    async def redirect(request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound(f"{PREFIX}/" + (f"?{request.query_string}" if request.query_string else ""))

    async def page(request: web.Request) -> web.StreamResponse:
        return _file(STATIC, "index.html")

    async def config(request: web.Request) -> web.StreamResponse:
        return web.json_response(site.config(), headers=_HEADERS)

    async def static(request: web.Request) -> web.StreamResponse:
        return _file(STATIC, request.match_info["path"])

    async def shards(request: web.Request) -> web.StreamResponse:
        if site.shards_dir is None:
            raise web.HTTPNotFound(text="this relay serves no shards")
        return _file(Path(site.shards_dir), request.match_info["path"])

    app.router.add_get(PREFIX, redirect)
    app.router.add_get(f"{PREFIX}/", page)
    app.router.add_get(f"{PREFIX}/config.json", config)
    app.router.add_get(f"{PREFIX}/shards/{{path:.+}}", shards)
    app.router.add_get(f"{PREFIX}/{{path:(js|vendor)/.+}}", static)
