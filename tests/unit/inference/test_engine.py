"""The sampling engine: logprobs equal a teacher-forced forward pass, per-row settings are honoured."""

from __future__ import annotations

import torch

from factory.inference.engine import GenRequest, PolicyEngine


def _forward_logprobs(engine: PolicyEngine, prompt: list[int], output: list[int]) -> list[float]:
    with torch.inference_mode():
        logits = engine.model(torch.tensor([prompt + output])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[len(prompt) - 1 + k, token].item() for k, token in enumerate(output)]


def test_batched_logprobs_match_a_forward_pass_of_the_same_tokens(engine: PolicyEngine) -> None:
    # Prompts of different lengths share one left-padded batch; temperature and top_p differ per row.
    requests = [
        GenRequest([5, 6, 7, 8, 9, 10, 11], max_new_tokens=12, temperature=1.0, seed=1),
        GenRequest([40, 41], max_new_tokens=12, temperature=0.7, top_p=0.9, seed=2),
        GenRequest([100, 3, 200, 4], max_new_tokens=12, temperature=1.3, seed=3),
    ]
    results = engine.generate_batch(requests)
    for request, result in zip(requests, results):
        assert len(result.logprobs) == len(result.output_ids) > 0
        expected = _forward_logprobs(engine, request.input_ids, result.output_ids)
        assert max(abs(a - b) for a, b in zip(expected, result.logprobs)) < 1e-4


def test_seed_makes_sampling_reproducible_and_greedy_is_argmax(engine: PolicyEngine) -> None:
    first = engine.generate_batch([GenRequest([5, 6, 7], max_new_tokens=10, seed=11)])[0]
    again = engine.generate_batch([GenRequest([9, 9], max_new_tokens=3), GenRequest([5, 6, 7], max_new_tokens=10, seed=11)])[1]
    assert first.output_ids == again.output_ids
    greedy = engine.generate_batch([GenRequest([5, 6, 7], max_new_tokens=6, temperature=0)])[0]
    prompt = [5, 6, 7]
    for token in greedy.output_ids:
        with torch.inference_mode():
            assert int(engine.model(torch.tensor([prompt])).logits[0, -1].argmax()) == token
        prompt.append(token)


def test_max_tokens_gives_length_and_stop_strings_cut_the_text(engine: PolicyEngine) -> None:
    result = engine.generate_batch([GenRequest([5, 6, 7], max_new_tokens=5, seed=0)])[0]
    if result.finish_reason == "length":
        assert len(result.output_ids) == 5
    # Use a character the unconstrained sample produced as a stop string: the text must end before it.
    long = engine.generate_batch([GenRequest([5, 6, 7], max_new_tokens=20, seed=4)])[0]
    visible = [ch for ch in long.text if ch.isalnum()]
    if visible:
        stop = visible[len(visible) // 2]
        cut = engine.generate_batch([GenRequest([5, 6, 7], max_new_tokens=20, seed=4, stop=[stop])])[0]
        assert cut.finish_reason == "stop" and cut.matched_stop == stop
        assert stop not in cut.text and long.text.startswith(cut.text)


def test_top_p_keeps_only_the_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]]))
    gens = [torch.Generator().manual_seed(s) for s in range(1)]
    seen = set()
    for seed in range(200):
        gens = [torch.Generator().manual_seed(seed)]
        token = PolicyEngine._sample(logits, torch.ones(1, 1), torch.tensor([[0.8]]), torch.tensor([False]), gens)
        seen.add(int(token))
    assert seen == {0, 1}
