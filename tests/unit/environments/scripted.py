"""Test helpers for multi-turn envs: the starter policy's tokenizer and a scripted token-in/token-out sampler."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from factory.inference.types import Completion

STARTER = Path(__file__).resolve().parents[3] / "models" / "starter-policy"


class ScriptedSampler:
    """Answers with scripted replies, token in / token out like /generate (EOS closes a reply, as the server does)."""

    def __init__(self, tokenizer: Any, replies: list[str], *, close: bool = True, truncate: bool = False) -> None:
        self.tokenizer, self.replies, self.close, self.truncate = tokenizer, list(replies), close, truncate
        """`truncate`: cut a reply at `sampling.max_tokens` (finish_reason "length"), as a server does."""
        self.seen_prompts: list[list[int]] = []

    async def complete(self, messages, *, n, sampling, prompt_ids=None):
        from tasks.generate import prompt_ids as template_ids

        ids = list(prompt_ids) if prompt_ids is not None else template_ids(self.tokenizer, messages)
        self.seen_prompts.append(ids)
        out = []
        for _ in range(n):
            text = self.replies.pop(0)
            output = list(self.tokenizer.encode(text, add_special_tokens=False))
            if self.close:
                output.append(self.tokenizer.eos_token_id)
            finish = "stop" if self.close else "length"
            if self.truncate and len(output) > sampling.max_tokens:
                output, finish = output[: sampling.max_tokens], "length"
                text = self.tokenizer.decode(output, skip_special_tokens=True)
            out.append(Completion(text, ids, output, [-0.5] * len(output), finish, 3, "fake"))
        return out
