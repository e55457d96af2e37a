"""HTTP routes of the local policy server, shaped like SGLang's (native /generate) and OpenAI's answers.

Request bodies are pydantic models, so a bad field is a 422 naming it; other
unusable input (no prompt, too long, unknown token id, streaming) is a 400
saying what to change. Unknown extra sampling keys are ignored, as SGLang does.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from factory.inference.engine import BatchingEngine, GenRequest, GenResult


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class NativeSampling(_Body):
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(128, ge=0)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=256)
    sampling_seed: int | None = None


class GenerateBody(_Body):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSampling = NativeSampling()
    return_logprob: bool = False
    stream: bool = False


class _OpenAIBody(_Body):
    model: str | None = None
    n: int = Field(1, ge=1, le=256)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False


class ChatMessage(_Body):
    role: str
    content: str


class ChatBody(_OpenAIBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionBody(_OpenAIBody):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False


class UpdateWeightsBody(_Body):
    model_path: str
    weight_version: int | str | None = None
    load_format: str | None = None


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise HTTPException(400, "field 'stop': stop strings must be non-empty")
    return stops


def register_routes(app: FastAPI, state: dict[str, Any], served_model_name: str) -> None:
    def engine() -> BatchingEngine:
        return state["engine"]

    def tokenizer():
        return engine().engine.tokenizer

    def check_ids(ids: list[int], field: str) -> list[int]:
        if not ids:
            raise HTTPException(400, f"field '{field}': the prompt is empty; give at least one token")
        vocab = len(tokenizer())
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise HTTPException(400, f"field '{field}': token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        limit = engine().engine.max_context
        if len(ids) >= limit:
            raise HTTPException(400, f"field '{field}': prompt of {len(ids)} tokens does not fit the "
                                     f"{limit}-token context; shorten it")
        return ids

    def no_stream(stream: bool) -> None:
        if stream:
            raise HTTPException(400, "field 'stream': streaming is not supported by the local server; set stream=false")

    async def sample(prompts: list[list[int]], n: int, *, temperature: float, top_p: float, max_new: int,
                     stop: list[str], seed: int | None) -> list[GenResult]:
        requests = [
            GenRequest(ids, max_new, temperature, top_p, stop, None if seed is None else seed + k)
            for ids in prompts for k in range(n)
        ]
        return await engine().generate(requests)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "owned_by": "factory",
                                            "root": engine().engine.model_path}]}

    @app.get("/get_model_info")
    async def model_info() -> dict:
        core = engine().engine
        return {"model_path": core.model_path, "tokenizer_path": core.model_path, "is_generation": True,
                "weight_version": str(core.weight_version), "served_model_name": served_model_name,
                "num_batches": engine().batches, "num_rows": engine().rows,
                "busy_s": round(engine().busy_s, 3), "update_s": round(engine().update_s, 3)}

    @app.get("/get_weight_version")
    async def weight_version() -> dict:
        return {"weight_version": str(engine().engine.weight_version)}

    @app.post("/update_weights_from_disk")
    async def update_weights(body: UpdateWeightsBody) -> dict:
        current = engine().engine.weight_version
        try:
            version = current + 1 if body.weight_version is None else int(body.weight_version)
        except ValueError:
            raise HTTPException(400, f"field 'weight_version': {body.weight_version!r} is not an integer") from None
        if not Path(body.model_path, "config.json").is_file():
            raise HTTPException(400, f"field 'model_path': {body.model_path!r} is not a HF model directory "
                                     "(no config.json) on the server's filesystem")
        try:
            await engine().update_weights(body.model_path, version)
        except (OSError, ValueError) as error:
            raise HTTPException(400, f"field 'model_path': cannot load {body.model_path!r}: {error}") from None
        return {"success": True, "message": f"loaded {body.model_path} as weight version {version}",
                "weight_version": str(version), "num_paused_requests": 0}

    @app.post("/generate")
    async def generate(body: GenerateBody) -> JSONResponse:
        no_stream(body.stream)
        if (body.text is None) == (body.input_ids is None):
            raise HTTPException(400, "give exactly one of the fields 'text' or 'input_ids'")
        if body.input_ids is not None:
            batch = body.input_ids and isinstance(body.input_ids[0], list)
            prompts = body.input_ids if batch else [body.input_ids]
            prompts = [check_ids(list(p), "input_ids") for p in prompts]
        else:
            batch = isinstance(body.text, list)
            texts = body.text if batch else [body.text]
            prompts = [check_ids(tokenizer().encode(t, add_special_tokens=False), "text") for t in texts]
        sp = body.sampling_params
        results = await sample(prompts, sp.n, temperature=sp.temperature, top_p=sp.top_p, max_new=sp.max_new_tokens,
                               stop=_stops(sp.stop), seed=sp.sampling_seed)
        items = []
        for index, res in enumerate(results):
            prompt = prompts[index // sp.n]
            finish = ({"type": "stop", "matched": res.matched_stop} if res.finish_reason == "stop"
                      else {"type": "length", "length": sp.max_new_tokens})
            meta: dict[str, Any] = {"id": uuid.uuid4().hex, "prompt_tokens": len(prompt),
                                    "completion_tokens": len(res.output_ids), "finish_reason": finish,
                                    "weight_version": str(res.weight_version)}
            if body.return_logprob:
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(res.logprobs, res.output_ids)]
            items.append({"text": res.text, "output_ids": res.output_ids, "meta_info": meta})
        # JSONResponse directly: FastAPI's jsonable_encoder walk over long logprob lists costs more than the JSON.
        return JSONResponse(items if batch or sp.n > 1 else items[0])

    def openai_envelope(kind: str, prompt: list[int], results: list[GenResult], choices: list[dict]) -> dict:
        completion = sum(len(r.output_ids) for r in results)
        return {"id": f"{kind}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
                "model": served_model_name, "choices": choices, "prompt_token_ids": prompt,
                "weight_version": str(results[0].weight_version) if results else None,
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": completion,
                          "total_tokens": len(prompt) + completion}}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody) -> JSONResponse:
        no_stream(body.stream)
        messages = [m.model_dump() for m in body.messages]
        text = tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = check_ids(tokenizer().encode(text, add_special_tokens=False), "messages")
        max_new = body.max_completion_tokens or body.max_tokens or 256
        results = await sample([prompt], body.n, temperature=body.temperature, top_p=body.top_p, max_new=max_new,
                               stop=_stops(body.stop), seed=body.seed)
        choices = []
        for index, res in enumerate(results):
            choice: dict[str, Any] = {"index": index, "message": {"role": "assistant", "content": res.text},
                                      "finish_reason": res.finish_reason, "token_ids": res.output_ids,
                                      "logprobs": None}
            if body.logprobs:
                choice["logprobs"] = {"content": [
                    {"token": tokenizer().convert_ids_to_tokens(t), "logprob": lp, "bytes": None, "top_logprobs": []}
                    for t, lp in zip(res.output_ids, res.logprobs)]}
            choices.append(choice)
        return JSONResponse(openai_envelope("chat.completion", prompt, results, choices))

    @app.post("/v1/completions")
    async def completions(body: CompletionBody) -> JSONResponse:
        no_stream(body.stream)
        if body.echo:
            raise HTTPException(400, "field 'echo': echo is not supported by the local server; set echo=false")
        ids = body.prompt if isinstance(body.prompt, list) else tokenizer().encode(body.prompt, add_special_tokens=False)
        prompt = check_ids(list(ids), "prompt")
        results = await sample([prompt], body.n, temperature=body.temperature, top_p=body.top_p,
                               max_new=body.max_tokens if body.max_tokens is not None else 16,
                               stop=_stops(body.stop), seed=body.seed)
        choices = []
        for index, res in enumerate(results):
            logprobs = None
            if body.logprobs is not None:
                logprobs = {"tokens": tokenizer().convert_ids_to_tokens(res.output_ids),
                            "token_logprobs": res.logprobs, "top_logprobs": None, "text_offset": None}
            choices.append({"index": index, "text": res.text, "finish_reason": res.finish_reason,
                            "logprobs": logprobs, "token_ids": res.output_ids})
        return JSONResponse(openai_envelope("text_completion", prompt, results, choices))
