"""The inference tier: clients over SGLang/OpenAI-compatible endpoints and a local CPU policy server."""

from factory.inference.types import Completion, SamplingParams

__all__ = ["Completion", "SamplingParams"]
