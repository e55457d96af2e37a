"""The benchmark's arithmetic environment written against atroposlib 0.4.0 (runs ONLY in the separate Atropos venv).

Same prompts, same answer tag and the same one-chat-call-with-n-choices per
group as the factory's InternBootcamp `arithmetic` family at difficulty 1.

    $ATROPOS_PY bench/datagen/atropos_arith_env.py process --env.total_steps 200 --env.group_size 8 ...
"""

import random
import re

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

    async def get_next_item(self):
        a, b = self.rng.randint(10, 99), self.rng.randint(10, 99)
        return ({"role": "user", "content": f"Compute {a}+{b}. Put the answer in <answer></answer>."}, a + b)

    async def collect_trajectories(self, item):
        message, answer = item
        completion = await self.server.chat_completion(messages=[message], n=self.config.group_size, max_tokens=16)
        group = ScoredDataGroup(tokens=[], masks=[], scores=[], messages=[])
        for choice in completion.choices:
            conversation = [message, {"role": "assistant", "content": choice.message.content}]
            found = ANSWER.findall(choice.message.content)
            tokens, masks = self._tokenize(conversation)
            group["tokens"].append(tokens)
            group["masks"].append(masks)
            group["scores"].append(1.0 if found and found[-1].strip() == str(answer) else -0.5)
            group["messages"].append(conversation)
        return group, []

    def _tokenize(self, conversation):
        # atroposlib 0.4.0's tokenize_for_trainer breaks on transformers 5 (apply_chat_template returns a
        # BatchEncoding); the same work by hand: template, encode, mask the prompt.
        prompt = self.tokenizer.encode(self.tokenizer.apply_chat_template(conversation[:1], tokenize=False,
                                                                          add_generation_prompt=True))
        full = self.tokenizer.encode(self.tokenizer.apply_chat_template(conversation, tokenize=False))
        return full, [-100] * len(prompt) + full[len(prompt):]

    async def score(self, rollout_group_data):
        return rollout_group_data

    async def evaluate(self, *args, **kwargs):
        return None


if __name__ == "__main__":
    ArithEnv.cli()
