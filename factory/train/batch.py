"""A `/batch` (a list of Atropos ScoredData groups) -> trainable sequences -> padded micro-batch tensors.

Tokens are never re-tokenized. For a sequence of length L the model reads
tokens[:-1] and is scored on tokens[1:]; position t is trained exactly when
masks[t+1] != -100, its behaviour logprob is inference_logprobs[t+1] and its
advantage advantages[t+1]. A sequence without `inference_logprobs` uses the
current policy's logprob (ratio 1, on-policy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from environments.groups import MASK_IGNORE
from factory.train.advantages import token_advantages

NAN = float("nan")


@dataclass
class TrainSequence:
    """One sequence of a step, already shifted: inputs[t] predicts targets[t]."""

    inputs: list[int]
    targets: list[int]
    trained: list[bool]
    advantages: list[float]
    behaviour_logp: list[float]  # NaN where the data carried none
    ref_logp: list[float] | None
    score: float

    @property
    def trained_tokens(self) -> int:
        return sum(self.trained)


@dataclass
class StepBatch:
    """The sequences of one optimizer step and what the metrics need about their groups."""

    sequences: list[TrainSequence]
    scores: list[float]
    groups: int
    zero_advantage_groups: int
    policy_versions: list[int]


def to_sequences(groups: list[dict[str, Any]], *, scale_rewards: bool = False, std_eps: float = 1e-6) -> StepBatch:
    """Every sequence of every group, with its advantages; counts groups whose advantages are all zero."""
    sequences: list[TrainSequence] = []
    scores: list[float] = []
    zero_groups = 0
    versions: list[int] = []
    for group in groups:
        advantages = token_advantages(group, scale=scale_rewards, eps=std_eps)
        inference = group.get("inference_logprobs")
        reference = group.get("ref_logprobs")
        if "policy_version" in group and group["policy_version"] is not None:
            versions.append(int(group["policy_version"]))
        any_signal = False
        for i, tokens in enumerate(group["tokens"]):
            masks = group["masks"][i]
            if len(tokens) < 2:
                continue
            trained = [m != MASK_IGNORE for m in masks[1:]]
            adv = advantages[i][1:]
            any_signal = any_signal or any(a != 0.0 and t for a, t in zip(adv, trained))
            behaviour = [float(x) for x in inference[i][1:]] if inference is not None else [NAN] * (len(tokens) - 1)
            ref = [float(x) for x in reference[i][1:]] if reference is not None else None
            sequences.append(TrainSequence(list(tokens[:-1]), list(tokens[1:]), trained, adv, behaviour, ref,
                                           float(group["scores"][i])))
            scores.append(float(group["scores"][i]))
        zero_groups += not any_signal
    return StepBatch(sequences, scores, len(groups), zero_groups, versions)


def token_weights(sequences: list[TrainSequence], aggregation: Literal["token_mean", "sequence_mean"]) -> list[float]:
    """Per sequence, the weight each of its trained tokens gets so the step's loss is the chosen mean."""
    if aggregation == "token_mean":
        total = sum(s.trained_tokens for s in sequences)
        return [1.0 / total if total else 0.0 for _ in sequences]
    counted = [s for s in sequences if s.trained_tokens]
    return [1.0 / (len(counted) * s.trained_tokens) if s.trained_tokens else 0.0 for s in sequences]


@dataclass
class MicroBatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    behaviour_logp: torch.Tensor  # NaN where missing: replaced by the current logprob
    ref_logp: torch.Tensor | None
    weights: torch.Tensor

    def to(self, device: torch.device) -> MicroBatch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)
        return MicroBatch(*(move(getattr(self, f)) for f in self.__dataclass_fields__))  # type: ignore[arg-type]


def collate(sequences: list[TrainSequence], weights: list[float], pad_id: int = 0) -> MicroBatch:
    """Right-pad a list of sequences into tensors [B, T]."""
    rows, width = len(sequences), max(len(s.inputs) for s in sequences)
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    attention = torch.zeros((rows, width), dtype=torch.long)
    targets = torch.zeros((rows, width), dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.bool)
    adv = torch.zeros((rows, width))
    behaviour = torch.zeros((rows, width))
    has_ref = all(s.ref_logp is not None for s in sequences)
    ref = torch.zeros((rows, width)) if has_ref else None
    w = torch.zeros((rows, width))
    for i, (s, weight) in enumerate(zip(sequences, weights)):
        n = len(s.inputs)
        ids[i, :n] = torch.tensor(s.inputs)
        attention[i, :n] = 1
        targets[i, :n] = torch.tensor(s.targets)
        mask[i, :n] = torch.tensor(s.trained)
        adv[i, :n] = torch.tensor(s.advantages)
        behaviour[i, :n] = torch.tensor(s.behaviour_logp)
        if ref is not None:
            ref[i, :n] = torch.tensor(s.ref_logp)
        w[i, :n] = torch.where(mask[i, :n], weight, 0.0)
    return MicroBatch(ids, attention, targets, mask, adv, behaviour, ref, w)


def micro_batches(sequences: list[TrainSequence], size: int, aggregation: Literal["token_mean", "sequence_mean"],
                  pad_id: int = 0, weights: list[float] | None = None) -> list[MicroBatch]:
    """The step's sequences cut into micro-batches (longest first, less padding), weights over the whole step.

    `weights` (one per sequence) overrides the weights computed from `sequences`: a rank of the distributed
    trainer passes its share of the weights computed over the whole step's batch.
    """
    weights = token_weights(sequences, aggregation) if weights is None else weights
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i].inputs))
    out = []
    for start in range(0, len(order), size):
        idx = order[start : start + size]
        out.append(collate([sequences[i] for i in idx], [weights[i] for i in idx], pad_id))
    return out
