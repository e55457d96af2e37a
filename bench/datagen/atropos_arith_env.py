"""The benchmark's arithmetic environment written against atroposlib 0.4.0 (runs ONLY in the separate Atropos venv).

Same prompts, same answer tag and the same one-chat-call-with-n-choices per
group as the factory's InternBootcamp `arithmetic` family at difficulty 1, and
the same tokenization work as the factory's sampler: the prompt through the
chat template once per group, each answer encoded once (plus EOS when it
stopped). Run as Atropos's docs show for offline data generation:

    $ATROPOS_PY bench/datagen/atropos_arith_env.py process --env.total_steps 200 --env.group_size 8 \
        --env.data_path_to_save_groups out.jsonl --openai.base_url ... --openai.model_name m

With BENCH_TIMING=<path> it writes {"loop_start", "loop_end", "report_end"}
(epoch seconds): the process loop runs from setup() to the JSONL's close;
the HTML report atroposlib renders after it (jsonl2html) is timed apart.
"""

import json
import os
import random
import re
import time

import atroposlib.envs.base as atropos_base

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup

ANSWER = re.compile(r"<answer>(.*?)</answer>")


class ArithEnv(BaseEnv):
    name = "arith"

    @classmethod
    def config_init(cls):
        return BaseEnvConfig(group_size=8, use_wandb=False, max_token_length=64, tokenizer_name="gpt2"), [
            APIServerConfig(model_name="m", base_url="http://127.0.0.1:31500/v1", api_key="x")]

    async def setup(self):
        self.rng = random.Random(0)
        TIMES["loop_start"] = time.time()

    async def get_next_item(self):
        a, b = self.rng.randint(10, 99), self.rng.randint(10, 99)
        return ({"role": "user", "content": f"Compute {a}+{b}. Put the answer in <answer></answer>."}, a + b)

    async def collect_trajectories(self, item):
        message, answer = item
        completion = await self.server.chat_completion(messages=[message], n=self.config.group_size, max_tokens=16)
        group = ScoredDataGroup(tokens=[], masks=[], scores=[], messages=[])
        # atroposlib 0.4.0's tokenize_for_trainer breaks on transformers 5 (apply_chat_template returns a
        # BatchEncoding) and templates the whole conversation per answer; the factory's work, by hand instead.
        prompt = self.tokenizer.encode(self.tokenizer.apply_chat_template([message], tokenize=False,
                                                                          add_generation_prompt=True),
                                       add_special_tokens=False)
        for choice in completion.choices:
            content = choice.message.content
            output = self.tokenizer.encode(content, add_special_tokens=False)
            if choice.finish_reason == "stop" and self.tokenizer.eos_token_id is not None:
                output.append(self.tokenizer.eos_token_id)
            found = ANSWER.findall(content)
            group["tokens"].append(prompt + output)
            group["masks"].append([-100] * len(prompt) + output)
            group["scores"].append(1.0 if found and found[-1].strip() == str(answer) else -0.5)
            group["messages"].append([message, {"role": "assistant", "content": content}])
        return group, []

    async def score(self, rollout_group_data):
        return rollout_group_data

    async def evaluate(self, *args, **kwargs):
        return None


TIMES = {}
_render_report = atropos_base.generate_html


def _timed_report(path, *args, **kwargs):
    """atroposlib's process mode renders an HTML report after the last group: time it apart from the loop."""
    TIMES["loop_end"] = time.time()
    _render_report(path, *args, **kwargs)
    TIMES["report_end"] = time.time()
    if os.environ.get("BENCH_TIMING"):
        with open(os.environ["BENCH_TIMING"], "w") as out:
            json.dump(TIMES, out)


atropos_base.generate_html = _timed_report

if __name__ == "__main__":
    ArithEnv.cli()
