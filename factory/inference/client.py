"""The async inference client every environment uses: one or many SGLang / OpenAI-compatible endpoints.

    async with InferenceClient(InferenceConfig(base_url=["http://a:30000/v1", "http://b:30000/v1"])) as client:
        rollouts = await client.generate(prompt_ids, n=8, sampling=SamplingParams(max_tokens=64))

Requests go to the endpoint with the fewest in flight (capped per endpoint).
429, 5xx, timeouts, dropped connections and aborted generations are retried
with exponential backoff and jitter, up to `max_retries`, then an
`InferenceError` names the endpoint and the last failure; other 4xx fail at
once. `n` is split into requests of at most `max_n_per_request`, and topped up
when a server returns fewer choices than asked. Every Completion carries the
policy version that produced it: the server's `weight_version` when it reports
one, else the version the client last set on that endpoint.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import httpx
from pydantic import Field, field_validator

from factory.config import FactoryConfig
from factory.inference.http_pool import KeepAliveHttp
from factory.inference.endpoints import Endpoint, EndpointPool, NoEndpointAvailable, endpoint_root
from factory.inference.parse import parse_chat, parse_completions, parse_generate, weight_version_of
from factory.inference.types import Completion, SamplingParams

logger = logging.getLogger(__name__)


class InferenceConfig(FactoryConfig):
    """The `openai` config section (Atropos's name): where to sample and how hard to try."""

    base_url: str | list[str] = Field("http://127.0.0.1:30000/v1", description="One endpoint URL or a list of them.")
    model_name: str = Field("default", description="Model name sent in OpenAI-compatible requests.")
    api_key: str = Field("x", description="Bearer token sent to every endpoint.")
    server_type: Literal["sglang", "openai", "vllm"] = Field(
        "sglang", description="sglang: native /generate (token in/out), /health, weight updates; openai/vllm: /v1 only.")
    timeout: float = Field(120.0, gt=0, description="Seconds one HTTP request may take before it is retried.")
    num_max_requests_at_once: int = Field(64, ge=1, description="Most requests in flight per endpoint.")
    max_retries: int = Field(4, ge=0, description="Retries per request after the first attempt.")
    backoff_base_s: float = Field(0.2, ge=0, description="First retry delay; doubles per retry, with +-50% jitter.")
    backoff_max_s: float = Field(5.0, ge=0, description="Longest delay between retries.")
    max_n_per_request: int | None = Field(None, ge=1, description="Split larger n into requests of this size.")
    eject_after_failures: int = Field(3, ge=1, description="Consecutive failures that take an endpoint out.")
    probe_interval_s: float = Field(1.0, gt=0, description="How often an endpoint out of rotation is probed.")
    request_logprobs: bool = Field(True, description="Ask chat/completions endpoints for per-token logprobs.")
    request_token_ids: bool | None = Field(
        None, description="Ask chat/completions endpoints for the prompt's and each choice's token ids (vLLM's "
        "`return_token_ids`), so completions are not tokenized again here; None: when server_type is vllm "
        "(servers that do not know the field may refuse it).")
    health_check_on_start: bool = Field(True, description="Probe every endpoint when the client opens.")
    weight_update_timeout_s: float = Field(600.0, gt=0, description="Seconds to wait for all endpoints to load weights.")
    # Atropos's APIServerConfig names, so an Atropos `openai:` section loads unchanged.
    n_kwarg_is_ignored: bool = Field(False, description="The server ignores n: send n requests of one (Atropos name).")
    health_check: bool = Field(True, description="Probe endpoint health at all; False trusts every endpoint (Atropos name).")
    health_interval_s: float = Field(5.0, gt=0, description="Seconds between background health checks of every "
                                     "endpoint while a client is open.")
    down_after_s: float = Field(15.0, ge=0, description="Seconds every endpoint may fail (health checks, connections) "
                                "before requests fail at once naming them (0: wait and retry as for any failure).")
    num_requests_for_eval: int = Field(64, ge=1, description="Accepted for Atropos configs; evaluation concurrency.")
    rolling_buffer_length: int = Field(1000, ge=1, description="Accepted for Atropos configs; not used here.")
    tokenizer_name: str = Field("none", description="Accepted for Atropos configs; the env's tokenizer_name is used.")

    @field_validator("base_url")
    @classmethod
    def _urls(cls, value: str | list[str]) -> str | list[str]:
        urls = [value] if isinstance(value, str) else value
        if not urls:
            raise ValueError("give at least one endpoint URL in base_url")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"endpoint {url!r} must start with http:// or https://")
        return value

    @property
    def wants_token_ids(self) -> bool:
        """Whether chat/completions requests ask for token ids (`request_token_ids`, by default vLLM only)."""
        return self.server_type == "vllm" if self.request_token_ids is None else self.request_token_ids

    @property
    def urls(self) -> list[str]:
        return [self.base_url] if isinstance(self.base_url, str) else list(self.base_url)


class InferenceError(RuntimeError):
    """A request that could not be served; names the endpoint and the last failure."""

    def __init__(self, message: str, *, endpoint: str | None = None, last_failure: str | None = None) -> None:
        super().__init__(message)
        self.endpoint, self.last_failure = endpoint, last_failure


class InferenceRequestError(InferenceError):
    """The server refused the request itself (a 4xx other than 429): retrying cannot help."""


class _Retryable(Exception):
    def __init__(self, reason: str, *, eject: bool = True, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.eject, self.retry_after = eject, retry_after


class InferenceClient:
    def __init__(self, config: InferenceConfig | None = None, **overrides: Any) -> None:
        self.config = config or InferenceConfig(**overrides)
        cfg = self.config
        self._http = KeepAliveHttp(timeout=httpx.Timeout(cfg.timeout, connect=min(cfg.timeout, 10.0)),
                                   headers={"Authorization": f"Bearer {cfg.api_key}"},
                                   connections=cfg.num_max_requests_at_once * len(cfg.urls))
        health = "/health" if cfg.server_type == "sglang" else "/v1/models"
        self.pool = EndpointPool([endpoint_root(u) for u in cfg.urls], cap=cfg.num_max_requests_at_once,
                                 eject_after=cfg.eject_after_failures, probe_interval_s=cfg.probe_interval_s,
                                 health_path=health, http=self._http)
        self.policy_version = 0

    async def __aenter__(self) -> InferenceClient:
        if self.config.health_check and self.config.health_check_on_start:
            await self.pool.check_all()
        if self.config.health_check and self.config.down_after_s > 0:
            self.pool.start_watch(interval_s=self.config.health_interval_s, fail_after=2,
                                  check_timeout_s=min(5.0, self.config.health_interval_s * 2),
                                  dead_after_s=self.config.down_after_s)
        if self.config.server_type == "sglang":
            await asyncio.gather(*(self._read_version(ep) for ep in self.pool.endpoints if ep.healthy))
            self.policy_version = max((ep.policy_version for ep in self.pool.endpoints), default=0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.pool.close()
        await self._http.aclose()

    # ---- sampling -------------------------------------------------------------------------------------------

    async def generate(self, input_ids: list[int], *, n: int = 1, sampling: SamplingParams | None = None
                       ) -> list[Completion]:
        """Token in, token out: SGLang's /generate with return_logprob (or /v1/completions on a token prompt)."""
        sampling = sampling or SamplingParams()
        if not input_ids:
            raise ValueError("input_ids is empty; give the prompt's token ids")
        if self.config.server_type != "sglang":
            return await self._split_n(n, sampling, lambda k, s: self._completions_request(list(input_ids), k, s))

        async def one(k: int, s: SamplingParams) -> list[Completion]:
            body = {"input_ids": input_ids, "sampling_params": {**s.sglang_fields(), "n": k}, "return_logprob": True}
            return await self._request("/generate", body, lambda data, ep: parse_generate(data, input_ids, ep))

        return await self._split_n(n, sampling, one)

    async def chat(self, messages: list[dict], *, n: int = 1, sampling: SamplingParams | None = None
                   ) -> list[Completion]:
        """OpenAI-compatible chat completions; token ids and logprobs are filled where the server returns them."""
        sampling = sampling or SamplingParams()
        if not messages:
            raise ValueError("messages is empty; give at least one {'role', 'content'} message")

        async def one(k: int, s: SamplingParams) -> list[Completion]:
            body = {"model": self.config.model_name, "messages": messages, "n": k, **s.openai_fields()}
            if self.config.request_logprobs:
                body["logprobs"] = True
            if self.config.wants_token_ids:
                body["return_token_ids"] = True
            return await self._request("/v1/chat/completions", body, parse_chat)

        return await self._split_n(n, sampling, one)

    async def completion(self, prompt: str, *, n: int = 1, sampling: SamplingParams | None = None
                         ) -> list[Completion]:
        """OpenAI-compatible text completions."""
        sampling = sampling or SamplingParams()
        return await self._split_n(n, sampling, lambda k, s: self._completions_request(prompt, k, s))

    async def _completions_request(self, prompt: str | list[int], k: int, s: SamplingParams) -> list[Completion]:
        body = {"model": self.config.model_name, "prompt": prompt, "n": k, **s.openai_fields()}
        if self.config.request_logprobs:
            body["logprobs"] = 1
        if self.config.wants_token_ids:
            body["return_token_ids"] = True
        prompt_ids = prompt if isinstance(prompt, list) else None
        return await self._request("/v1/completions", body, lambda data, ep: parse_completions(data, prompt_ids, ep))

    async def _split_n(self, n: int, sampling: SamplingParams,
                       one: Callable[[int, SamplingParams], Awaitable[list[Completion]]]) -> list[Completion]:
        """Ask for n completions in chunks of at most max_n_per_request; top up servers that return fewer."""
        if n < 1:
            raise ValueError(f"n={n}: ask for at least one completion")
        cap = 1 if self.config.n_kwarg_is_ignored else self.config.max_n_per_request or n
        if n <= cap:  # one request (the common case): awaited in this task, without gather's task (~13 us a call)
            results = (await one(n, sampling))[:n]
        else:
            offsets = range(0, n, cap)
            chunks = await asyncio.gather(*(one(min(cap, n - off), _reseed(sampling, off)) for off in offsets))
            results = [c for chunk in chunks for c in chunk][:n]
        while len(results) < n:  # the server ignored or capped n
            got = await one(n - len(results), _reseed(sampling, len(results)))
            if not got:
                raise InferenceError(f"server returned no choices for n={n - len(results)}")
            results.extend(got[: n - len(results)])
        return results

    # ---- one request with retries -----------------------------------------------------------------------------

    async def _request(self, path: str, body: dict[str, Any],
                       parse: Callable[[Any, Endpoint], list[Completion]]) -> list[Completion]:
        cfg = self.config
        attempts = cfg.max_retries + 1
        last_failure, last_endpoint = "no attempt made", None
        for attempt in range(attempts):
            try:
                ep = await self.pool.acquire(time.monotonic() + cfg.timeout)
            except NoEndpointAvailable as error:
                last_failure = str(error)
                await self._backoff(attempt, None)
                continue
            last_endpoint = ep.root
            try:
                return await self._attempt(ep, path, body, parse)
            except _Retryable as failure:
                last_failure = str(failure)
                self.pool.failed(ep, last_failure, eject=failure.eject and cfg.health_check)
                if attempt + 1 < attempts:
                    logger.info("retrying %s (attempt %d/%d) after %s", path, attempt + 2, attempts, last_failure)
                    await self._backoff(attempt, failure.retry_after)
            finally:
                self.pool.release(ep)
        raise InferenceError(
            f"{path} failed {attempts} times; last endpoint {last_endpoint}, last failure: {last_failure}. "
            "Check that the inference server is up (its /health route) or raise openai.max_retries / openai.timeout",
            endpoint=last_endpoint, last_failure=last_failure,
        )

    async def _attempt(self, ep: Endpoint, path: str, body: dict[str, Any],
                       parse: Callable[[Any, Endpoint], list[Completion]]) -> list[Completion]:
        task = asyncio.current_task()
        ep.requests.add(task)
        try:
            response = await self._http.post(ep.root + path, json=body)
        except asyncio.CancelledError:
            if task in ep.abandoned and task.uncancel() == 0:  # cancelled by the pool, not by our caller
                raise _Retryable(f"{ep.root}{path}: abandoned, the endpoint fails its health checks ({ep.last_failure})",
                                 eject=False) from None
            raise
        except httpx.TimeoutException as error:
            raise _Retryable(f"{ep.root}{path}: timed out after {self.config.timeout:.0f} s ({type(error).__name__})")
        except httpx.TransportError as error:
            raise _Retryable(f"{ep.root}{path}: connection failed ({type(error).__name__}: {error})")
        finally:
            ep.requests.discard(task)
            ep.abandoned.discard(task)
        status = response.status_code
        if status == 429:
            raise _Retryable(f"{ep.root}{path}: HTTP 429 rate limited", eject=False,
                             retry_after=_retry_after(response))
        if status >= 500:
            raise _Retryable(f"{ep.root}{path}: HTTP {status}: {response.text[:300]}")
        if status >= 400:
            raise InferenceRequestError(f"{ep.root}{path} refused the request: HTTP {status}: {response.text[:500]}",
                                        endpoint=ep.root, last_failure=f"HTTP {status}")
        try:
            completions = parse(response.json(), ep)
        except (ValueError, KeyError, TypeError, IndexError) as error:
            raise _Retryable(f"{ep.root}{path}: unreadable answer ({type(error).__name__}: {error})")
        if "abort" in [c.finish_reason for c in completions]:  # a list, not any() over a generator: per request
            raise _Retryable(f"{ep.root}{path}: generation aborted by the server (weight update?)", eject=False)
        self.pool.succeeded(ep)
        return completions

    async def _backoff(self, attempt: int, retry_after: float | None) -> None:
        cfg = self.config
        delay = min(cfg.backoff_max_s, cfg.backoff_base_s * 2**attempt) * random.uniform(0.5, 1.5)
        if retry_after is not None:
            delay = max(delay, min(retry_after, cfg.backoff_max_s))
        await asyncio.sleep(delay)

    # ---- weights -------------------------------------------------------------------------------------------------

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        """Load new weights on every endpoint and wait until all report `version`.

        Requests already running finish on the old weights and say so (their
        Completion.policy_version is the old one); requests sent after this
        returns are served by the new weights.
        """
        if self.config.server_type != "sglang":
            raise InferenceError("update_weights_from_disk needs server_type 'sglang' (an SGLang-compatible server)")
        deadline = time.monotonic() + self.config.weight_update_timeout_s
        await asyncio.gather(*(self._update_one(ep, path, version, deadline) for ep in self.pool.endpoints))
        self.policy_version = version

    async def _update_one(self, ep: Endpoint, path: str, version: int, deadline: float) -> None:
        body = {"model_path": path, "weight_version": str(version)}
        timeout = max(1.0, deadline - time.monotonic())
        try:
            response = await self._http.post(ep.root + "/update_weights_from_disk", json=body, timeout=timeout)
        except httpx.HTTPError as error:
            raise InferenceError(f"{ep.root}: weight update to {path} failed: {type(error).__name__}: {error}",
                                 endpoint=ep.root, last_failure=str(error)) from error
        data = response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
        if response.status_code != 200 or data.get("success") is False:
            raise InferenceError(f"{ep.root}: weight update to {path} refused: HTTP {response.status_code}: "
                                 f"{response.text[:500]}", endpoint=ep.root, last_failure=response.text[:200])
        while time.monotonic() < deadline:
            if await self._read_version(ep) == version:
                ep.policy_version = version
                return
            await asyncio.sleep(0.2)
        raise InferenceError(f"{ep.root} did not report weight version {version} within "
                             f"{self.config.weight_update_timeout_s:.0f} s", endpoint=ep.root)

    async def _read_version(self, ep: Endpoint) -> int | None:
        try:
            response = await self._http.get(ep.root + "/get_model_info", timeout=10.0)
            version = weight_version_of(response.json()) if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        if version is not None:
            ep.policy_version = version
        return version


def _reseed(sampling: SamplingParams, offset: int) -> SamplingParams:
    """Chunks of one split request must not repeat each other's samples."""
    if sampling.seed is None or offset == 0:
        return sampling
    return sampling.model_copy(update={"seed": sampling.seed + offset})


def _retry_after(response: Any) -> float | None:
    try:
        return float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return None
