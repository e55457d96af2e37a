"""The GRPO token loss: clipped policy-gradient surrogate against the behaviour (inference) logprobs.

Per trained token t with advantage A, current logprob lp, behaviour logprob
lp_inf (the `inference_logprobs` the data carries) and ratio r = exp(lp - lp_inf):

    pg   = min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)      (PPO surrogate, clip-higher)
    pg   = max(pg, is_cap * A)   where A < 0                         (truncated importance weight)
    kl   = exp(lp_ref - lp) - (lp_ref - lp) - 1                      (k3 estimator, when kl_coef > 0)
    loss = -pg + kl_coef * kl - entropy_coef * entropy

For A > 0 the clip already stops the ratio from counting past 1 + clip_high;
for A < 0 a stale or mismatched sample can have r >> 1, and the cap keeps its
weight at most `is_cap` (zero gradient beyond it). Tokens are then summed with
weights that implement the aggregation exactly across micro-batches:
token_mean gives each trained token of the step 1/N_tokens, sequence_mean
gives each token 1/(N_sequences * its sequence's trained tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from factory.train.config import LossConfig


@dataclass
class TokenLoss:
    """The weighted loss of a micro-batch and the per-token sums the step's metrics are built from."""

    loss: torch.Tensor
    sums: dict[str, float]


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of each target, entropy of each position's distribution), both [B, T], in float32."""
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return chosen, entropy


def grpo_token_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    *,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> TokenLoss:
    """Weighted sum of the per-token loss over `mask`; all tensors [B, T], `weights` zero off the mask."""
    mask = mask.bool()
    log_ratio = (logp - behaviour_logp).masked_fill(~mask, 0.0)
    ratio = torch.exp(log_ratio.clamp(max=20.0))
    low, high = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
    unclipped = ratio * advantages
    clipped = ratio.clamp(low, high) * advantages
    pg = torch.minimum(unclipped, clipped)
    capped = torch.where(advantages < 0, torch.maximum(pg, cfg.is_cap * advantages), pg)
    per_token = -capped
    kl = None
    if ref_logp is not None and cfg.kl_coef > 0:
        delta = (ref_logp - logp).masked_fill(~mask, 0.0)
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + cfg.kl_coef * kl
    if entropy is not None and cfg.entropy_coef > 0:
        per_token = per_token - cfg.entropy_coef * entropy
    loss = (per_token * weights).masked_fill(~mask, 0.0).sum()

    with torch.no_grad():
        m = mask
        r = ratio[m]
        clip_active = (clipped[m] < unclipped[m]) if r.numel() else r.bool()
        sums = {
            "tokens": float(m.sum()),
            "clipped": float(clip_active.sum()),
            "capped": float(((advantages[m] < 0) & (capped[m] > pg[m])).sum()) if r.numel() else 0.0,
            "ratio_sum": float(r.sum()),
            "ratio_min": float(r.min()) if r.numel() else float("inf"),
            "ratio_max": float(r.max()) if r.numel() else float("-inf"),
            "logprob_diff_abs_sum": float((logp[m] - behaviour_logp[m]).abs().sum()),
            "kl_sum": float(kl[m].sum()) if kl is not None else 0.0,
            "entropy_sum": float(entropy[m].sum()) if entropy is not None else 0.0,
            "loss": float(loss.detach()),
        }
    return TokenLoss(loss, sums)
