#!/usr/bin/env python3
"""Write a randomly initialised Qwen2-shaped checkpoint for benchmarks (no download needed).

    python xtask/scripts/make_qwen2_random.py 0.5b models/qwen2-0.5b-random
    python xtask/scripts/make_qwen2_random.py tiny /tmp/qwen2-tiny --dtype bf16

Presets copy the shapes of Qwen2.5 (hidden size, layers, heads, KV heads, MLP width, vocabulary,
tied embeddings, rope_theta): `0.5b` (494M parameters), `1.5b` (1.54B), and `tiny` for a quick
check. Weights are drawn by transformers' own initialisation (normal, std 0.02) under `--seed`.

The tokenizer is a word-level one built here so the machine needs no network: the three ChatML
specials (`<|endoftext|>` = pad, `<|im_start|>`, `<|im_end|>` = EOS), the words of the built-in
addition task and filler words up to the model's vocabulary size, so every id the model can
sample decodes. A ChatML chat template is included. Needs torch and transformers (the venv of
`cargo xtask setup` has both).
"""

import argparse
import json
import os
import sys

PRESETS = {
    # name: hidden, layers, heads, kv heads, intermediate, vocab, max positions
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=1024, max_position_embeddings=2048),
    # A decode bound by the host (rlhf bench's builtin:qwen2-6x256).
    "6x256": dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2,
                  intermediate_size=704, vocab_size=4096, max_position_embeddings=2048),
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, max_position_embeddings=32768),
}

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = [str(d) for d in range(10)] + ["+", "-", "*", "=", ".", ",", "?", "the", "answer", "is", "what",
                                       "system", "user", "assistant", "You", "are", "a", "helpful"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tokenizer_json(vocab_size):
    words = SPECIALS + WORDS
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for i, s in enumerate(SPECIALS)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": {w: i for i, w in enumerate(words)}, "unk_token": "<|endoftext|>"},
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("preset", choices=sorted(PRESETS))
    ap.add_argument("out", help="output directory (created; existing files are overwritten)")
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32", help="stored dtype (default f32)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    try:
        import torch
        from transformers import Qwen2Config, Qwen2ForCausalLM
    except ImportError as e:
        print(f"error: needs torch and transformers ({e})", file=sys.stderr)
        sys.exit(3)

    shape = PRESETS[args.preset]
    config = Qwen2Config(
        **shape,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        hidden_act="silu",
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=0,
        use_sliding_window=False,
        initializer_range=0.02,
    )
    torch.manual_seed(args.seed)
    model = Qwen2ForCausalLM(config)
    if args.dtype == "bf16":
        model = model.to(torch.bfloat16)
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)

    with open(os.path.join(args.out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_json(shape["vocab_size"]), f, ensure_ascii=False)
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "model_max_length": shape["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(args.out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tok_config, f, indent=2)
    with open(os.path.join(args.out, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump({"bos_token_id": None, "eos_token_id": 2, "pad_token_id": 0}, f, indent=2)
    n = sum(p.numel() for p in model.parameters())
    print(f"{args.out}: Qwen2 {args.preset}, {n / 1e6:.1f}M parameters, {args.dtype}")


if __name__ == "__main__":
    main()
