"""Batched sampling from a Hugging Face causal LM on CPU, with exact per-token logprobs.

`PolicyEngine.generate_batch` is a plain function over a batch of token-id rows:
left-pad, one prefill, then one forward per new token with the KV cache. Each
row keeps its own temperature, top_p, max_new_tokens, stop strings and seed.
Logprobs are log-softmax of the model's unscaled logits at the sampled token,
so they equal a teacher-forced forward pass over prompt + completion (what a
GRPO trainer recomputes), whatever temperature or top_p sampled the token.
`BatchingEngine` runs it on a worker thread, merging concurrent requests.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclass
class GenRequest:
    """One row to sample: prompt tokens and that row's sampling settings."""

    input_ids: list[int]
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None


@dataclass
class GenResult:
    output_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" | "length"
    matched_stop: str | int | None
    weight_version: int


class PolicyEngine:
    """A loaded model + tokenizer and the sampling loop; swap weights with `load`."""

    def __init__(self, model_path: str | Path, *, weight_version: int = 0) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self.model_path = str(model_path)
        self.model: Any = None
        self.weight_version = weight_version
        self.load(model_path, weight_version)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.stop_token_ids[0] if self.stop_token_ids else 0)

    def load(self, model_path: str | Path, weight_version: int) -> None:
        """Load (or replace) the weights from a HF model directory."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
        model.eval()
        self.model, self.model_path, self.weight_version = model, str(model_path), weight_version
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        self.stop_token_ids = sorted(ids)
        self.max_context = int(getattr(model.config, "max_position_embeddings", 2048))
        logger.info("loaded %s as weight version %d", model_path, weight_version)

    @torch.inference_mode()
    def generate_batch(self, requests: list[GenRequest]) -> list[GenResult]:
        """Sample every request to completion in one padded batch."""
        if not requests:
            return []
        rows = len(requests)
        longest = max(len(r.input_ids) for r in requests)
        ids = torch.full((rows, longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((rows, longest), dtype=torch.long)
        for i, req in enumerate(requests):
            ids[i, longest - len(req.input_ids) :] = torch.tensor(req.input_ids, dtype=torch.long)
            mask[i, longest - len(req.input_ids) :] = 1
        budget = [min(r.max_new_tokens, self.max_context - len(r.input_ids)) for r in requests]
        temps = torch.tensor([max(r.temperature, 1e-5) for r in requests]).unsqueeze(1)
        greedy = torch.tensor([r.temperature == 0 for r in requests])
        top_p = torch.tensor([r.top_p for r in requests]).unsqueeze(1)
        shared = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,)).item()))
        gens = [torch.Generator().manual_seed(r.seed) if r.seed is not None else shared for r in requests]
        stop_ids = torch.tensor(self.stop_token_ids or [-1])

        out_ids: list[list[int]] = [[] for _ in requests]
        out_lp: list[list[float]] = [[] for _ in requests]
        finish: list[str | None] = [None] * rows
        matched: list[str | int | None] = [None] * rows
        texts: list[str | None] = [None] * rows
        for i, b in enumerate(budget):
            if b <= 0:
                finish[i] = "length"

        position = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=position, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1, :].float()
        next_pos = position[:, -1:] + 1
        for _step in range(max(budget)):
            if all(f is not None for f in finish):
                break
            logprobs = torch.log_softmax(logits, dim=-1)
            tokens = self._sample(logits, temps, top_p, greedy, gens)
            chosen_lp = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
            is_stop = torch.isin(tokens, stop_ids)
            for i, req in enumerate(requests):
                if finish[i] is not None:
                    continue
                out_ids[i].append(int(tokens[i]))
                out_lp[i].append(float(chosen_lp[i]))
                if bool(is_stop[i]):
                    finish[i], matched[i] = "stop", int(tokens[i])
                elif req.stop and self._check_stop(i, req, out_ids, texts, matched):
                    finish[i] = "stop"
                elif len(out_ids[i]) >= budget[i]:
                    finish[i] = "length"
            if all(f is not None for f in finish):
                break
            mask = torch.cat([mask, torch.ones((rows, 1), dtype=torch.long)], dim=1)
            out = self.model(
                input_ids=tokens.unsqueeze(1), attention_mask=mask, position_ids=next_pos,
                past_key_values=cache, use_cache=True,
            )
            cache, logits = out.past_key_values, out.logits[:, -1, :].float()
            next_pos = next_pos + 1

        results = []
        for i in range(rows):
            text = texts[i] if texts[i] is not None else self.tokenizer.decode(out_ids[i], skip_special_tokens=True)
            results.append(GenResult(out_ids[i], out_lp[i], text, finish[i] or "length", matched[i], self.weight_version))
        return results

    def _check_stop(self, i: int, req: GenRequest, out_ids: list[list[int]], texts: list[str | None],
                    matched: list[str | int | None]) -> bool:
        text = self.tokenizer.decode(out_ids[i], skip_special_tokens=True)
        cut = [(text.find(s), s) for s in req.stop if s in text]
        if not cut:
            return False
        pos, stop = min(cut)
        texts[i], matched[i] = text[:pos], stop
        return True

    @staticmethod
    def _sample(logits: torch.Tensor, temps: torch.Tensor, top_p: torch.Tensor, greedy: torch.Tensor,
                gens: list[torch.Generator]) -> torch.Tensor:
        probs = torch.softmax(logits / temps, dim=-1)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        sorted_p = sorted_p.masked_fill(cum - sorted_p > top_p, 0.0)
        cum = sorted_p.cumsum(-1)
        u = torch.stack([torch.rand((), generator=g) for g in gens]).unsqueeze(1) * cum[:, -1:]
        pick = torch.searchsorted(cum, u).clamp(max=cum.shape[1] - 1)
        tokens = order.gather(1, pick).squeeze(1)
        return torch.where(greedy, logits.argmax(-1), tokens)


class BatchingEngine:
    """Runs a PolicyEngine on one worker thread; concurrent submissions share a batch."""

    def __init__(self, engine: PolicyEngine, *, max_batch_rows: int = 64, batch_wait_s: float = 0.005) -> None:
        self.engine = engine
        self.max_batch_rows = max_batch_rows
        self.batch_wait_s = batch_wait_s  # after an idle spell, wait this long for concurrent arrivals to join
        self.batches = 0
        self.rows = 0
        self.busy_s = 0.0  # seconds spent generating (what the RL loop's busy share is made of)
        self.update_s = 0.0  # seconds spent loading pushed weights (generation waits meanwhile)
        self._queue: queue.Queue[tuple[str, Any, asyncio.Future, asyncio.AbstractEventLoop] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="policy-engine", daemon=True)
        self._thread.start()

    async def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        return await self._submit("generate", requests)

    async def update_weights(self, model_path: str, weight_version: int) -> None:
        """Queued behind work already submitted: in-flight batches finish on the old weights."""
        await self._submit("update", (model_path, weight_version))

    async def _submit(self, kind: str, payload: Any) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._queue.put((kind, payload, future, loop))
        return await future

    def close(self, timeout: float = 30) -> None:
        self._queue.put(None)
        self._thread.join(timeout=timeout)

    def _run(self) -> None:
        pending: list[tuple[str, Any, asyncio.Future, asyncio.AbstractEventLoop]] = []
        while True:
            first = pending.pop(0) if pending else self._queue.get()
            if first is None:
                return
            kind, payload, future, loop = first
            if kind == "update":
                self._finish(loop, future, lambda payload=payload: self._timed_load(payload))
                continue
            batch = [first]
            rows = len(payload)
            deadline = time.monotonic() + self.batch_wait_s
            while rows < self.max_batch_rows:
                try:
                    item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if item is None or item[0] != "generate" or rows + len(item[1]) > self.max_batch_rows:
                    pending.append(item)  # keeps order: an update waits until this batch is done
                    break
                batch.append(item)
                rows += len(item[1])
            flat = [req for job in batch for req in job[1]]
            self.batches += 1
            self.rows += len(flat)
            began = time.perf_counter()
            try:
                results = self.engine.generate_batch(flat)
            except Exception as error:  # noqa: BLE001 - handed to every waiting request
                logger.exception("batch of %d rows failed", len(flat))
                for _, _, fut, lp in batch:
                    lp.call_soon_threadsafe(_set_exception, fut, error)
                continue
            finally:
                self.busy_s += time.perf_counter() - began
            start = 0
            for _, reqs, fut, lp in batch:
                lp.call_soon_threadsafe(_set_result, fut, results[start : start + len(reqs)])
                start += len(reqs)

    def _timed_load(self, payload: Any) -> Any:
        began = time.perf_counter()
        try:
            return self.engine.load(*payload)
        finally:
            self.update_s += time.perf_counter() - began

    @staticmethod
    def _finish(loop: asyncio.AbstractEventLoop, future: asyncio.Future, work: Any) -> None:
        try:
            value = work()
        except Exception as error:  # noqa: BLE001
            loop.call_soon_threadsafe(_set_exception, future, error)
        else:
            loop.call_soon_threadsafe(_set_result, future, value)


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
