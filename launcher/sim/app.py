"""The FastAPI app: SGLang's routes, status codes and error bodies.

As in docs/reference/sglang.md#endpoints. With --flavor vllm the routes are vLLM 0.11.0's
OpenAI server's (`/health`, `/ping`, `/version`, `/v1/models`, `/v1/chat/completions`,
`/v1/completions`, `/v1/embeddings`, `/classify`, `/metrics`), with strict transformers serve's (`/health`, `/v1/models`,
`/v1/chat/completions`); any other path is FastAPI's 404 (docs/development/simulator.md).
Every flavour also has the simulator's own `/sim/misbehave` (POST to change, GET to read) and
`GET /sim/stats` (stress.py), behind --api-key like the engine's routes.

Handlers take the raw Request and return Responses built with orjson: FastAPI's body
parsing and response_model machinery would cost more than the whole simulated request.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from launcher.sim import info, protocol, stress
from launcher.sim.chat import JSON, chat_completions
from launcher.sim.classify import SGLANG_PATH, VLLM_PATH, classify
from launcher.sim.completions import completions
from launcher.sim.embeddings import embeddings
from launcher.sim.generate import generate
from launcher.sim.metrics import CONTENT_TYPE
from launcher.sim.protocol import RequestError
from launcher.sim.simulator import Simulator, Status
from launcher.sim.stress import OWN_PREFIX, StressMiddleware, WindowError

log = logging.getLogger(__name__)
OPEN_PREFIXES = ("/health", "/ready", "/metrics")  # never need the API key (auth.py in SGLang)
FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running "
           "or waiting requests, the operation will not be performed.)\n")


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type=JSON)


class ApiKeyMiddleware:
    """`Authorization: Bearer KEY` on every route but health, readiness and metrics (vLLM:
    on the `/v1` routes only); the simulator's own `/sim/` routes need it in every flavour,
    since they change how the server answers."""

    def __init__(self, app: ASGIApp, api_key: str, flavor: str = "sglang") -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.flavor = flavor

    def _guarded(self, path: str) -> bool:
        if self.flavor == "vllm":
            return path.startswith(("/v1", OWN_PREFIX))
        return not path.startswith(OPEN_PREFIXES)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._guarded(scope["path"]):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await _json({"error": "Unauthorized"}, 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(sim: Simulator) -> FastAPI:
    """The app serving `sim`, with the routes of its flavour."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    flavor = sim.cfg.flavor

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        err = protocol.validation_error(list(exc.errors()), flavor)
        return Response(err.body, status_code=err.status, media_type=JSON)

    async def health(request: Request) -> Response:
        if sim.status is not Status.UP or sim.dead:
            return Response(status_code=503)
        if sim.cfg.health_latency:
            await asyncio.sleep(sim.cfg.health_latency)
        if flavor == "strict":  # transformers serve answers a small JSON body
            return _json({"status": "ok"})
        return Response(status_code=200)

    app.add_api_route("/health", health, methods=["GET"])

    @app.get("/v1/models")
    async def _models() -> Response:
        return _json({"object": "list", "data": [info.model_card(sim)]})

    @app.post("/v1/chat/completions")
    async def _chat(request: Request) -> Response:
        return await chat_completions(sim, request)

    @app.post("/sim/misbehave")
    async def _misbehave(request: Request) -> Response:
        try:
            sim.stress.misbehave(orjson.loads(await request.body() or b"{}"))
        except (orjson.JSONDecodeError, WindowError) as exc:
            return _json({"error": str(exc)}, 400)
        log.info("misbehaviour now %s", sim.stress.state())
        return _json(sim.stress.state())

    @app.get("/sim/misbehave")
    async def _misbehaviour() -> Response:
        return _json(sim.stress.state())

    @app.get("/sim/stats")
    async def _stats() -> Response:
        return _json(stress.stats(sim))

    if flavor == "vllm":
        app.add_api_route("/ping", health, methods=["GET", "POST"])

        @app.get("/version")
        async def _version() -> Response:
            return _json({"version": sim.cfg.vllm_version})
    elif flavor == "sglang":
        app.add_api_route("/health_generate", health, methods=["GET"])
        app.add_api_route("/ready", health, methods=["GET"])
        _add_sglang_routes(app, sim)

    if sim.metrics is not None:
        metrics = sim.metrics

        @app.get("/metrics")
        async def _metrics() -> Response:
            return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


def _add_sglang_routes(app: FastAPI, sim: Simulator) -> None:
    """SGLang's own routes beyond the OpenAI ones (docs/reference/sglang.md#endpoints)."""

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def _model_info() -> Response:
        return _json(info.model_info(sim))

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def _server_info() -> Response:
        return _json(info.server_info(sim))

    @app.get("/v1/models/{model:path}")
    async def _model(model: str) -> Response:
        if model != sim.cfg.served_name:
            return _json({"error": {"message": f"The model '{model}' does not exist",
                                    "type": "invalid_request_error", "param": "model",
                                    "code": "model_not_found"}}, 404)
        return _json(info.model_card(sim))

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def _generate(request: Request) -> Response:
        return await generate(sim, request)

    @app.post("/abort_request")
    async def _abort(request: Request) -> Response:
        try:
            data = protocol.parse_json_body(request.headers.get("content-type"),
                                            await request.body(), check_media_type=False)
        except RequestError as err:
            return Response(err.body, status_code=err.status, media_type=JSON)
        if isinstance(data, dict) and data.get("abort_all"):
            sim.scheduler.abort_all()
        elif isinstance(data, dict) and data.get("rid"):
            sim.scheduler.abort(str(data["rid"]))
        return Response(status_code=200)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def _flush() -> Response:
        busy = bool(sim.scheduler.running or sim.scheduler.waiting)
        return Response(FLUSHED, status_code=400 if busy else 200)


class FastPath:
    """Serves the generation and embedding routes straight from ASGI, everything else via
    FastAPI.

    FastAPI's per-request machinery (dependency solving, query and cookie parsing, route
    scanning) costs about as much as a whole simulated short request; skipping it for the
    hot routes is what lets one core answer thousands of requests per second.
    """

    def __init__(self, sim: Simulator, app: ASGIApp) -> None:
        self.app = app
        self.routes: dict[tuple[str, str], Callable[[Simulator, Request], Awaitable[Response]]]
        self.routes = {("POST", "/v1/chat/completions"): chat_completions}
        if sim.cfg.flavor != "strict":  # both engines register both routes in either mode
            self.routes |= {("POST", "/v1/completions"): completions,
                            ("POST", "/v1/embeddings"): embeddings}
        if sim.cfg.flavor == "sglang":
            self.routes |= {("POST", "/generate"): generate, ("PUT", "/generate"): generate,
                            ("POST", SGLANG_PATH): classify}
        if sim.cfg.flavor == "vllm":
            self.routes |= {("POST", VLLM_PATH): classify}
        self.sim = sim

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.routes.get((scope.get("method", ""), scope.get("path", "")))
        if handler is None:
            await self.app(scope, receive, send)
            return
        try:
            response = await handler(self.sim, Request(scope, receive))
        except Exception as exc:  # what SGLang's serving_base answers for a surprise
            log.exception("unexpected error in %s", scope["path"])
            err = protocol.flavor_error(self.sim.cfg.flavor, 500,
                                        f"Internal server error: {exc}", "InternalServerError")
            response = Response(err.body, status_code=500, media_type=JSON)
        await response(scope, receive, send)


def asgi_app(sim: Simulator) -> ASGIApp:
    """What uvicorn serves: the FastAPI app behind the fast path (and the API key check)."""
    app: ASGIApp = FastPath(sim, create_app(sim))
    if sim.cfg.api_key:
        app = ApiKeyMiddleware(app, sim.cfg.api_key, sim.cfg.flavor)
    return StressMiddleware(app, sim)
