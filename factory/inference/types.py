"""What environments ask the inference tier for (SamplingParams) and what they get back (Completion)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import Field, model_validator

from factory.config import FactoryConfig


class SamplingParams(FactoryConfig):
    """How to sample one completion; the same fields mean the same thing on every backend."""

    temperature: float = Field(1.0, ge=0.0, description="Softmax temperature; 0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass kept.")
    max_tokens: int = Field(256, ge=1, description="Most new tokens per completion.")
    stop: list[str] | None = Field(None, description="Strings that end a completion (not included in the text).")
    seed: int | None = Field(None, description="Sampling seed, where the backend honours one.")

    @model_validator(mode="after")
    def _stop_not_empty(self) -> SamplingParams:
        if self.stop is not None and any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty; drop the empty string from 'stop'")
        return self

    def openai_fields(self) -> dict[str, Any]:
        """Keys for an OpenAI-compatible request body."""
        body: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens}
        if self.stop:
            body["stop"] = self.stop
        if self.seed is not None:
            body["seed"] = self.seed
        return body

    def sglang_fields(self) -> dict[str, Any]:
        """Keys for SGLang's native `sampling_params`."""
        params: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_new_tokens": self.max_tokens,
        }
        if self.stop:
            params["stop"] = self.stop
        if self.seed is not None:
            params["sampling_seed"] = self.seed
        return params


FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True, init=False)
class Completion:
    """One sampled completion, with the tokens and logprobs the server produced and the policy that made it."""

    text: str
    prompt_token_ids: list[int] | None
    output_token_ids: list[int] | None
    output_logprobs: list[float] | None  # one per output token, log p under the unscaled model distribution
    finish_reason: str  # "stop" | "length" | "abort"
    policy_version: int
    endpoint: str

    def __init__(self, text: str, prompt_token_ids: list[int] | None, output_token_ids: list[int] | None,
                 output_logprobs: list[float] | None, finish_reason: str, policy_version: int, endpoint: str) -> None:
        # The frozen dataclass's generated __init__ sets each field through object.__setattr__ (1.5 us a call; a
        # datagen worker makes 8 a group): written into the instance's dict instead (0.3 us), still frozen after.
        # tests/unit/inference/test_types_and_config.py checks that these are all of the fields, in order.
        fields = self.__dict__
        fields["text"] = text
        fields["prompt_token_ids"] = prompt_token_ids
        fields["output_token_ids"] = output_token_ids
        fields["output_logprobs"] = output_logprobs
        fields["finish_reason"] = finish_reason
        fields["policy_version"] = policy_version
        fields["endpoint"] = endpoint

