"""A randomly initialised Llama with a given tokenizer, for benchmarks that need more compute per
step than the built-in tiny model: `python random_llama.py TOKENIZER_DIR OUT_DIR [hidden layers]`.
The tokenizer files and vocabulary come from TOKENIZER_DIR (e.g. a run's `builtin-model`)."""

import json
import shutil
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

src, out = Path(sys.argv[1]), Path(sys.argv[2])
hidden = int(sys.argv[3]) if len(sys.argv) > 3 else 512
layers = int(sys.argv[4]) if len(sys.argv) > 4 else 8
base = json.loads((src / "config.json").read_text())
cfg = LlamaConfig(
    vocab_size=base["vocab_size"],
    hidden_size=hidden,
    intermediate_size=int(hidden * 2.75) // 64 * 64,
    num_hidden_layers=layers,
    num_attention_heads=hidden // 64,
    num_key_value_heads=hidden // 64,
    max_position_embeddings=base.get("max_position_embeddings", 512),
    bos_token_id=base.get("bos_token_id"),
    eos_token_id=base.get("eos_token_id"),
    pad_token_id=base.get("pad_token_id"),
    tie_word_embeddings=False,
)
torch.manual_seed(0)
model = LlamaForCausalLM(cfg)
model.save_pretrained(out, safe_serialization=True)
for f in src.iterdir():
    if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json"):
        shutil.copy(f, out / f.name)
print(f"{out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
