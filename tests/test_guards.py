"""What stands before the routes: the API key guards every route but the public ones, on the path the router
matches whatever the root path; web pages of other origins, bodies that are not JSON and Host names a loopback
server does not have are refused; the playground's own page still works."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from fovea.frontend.async_llm import AsyncLLM

KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}
OPTIONS = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=64)


@pytest.fixture(scope="module")
def engine(tiny_dirs):
    from fovea.config.engine import EngineConfig

    engine = AsyncLLM(EngineConfig.from_args(str(tiny_dirs["tiny-3b"]), **OPTIONS))
    yield engine
    engine.shutdown()


def app_of(engine, **options):
    from fovea.server.app import ServerOptions, build_app

    return build_app(engine, ServerOptions(["tiny"], **options))


def run(app, requests, root_path: str = ""):
    """[(method, path, headers, body)] -> responses, through the app as uvicorn calls it (the root path is both
    in scope["path"] and in scope["root_path"])."""

    async def main():
        transport = httpx.ASGITransport(app=app, root_path=root_path, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000", timeout=60) as client:
            return [
                await client.request(method, path, headers=headers, content=body)
                for method, path, headers, body in requests
            ]

    return asyncio.run(main())


def every_route(app) -> list[tuple[str, str]]:
    return [
        (method, route.path.replace("{response_id}", "resp_x"))
        for route in app.routes
        if hasattr(route, "methods")
        for method in route.methods
        if method not in ("HEAD", "OPTIONS") and not route.path.startswith(("/docs", "/openapi", "/redoc"))
    ]


@pytest.mark.parametrize("root", ["", "/api", "/deep/proxy"])
def test_every_route_but_the_public_ones_wants_the_key_under_any_root_path(engine, monkeypatch, root):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")  # the runtime LoRA routes too
    app = app_of(engine, api_key=KEY)
    routes = every_route(app)
    public = {"/health", "/ping", "/load", "/version", "/metrics", "/", "/playground"} | {
        path for _, path in routes if path.startswith("/playground/") and path != "/playground/settings"
    }
    assert {"/v1/load_lora_adapter", "/playground/settings", "/tokenize", "/v1/responses"} <= {p for _, p in routes}
    json_headers = {"content-type": "application/json"}
    # through the proxy (the root path in front) and straight (a client that skips the proxy)
    for prefix in {root, ""}:
        without = run(app, [(m, prefix + p, json_headers, b"{}" if m == "POST" else None) for m, p in routes], root)
        wrong = run(
            app, [(m, prefix + p, json_headers | {"Authorization": "Bearer no"}, None) for m, p in routes], root
        )
        for (method, path), response, wrong_key in zip(routes, without, wrong):
            if path in public:
                assert response.status_code != 401, (prefix, method, path)
            else:
                assert response.status_code == 401 and wrong_key.status_code == 401, (prefix, method, path)
                assert response.json()["error"]["type"] == "AuthenticationError"
    answered = run(
        app, [("GET", root + "/v1/models", AUTH, None), ("GET", root + "/playground/settings", AUTH, None)], root
    )
    assert [r.status_code for r in answered] == [200, 200]


def test_web_pages_of_other_sites_are_refused_and_the_playground_works(engine):
    app = app_of(engine, allowed_hosts=["localhost", "127.0.0.1", "[::1]"])
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    own = {"origin": "http://127.0.0.1:8000", "content-type": "application/json"}
    responses = run(
        app,
        [
            ("POST", "/v1/chat/completions", own, chat),  # the playground, from its own page
            ("GET", "/", {}, None),
            ("POST", "/v1/chat/completions", {"content-type": "text/plain"}, chat),  # a form a page may send
            ("POST", "/v1/chat/completions", {}, chat),
            ("POST", "/v1/chat/completions", {**own, "origin": "https://evil.example"}, chat),
            ("POST", "/v1/chat/completions", {**own, "origin": "null"}, chat),  # a sandboxed frame, a file
            (
                "POST",
                "/v1/chat/completions",
                {**own, "host": "evil.example:8000", "origin": "http://evil.example:8000"},
                chat,
            ),
            ("GET", "/v1/models", {"host": "localhost:8000"}, None),
            ("GET", "/v1/models", {"host": "[::1]:8000"}, None),
        ],
    )
    statuses = [r.status_code for r in responses]
    assert statuses == [200, 200, 415, 415, 403, 403, 403, 200, 200], statuses
    assert "Content-Type: application/json" in responses[2].json()["error"]["message"]
    assert "--allowed-origins" in responses[4].json()["error"]["message"]
    assert "loopback" in responses[6].json()["error"]["message"]


def test_allowed_origins_get_cors_answers_and_others_do_not(engine):
    app = app_of(
        engine,
        api_key=KEY,
        allowed_origins=["https://app.example"],
        cors=dict(allow_methods=["*"], allow_headers=["*"]),
    )
    preflight = {"origin": "https://app.example", "access-control-request-method": "POST"}
    allowed, foreign, call = run(
        app,
        [
            ("OPTIONS", "/v1/chat/completions", preflight, None),
            ("OPTIONS", "/v1/chat/completions", {**preflight, "origin": "https://other.example"}, None),
            ("GET", "/v1/models", {"origin": "https://app.example"} | AUTH, None),
        ],
    )
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "https://app.example"
    assert foreign.status_code == 403
    assert call.status_code == 200 and call.headers["access-control-allow-origin"] == "https://app.example"
