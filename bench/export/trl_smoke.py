"""Train 2 steps of TRL's SFTTrainer / DPOTrainer on every export layout (tiny random Llama, CPU).

TRL is not a dependency: run this in a throwaway venv that has it, e.g.

    python -m venv --system-site-packages /tmp/trlvenv && /tmp/trlvenv/bin/pip install trl
    python notebooks/make_demo_store.py --store /tmp/demo-store
    /tmp/trlvenv/bin/python bench/export/trl_smoke.py /tmp/demo-store
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")


def main(store: str) -> None:
    import datasets
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    from factory.export import (DpoExportConfig, DpoSelectionConfig, OutputConfig, SelectionConfig, SftExportConfig,
                                SourceConfig, export_dpo, export_sft)
    from tests.unit.export.conftest import build_tiny_tokenizer

    work = Path(tempfile.mkdtemp(prefix="trl-smoke-"))
    tokenizer_dir = build_tiny_tokenizer(work / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.pad_token = tokenizer.eos_token
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
    model.save_pretrained(work / "model")
    tokenizer.save_pretrained(work / "model")
    source, text = SourceConfig(store=store), {"style": "text", "tokenizer": str(tokenizer_dir)}
    layouts = {
        "sft messages": (export_sft, SftExportConfig, {}),
        "sft prompt/completion": (export_sft, SftExportConfig, {"prompt_completion": True}),
        "sft text": (export_sft, SftExportConfig, text),
        "dpo messages": (export_dpo, DpoExportConfig, {}),
        "dpo text": (export_dpo, DpoExportConfig, text),
    }
    for name, (export, config_type, output) in layouts.items():
        path = work / name.replace(" ", "_").replace("/", "_")
        select = SelectionConfig(limit=16) if config_type is SftExportConfig else DpoSelectionConfig(limit=16)
        export(config_type(source=source, select=select, output=OutputConfig(path=str(path), **output)))
        dataset = datasets.load_dataset("parquet", data_dir=str(path), split="train")
        args = dict(output_dir=str(work / "out"), max_steps=2, per_device_train_batch_size=4, report_to=[],
                    use_cpu=True, save_strategy="no", max_length=128)
        if name.startswith("sft"):
            trainer = SFTTrainer(model=model, args=SFTConfig(**args), train_dataset=dataset, processing_class=tokenizer)
        else:
            trainer = DPOTrainer(model=str(work / "model"), args=DPOConfig(**args), train_dataset=dataset,
                                 processing_class=tokenizer)
        loss = trainer.train().training_loss
        print(f"| {name} | {dataset.num_rows} | {loss:.3f} | {trainer.train_dataset.column_names} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "data-demo")
