"""Make small Qwen2-style policies offline: a BPE tokenizer trained with `tokenizers`, a chat template, a random model.

Used by scripts/build_starter_policy.py (which then warm-starts the model) and by
tests that need a real model directory in a second.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# Qwen-style ChatML; the generation prompt opens an assistant turn. `{% generation %}` marks what the assistant
# writes (its content and <|im_end|>), so `return_assistant_tokens_mask` / TRL's assistant-only loss accept it;
# the rendered text is the same as without the markers.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer(texts: Iterable[str], vocab_size: int = 320):
    """Train a byte-level BPE on `texts` and wrap it as a transformers fast tokenizer with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    # Digits one by one (as Qwen2 does): numbers keep a regular structure a tiny model can learn arithmetic on.
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, bos_token=None, unk_token=None
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def init_model(tokenizer, *, hidden: int = 128, layers: int = 4, heads: int = 4, kv_heads: int = 2,
               intermediate: int = 384, max_positions: int = 512, seed: int = 0):
    """A randomly initialised Qwen2ForCausalLM sized for `tokenizer`."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    return model


def make_tiny_policy(path: str | Path, *, seed: int = 0, texts: Iterable[str] | None = None) -> Path:
    """Write a random ~0.3M-parameter policy with its tokenizer to `path` (for tests); returns the path."""
    path = Path(path)
    corpus = list(texts) if texts is not None else [
        f"What is {a} + {b}? The answer is {a + b}." for a in range(30) for b in range(0, 30, 7)
    ]
    tokenizer = build_tokenizer(corpus, vocab_size=300)
    model = init_model(tokenizer, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, seed=seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
