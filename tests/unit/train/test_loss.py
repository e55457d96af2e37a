"""The GRPO token loss against hand-computed numbers: ratios, clipping, the importance cap, masks, aggregations."""

from __future__ import annotations

import math

import pytest
import torch

from factory.train.batch import TrainSequence, micro_batches, to_sequences, token_weights
from factory.train.config import LossConfig
from factory.train.loss import grpo_token_loss

CFG = LossConfig(clip_low=0.2, clip_high=0.2, is_cap=2.0)


def _loss(logp, behaviour, adv, mask, weights, cfg=CFG, **kw):
    t = lambda x: torch.tensor([x], dtype=torch.float32)  # noqa: E731
    return grpo_token_loss(t(logp), t(behaviour), t(adv), t(weights), torch.tensor([mask]), cfg, **kw)


def test_ratio_clip_cap_and_mask_by_hand():
    # ratios: e^0=1, e^0.5=1.6487 (A>0: clipped to 1.2), e^-0.5=0.6065 (A<0: clipped to 0.8 -> min picks 0.8*A?),
    # e^1.5=4.4817 (A<0: PPO keeps r*A=-4.48, cap makes it 2*A=-2), last token masked out.
    logp = [0.0, 0.5, -0.5, 1.5, 3.0]
    behaviour = [0.0, 0.0, 0.0, 0.0, 0.0]
    adv = [1.0, 1.0, -1.0, -1.0, 5.0]
    mask = [True, True, True, True, False]
    w = [0.25, 0.25, 0.25, 0.25, 0.0]
    out = _loss(logp, behaviour, adv, mask, w)
    r = [1.0, math.exp(0.5), math.exp(-0.5), math.exp(1.5)]
    pg = [
        min(r[0] * 1, 1.0 * 1),                 # 1
        min(r[1] * 1, 1.2 * 1),                 # 1.2 (clipped)
        min(r[2] * -1, 0.8 * -1),               # -0.8 (clipped: 0.8*-1 < 0.6065*-1)
        max(min(r[3] * -1, 1.2 * -1), 2 * -1),  # -2 (capped)
    ]
    expected = -sum(pg) / 4
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    assert out.sums["tokens"] == 4
    assert out.sums["clipped"] == 2          # tokens 1 and 2 took the clipped branch
    assert out.sums["capped"] == 1           # token 3 hit the importance cap
    assert out.sums["ratio_max"] == pytest.approx(r[3], rel=1e-6)
    assert out.sums["ratio_min"] == pytest.approx(r[2], rel=1e-6)


def test_gradients_vanish_where_clipped_or_capped():
    logp = torch.tensor([[0.0, 0.5, 1.5, 0.1]], requires_grad=True)
    behaviour = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, 1.0, -1.0, 2.0]])
    mask = torch.tensor([[True, True, True, False]])
    w = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    grpo_token_loss(logp, behaviour, adv, w, mask, CFG).loss.backward()
    # d(-r*A)/dlogp = -r*A for the unclipped token; zero for the clipped, the capped and the masked ones
    assert logp.grad.tolist()[0] == pytest.approx([-1.0, 0.0, 0.0, 0.0])


def test_kl_and_entropy_terms():
    cfg = LossConfig(kl_coef=0.5, entropy_coef=0.1)
    out = _loss([-1.0], [-1.0], [0.0], [True], [1.0], cfg=cfg, ref_logp=torch.tensor([[-2.0]]),
                entropy=torch.tensor([[0.7]]))
    kl = math.exp(-1.0) - (-1.0) - 1.0
    assert out.loss.item() == pytest.approx(0.5 * kl - 0.1 * 0.7, rel=1e-6)
    assert out.sums["kl_sum"] == pytest.approx(kl, rel=1e-6)


def _group(tokens, masks, scores, **extra):
    return {"tokens": tokens, "masks": masks, "scores": scores, **extra}


def test_shift_and_masks_are_exact():
    group = _group([[5, 6, 7, 8], [5, 6, 9]], [[-100, -100, 7, 8], [-100, -100, 9]], [1.0, 0.0],
                   inference_logprobs=[[1.0, 1.0, -0.1, -0.2], [1.0, 1.0, -0.3]])
    batch = to_sequences([group])
    a, b = batch.sequences
    assert a.inputs == [5, 6, 7] and a.targets == [6, 7, 8] and a.trained == [False, True, True]
    assert a.behaviour_logp == [1.0, -0.1, -0.2]
    assert a.advantages == [0.5, 0.5, 0.5] and b.advantages == [-0.5, -0.5]
    assert b.trained == [False, True]


def test_aggregations_weight_tokens_and_sequences():
    seqs = [TrainSequence([0] * 4, [0] * 4, [True] * 3 + [False], [1.0] * 4, [0.0] * 4, None, 1.0),
            TrainSequence([0] * 2, [0] * 2, [True, False], [1.0] * 2, [0.0] * 2, None, 1.0)]
    assert token_weights(seqs, "token_mean") == [0.25, 0.25]           # 4 trained tokens in the step
    assert token_weights(seqs, "sequence_mean") == [1 / 6, 1 / 2]      # 1/(2 sequences * 3) and 1/(2 * 1)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_micro_batching_does_not_change_the_loss(aggregation):
    # per-token loss = -A when ratio is 1: token_mean = -(3*1 + 1*(-0.5))/4, sequence_mean = -(1 + (-0.5))/2
    seqs = [TrainSequence([1, 2, 3], [2, 3, 4], [True] * 3, [1.0] * 3, [0.0] * 3, None, 1.0),
            TrainSequence([1, 2], [2, 3], [False, True], [-0.5] * 2, [0.0] * 2, None, 0.0)]
    expected = {"token_mean": -(3 - 0.5) / 4, "sequence_mean": -(1 - 0.5) / 2}[aggregation]
    for size in (1, 2):
        total = 0.0
        for mb in micro_batches(seqs, size, aggregation):
            logp = torch.zeros_like(mb.advantages)
            total += grpo_token_loss(logp, mb.behaviour_logp, mb.advantages, mb.weights, mb.mask, CFG).loss.item()
        assert total == pytest.approx(expected, abs=1e-6)
