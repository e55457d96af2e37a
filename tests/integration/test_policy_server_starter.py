"""The shipped starter policy, served by the local server: answers are partly right, so GRPO groups have variance."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from environments.bootcamp_tasks import FAMILIES
from factory.inference.client import InferenceClient, InferenceConfig
from factory.inference.local_server import start_local_server
from factory.inference.types import SamplingParams

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
STARTER = REPO / "models" / "starter-policy"


def _ids(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def test_starter_policy_groups_at_temperature_1_are_partly_correct() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(STARTER)
    rng = random.Random(123)
    names = sorted(FAMILIES)
    cases = [FAMILIES[names[i % len(names)]].generate(rng, 1) for i in range(28)]
    sampling = SamplingParams(temperature=1.0, max_tokens=24)

    async def sample(base_url: str):
        async with InferenceClient(InferenceConfig(base_url=base_url)) as client:
            return await asyncio.gather(*(client.generate(_ids(tokenizer, c.prompt), n=8, sampling=sampling)
                                          for c in cases))

    with start_local_server(STARTER) as server:
        groups = asyncio.run(sample(server.base_url))
    scores = [[FAMILIES[c.family].verify_score(c, r.text) >= 1.0 for r in group] for c, group in zip(cases, groups)]
    accuracy = sum(map(sum, scores)) / (8 * len(cases))
    mixed = sum(0 < sum(s) < 8 for s in scores)
    assert 0.1 <= accuracy <= 0.8, f"starter policy accuracy {accuracy:.0%} at temperature 1"
    assert mixed >= len(cases) // 4, f"only {mixed} of {len(cases)} groups have both right and wrong answers"
    formatted = sum("<answer>" in r.text for group in groups for r in group) / (8 * len(cases))
    assert formatted > 0.8, f"only {formatted:.0%} of answers use the <answer> format"


def test_build_script_runs_offline_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "policy"
    subprocess.run([sys.executable, str(REPO / "scripts" / "build_starter_policy.py"), "--out", str(out),
                    "--steps", "3", "--hidden", "32", "--layers", "1", "--eval-per-family", "2",
                    "--corpus-cases", "500"], check=True, timeout=300, capture_output=True,
                   env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    report = json.loads((out / "eval.json").read_text())
    assert set(report["accuracy"]) == set(FAMILIES) and report["sft_steps"] == 3
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert "held-out" in (out / "README.md").read_text()
