"""Atropos's batching API (same paths, bodies, responses and status codes) over `BatchService`.

Hot paths (/scored_data, /scored_data_list, /batch) read and write raw bytes:
bodies are decoded by `wire.py` (msgspec, straight to Arrow rows; loose as
Atropos is, deduplicated only by group_id / Idempotency-Key), responses are
built by `payload.py` without FastAPI's generic encoder (GET /batch answers an
Arrow IPC stream instead of JSON to clients whose Accept header prefers
`application/vnd.apache.arrow.stream`). Bad input gets a 4xx naming the field;
FastAPI's own models give its usual 422 detail list.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sqlite3
import sys
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ValidationError

from environments.groups import ScoredGroup
from factory.serve.backpressure import IngestBudget, Overloaded
from factory.serve.config import ServeConfig
from factory.serve.contract import ARROW_STREAM, PayloadError, WireError, prefers_arrow
from factory.serve.http import BodyError, FastPosts, RequestGuard, gzip_size_hint, gzip_wanted, inflate_gzip, json_response
from factory.serve.service import BatchService

logger = logging.getLogger(__name__)

_GROUP_FIELDS = frozenset(ScoredGroup.model_fields)
STORAGE_ERRORS = (OSError, RuntimeError, sqlite3.Error)
"""Failures of the store or the state DB (a full disk, I/O errors): answered 503 with Retry-After, never 500."""


def unavailable(detail: str, retry_after_s: int = 1) -> Response:
    """A 503 that keeps the connection usable and tells the client when to retry."""
    return Response(orjson.dumps({"detail": detail}), status_code=503, media_type="application/json",
                    headers={"Retry-After": str(retry_after_s)})


class Registration(BaseModel):
    """A trainer's POST /register body (Atropos's fields)."""

    wandb_group: str
    wandb_project: str
    batch_size: int
    max_token_len: int
    checkpoint_dir: str
    save_checkpoint_interval: int
    starting_step: int
    num_steps: int


class RegisterEnv(BaseModel):
    """An environment's POST /register-env body (Atropos's fields)."""

    max_token_length: int
    desired_name: str
    weight: float
    group_size: int
    min_batch_allocation: float | None = None


class EnvIdentifier(BaseModel):
    env_id: int


class ScoredDataDoc(BaseModel):
    """Atropos's ScoredData, for the OpenAPI schema only (bodies are decoded by wire.py, unknown keys ignored)."""

    tokens: list[list[int]]
    masks: list[list[int]]
    scores: list[float]
    advantages: list[list[float]] | None = None
    ref_logprobs: list[list[float]] | None = None
    messages: list[list[dict[str, Any]]] | None = None
    generation_params: dict[str, Any] | None = None
    inference_logprobs: list[list[float]] | None = None
    overrides: list[dict[str, Any]] | None = None
    group_overrides: dict[str, Any] | None = None
    images: Any | None = None
    env_id: int | None = None
    distill_token_ids: list[list[list[int]]] | None = None
    distill_logprobs: list[list[list[float]]] | None = None
    group_id: str | None = None


def _body_doc(schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "parameters": [{"name": "Idempotency-Key", "in": "header", "required": False, "schema": {"type": "string"},
                        "description": "Client-given identity: a retried post with the same key is stored once."}],
    }


_GROUP_DOC = ScoredDataDoc.model_json_schema()


def _detail(error: ValidationError, prefix: tuple[Any, ...]) -> list[dict[str, Any]]:
    return [
        {"type": e["type"], "loc": ["body", *prefix, *e["loc"]], "msg": e["msg"].removeprefix("Value error, ")}
        for e in error.errors(include_input=False, include_url=False)
    ]


def _unprocessable(detail: list[dict[str, Any]]) -> Response:
    return Response(orjson.dumps({"detail": detail}), status_code=422, media_type="application/json")


def parse_groups(body: bytes, *, many: bool) -> list[ScoredGroup] | Response:
    """Posted ScoredData object(s) as validated groups, or the 4xx response naming what is wrong."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        return _unprocessable([{"type": "json_invalid", "loc": ["body"], "msg": f"body is not valid JSON: {error}"}])
    items = data if many else [data]
    if many and not isinstance(data, list):
        return _unprocessable([{"type": "list_type", "loc": ["body"], "msg": "body must be a JSON list of ScoredData objects"}])
    groups, problems = [], []
    for index, item in enumerate(items):
        prefix = (index,) if many else ()
        if not isinstance(item, dict):
            problems.append({"type": "dict_type", "loc": ["body", *prefix], "msg": "a ScoredData object is required"})
            continue
        # Atropos's ScoredData ignores unknown keys; so do we.
        fields = {key: value for key, value in item.items() if key in _GROUP_FIELDS}
        try:
            groups.append(ScoredGroup.model_validate(fields))
        except ValidationError as error:
            problems.extend(_detail(error, prefix))
    return _unprocessable(problems) if problems else groups


def create_app(config: ServeConfig, service: BatchService | None = None) -> FastAPI:
    """The FastAPI app; the service (made from `config` if not given) starts and stops with it."""
    service = service or BatchService(config)
    budget = IngestBudget(
        int(config.ingest_budget_mb * (1 << 20)), max_waiting_bytes=int(config.ingest_waiting_mb * (1 << 20)),
        max_wait_s=config.ingest_wait_s,
    )
    service.ingest_budget = budget
    max_body = int(config.max_body_mb * (1 << 20))
    # Decoding holds the GIL: more threads than this only take turns with the event loop and each other
    # (one thread ingested ~15% more one-group posts per second than asyncio's default pool of six).
    decoder = ThreadPoolExecutor(config.decode_threads, thread_name_prefix="decode")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()
            decoder.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="rollout-factory batching API (Atropos-compatible)", lifespan=lifespan)
    app.state.service = service
    app.add_middleware(RequestGuard, token=config.api_token, max_body_bytes=max_body)
    # Atropos's run-api answers browsers' CORS requests from any origin; before the guard, so preflights need no token.
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_credentials=True, allow_methods=["*"], allow_headers=["*"])

    def respond(request: Request, data: Any = None, **kwargs: Any) -> Response:
        return json_response(request, data, gzip_level=config.gzip_level, gzip_min_bytes=config.gzip_min_bytes,
                             gzip_loopback=config.gzip_loopback, **kwargs)

    @app.get("/")
    async def root() -> dict[str, str]:
        return {"message": "AtroposLib API"}

    @app.post("/register")
    async def register(registration: Registration) -> dict[str, Any]:
        if registration.batch_size <= 0:
            return _unprocessable([{"type": "greater_than", "loc": ["body", "batch_size"], "msg": "batch_size must be > 0"}])
        if registration.starting_step < 0:
            return _unprocessable([{"type": "greater_than_equal", "loc": ["body", "starting_step"], "msg": "starting_step must be >= 0"}])
        return await service.register(registration.model_dump())

    @app.post("/register-env")
    async def register_env(request: RegisterEnv) -> dict[str, Any]:
        if request.group_size <= 0:
            return _unprocessable([{"type": "greater_than", "loc": ["body", "group_size"], "msg": "group_size must be > 0"}])
        if request.min_batch_allocation is not None and not 0.0 <= request.min_batch_allocation <= 1.0:
            return _unprocessable(
                [{"type": "value_error", "loc": ["body", "min_batch_allocation"], "msg": "min_batch_allocation must be between 0 and 1"}]
            )
        return service.register_env(request.model_dump())

    @app.post("/disconnect-env")
    async def disconnect_env(env: EnvIdentifier) -> dict[str, Any]:
        return service.disconnect_env(env.env_id)

    @app.get("/wandb_info")
    async def wandb_info() -> dict[str, Any]:
        return service.wandb_info()

    @app.get("/info")
    async def info() -> dict[str, Any]:
        return service.info()

    @app.get("/status")
    async def status(request: Request) -> Response:
        return respond(request, service.status())

    @app.get("/status-env")
    async def status_env(request: Request) -> Response:
        # Atropos's env client sends GET with a JSON body {"env_id": N}; ?env_id=N works too.
        body = await request.body()
        raw: Any = request.query_params.get("env_id")
        if body:
            try:
                data = orjson.loads(body)
            except orjson.JSONDecodeError as error:
                return _unprocessable([{"type": "json_invalid", "loc": ["body"], "msg": f"body is not valid JSON: {error}"}])
            raw = data.get("env_id") if isinstance(data, dict) else None
        try:
            env_id = EnvIdentifier.model_validate({"env_id": raw}).env_id
        except ValidationError as error:
            return _unprocessable(_detail(error, ()))
        result = service.status_env(env_id)
        if result is None:
            return Response(
                orjson.dumps({"detail": f"env_id {env_id} is not registered: call /register-env first"}),
                status_code=404,
                media_type="application/json",
            )
        return respond(request, result)

    @app.get("/batch")
    async def batch(request: Request) -> Response:
        arrow = prefers_arrow(request.headers.get("accept", ""))
        try:
            body = await service.next_batch(gzip_wanted(request, config.gzip_loopback), arrow)
        except PayloadError as error:
            logger.error("cannot serve a batch: %s", error)
            return Response(orjson.dumps({"detail": str(error)}), status_code=503, media_type="application/json")
        except STORAGE_ERRORS as error:
            logger.error("cannot record a batch as served: %s", error)
            return unavailable(f"batch not served (nothing was taken), retry later: {error}")
        if arrow and body.arrow is not None:  # without rows (no batch, not registered) the body is JSON
            return Response(body.arrow, media_type=ARROW_STREAM, headers={"vary": "Accept, Accept-Encoding"})
        if body.raw is None:  # made for this client, which takes gzip (service.BatchBody.ready)
            return Response(body.gz, media_type="application/json", headers={"vary": "Accept-Encoding", "content-encoding": "gzip"})
        return respond(request, raw=body.raw, gz=body.gz)

    @app.get("/latest_example")
    async def latest_example(request: Request) -> Response:
        example = await service.latest_example()
        return respond(request, raw=example) if isinstance(example, bytes) else respond(request, example)

    def decode(body: bytes, gzipped: bool, key: str | None, many: bool, arrival: Any) -> Any:
        """In a worker thread: gunzip, decode and check the body, and build its Arrow rows."""
        from factory.serve.wire import decode_groups  # pyarrow: loaded by ready_for_posts already

        service.announce(arrival)
        if gzipped:
            body = inflate_gzip(body, max_body)
        # Env names and policy versions are resolved here too, so the rows are built once, off the event loop.
        return decode_groups(body, many=many, strict=config.strict, idempotency_key=key, build=True, run_id=config.ingest_run,
                             vocab_size=config.vocab_size, env_name=service.env_name, version=service.step, defer=True)

    async def ingest(body: bytes, gzipped: bool, key: str | None, many: bool) -> Response:
        """Store a /scored_data(_list) body (gzipped or not); the 200 comes once its groups are durable."""
        try:
            await service.ready_for_posts()
        except STORAGE_ERRORS as error:
            logger.error("the store cannot take posts: %s", error)
            return unavailable(f"groups not stored, retry later: {error}")
        try:
            async with budget.reserve(gzip_size_hint(body, max_body) if gzipped else len(body)):
                with service.arriving() as arrival:  # the next commit lingers for this body while it is decoded
                    count = await store_groups(body, gzipped, key, many, arrival)
        except Overloaded as error:
            return Response(orjson.dumps({"detail": str(error)}), status_code=503, media_type="application/json",
                            headers={"Retry-After": str(max(1, round(error.retry_after_s)))})
        if isinstance(count, Response):
            return count
        return Response(orjson.dumps({"status": "received", "groups_processed": count} if many else {"status": "received"}),
                        media_type="application/json")

    async def store_groups(body: bytes, gzipped: bool, key: str | None, many: bool, arrival: Any) -> Response | int:
        try:
            parsed = await asyncio.get_running_loop().run_in_executor(decoder, decode, body, gzipped, key, many, arrival)
        except BodyError as error:
            return Response(orjson.dumps({"detail": str(error)}), status_code=error.status, media_type="application/json")
        except WireError as error:
            return _unprocessable(error.detail)
        count = len(parsed.sizes)
        batch_size = service.info()["batch_size"]
        for index, size in enumerate(parsed.sizes):
            if batch_size > 0 and size > batch_size:
                loc = ["body", index, "tokens"] if many else ["body", "tokens"]
                return _unprocessable(
                    [{"type": "too_long", "loc": loc, "msg": f"group has {size} sequences but batch_size is {batch_size}"}]
                )
        try:
            await service.ingest_wire(parsed, arrival)
        except WireError as error:
            return _unprocessable(error.detail)
        except ValueError as error:
            return _unprocessable([{"type": "value_error", "loc": ["body"], "msg": str(error)}])
        except STORAGE_ERRORS as error:
            logger.error("posted groups could not be committed: %s", error)
            return unavailable(f"groups not stored, retry later (a retry with the same group_id or Idempotency-Key "
                               f"is never stored twice): {error}")
        except Exception as error:  # noqa: BLE001 - answer (and keep the connection) rather than let the server reset it
            logger.exception("posted groups could not be committed")
            return Response(orjson.dumps({"detail": f"internal error, groups not stored: {error}"}), status_code=500,
                            media_type="application/json")
        return count

    post_one, post_many = functools.partial(ingest, many=False), functools.partial(ingest, many=True)

    # Requests that reach these routes come through RequestGuard, which has already un-gzipped the body;
    # most never do: FastPosts answers them first (see below).
    @app.post("/scored_data", openapi_extra=_body_doc(_GROUP_DOC))
    async def scored_data(request: Request) -> Response:
        return await post_one(await request.body(), False, request.headers.get("idempotency-key") or None)

    @app.post("/scored_data_list", openapi_extra=_body_doc({"type": "array", "items": _GROUP_DOC}))
    async def scored_data_list(request: Request) -> Response:
        return await post_many(await request.body(), False, request.headers.get("idempotency-key") or None)

    @app.get("/reset_data")
    async def reset_data() -> PlainTextResponse:
        await service.reset()
        return PlainTextResponse("Reset successful", status_code=200)

    # Outermost: the hot posts skip routing, CORS and FastAPI's per-request work (envs post every group, often one
    # per request); browsers' posts (Origin header) still get the full stack and its CORS headers.
    app.add_middleware(FastPosts, handlers={"/scored_data": post_one, "/scored_data_list": post_many},
                       token=config.api_token, max_body_bytes=max_body, on_idle=_drop_decoder_scratch)
    return app


def _drop_decoder_scratch() -> None:
    """Big posts stopped coming: the buffers numjson kept for them go (if it was ever loaded; this does not load it)."""
    numjson = sys.modules.get("factory.serve.numjson")
    if numjson is not None:
        numjson.drop_scratch()
