"""The web playground: a chat page for trying the served model, at / and /playground (off with
--disable-playground).

The page is four static files shipped in the package (playground/), no CDN: the machines that serve models often
have no internet. It talks to the server only through what any client uses: /v1/models, /v1/chat/completions
(streamed) and /metrics, plus /playground/settings, the sampling defaults a request that leaves fields out gets.
That one sits behind the API key like /v1 (guards.py), so the page shows nothing a client without the key could
not get. The key, when the server has one, is asked for by the page and kept in the browser tab's sessionStorage.
A strict Content-Security-Policy allows the page's own script and style only: a model's answer is rendered from
escaped text, and even a slip there could not load or run anything.
"""

from __future__ import annotations

from importlib import resources

from fastapi import Request
from fastapi.responses import JSONResponse, Response

FILES = {
    "index.html": "text/html",
    "app.js": "text/javascript",
    "markdown.js": "text/javascript",
    "style.css": "text/css",
}
POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data: blob:; media-src 'self' data: blob:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
SETTINGS_PATH = "/playground/settings"  # guarded by the API key (app.PUBLIC_PATHS leaves it out)


def static(name: str):
    """A route answering with one of the page's files, read once, here."""
    body = resources.files("fovea.server").joinpath("playground", name).read_bytes()
    headers = {"Content-Security-Policy": POLICY, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}

    async def route():
        return Response(body, media_type=FILES[name], headers=headers)

    return route


async def settings(request: Request):
    served = request.app.state.served
    config = served.engine.config
    return JSONResponse(
        {
            "defaults": served.defaults,  # the checkpoint's generation_config, as the server applies it
            "max_model_len": config.max_model_len,
            "reasoning": config.reasoning_parser is not None,
            "limit_mm_per_prompt": config.limit_mm_per_prompt,
        }
    )


page = static("index.html")
ROUTES = [
    ("/", "GET", page),
    ("/playground", "GET", page),
    *((f"/playground/{name}", "GET", static(name)) for name in FILES if name != "index.html"),
    (SETTINGS_PATH, "GET", settings),
]
