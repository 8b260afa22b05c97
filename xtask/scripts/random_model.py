"""A randomly initialised decoder with its own byte-level BPE tokenizer of the same vocabulary, for
benchmarks: `python random_model.py OUT_DIR [--family qwen2|qwen3|qwen3_moe|llama] [--hidden 256
--layers 4 --heads 8 --kv-heads 2 --mlp 704 --vocab 512] [--head-dim D] [--experts E --top-k K
--expert-mlp M] [--linear-heads K,V --linear-head-dim D]`. Qwen2 (the default) has the shape of a
Qwen2 block at toy scale; qwen3 adds per-head q/k norms (and `--head-dim`); qwen3_moe replaces every
MLP by E experts of `--expert-mlp`, K routed per token; qwen3_5 makes three layers of every four
Gated DeltaNet linear attention (`--linear-heads` key and value heads of `--linear-head-dim`) and
the fourth gated attention; llama is the same shape without the Qwen biases, for a like-for-like
ratio.

The tokenizer is trained at run time (Hugging Face `tokenizers`, byte-level BPE) on sums written as
the built-in addition task writes them, so every prompt and every sampled id decodes; the model's
embeddings are tied, as in Qwen2-0.5B and Qwen3-0.6B."""

import argparse
import json
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
import transformers

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--hidden", type=int, default=256)
ap.add_argument("--layers", type=int, default=4)
ap.add_argument("--heads", type=int, default=8)
ap.add_argument("--kv-heads", type=int, default=2)
ap.add_argument("--mlp", type=int, default=704)
ap.add_argument("--vocab", type=int, default=512)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--family", default="qwen2", choices=["qwen2", "qwen3", "qwen3_moe", "qwen3_5", "llama"])
ap.add_argument("--linear-heads", default="8,16")
ap.add_argument("--linear-head-dim", type=int, default=64)
ap.add_argument("--head-dim", type=int, default=None)
ap.add_argument("--experts", type=int, default=8)
ap.add_argument("--top-k", type=int, default=2)
ap.add_argument("--expert-mlp", type=int, default=None)
args = ap.parse_args()
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)

rng = random.Random(args.seed)
corpus = [f"{rng.randint(0, 999)}+{rng.randint(0, 999)}={rng.randint(0, 1998)}" for _ in range(20000)]
corpus += ["What is the sum of these two numbers? Answer with the number only."] * 100
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
specials = ["<|endoftext|>"]
trainer = trainers.BpeTrainer(
    vocab_size=args.vocab, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
)
tok.train_from_iterator(corpus, trainer)
tok.save(str(out / "tokenizer.json"))
eos = tok.token_to_id("<|endoftext|>")
(out / "tokenizer_config.json").write_text(
    json.dumps({"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"})
)

common = dict(
    vocab_size=args.vocab,
    hidden_size=args.hidden,
    intermediate_size=args.mlp,
    num_hidden_layers=args.layers,
    num_attention_heads=args.heads,
    num_key_value_heads=args.kv_heads,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    bos_token_id=None,
    eos_token_id=eos,
    pad_token_id=eos,
)
if args.head_dim is not None:
    common["head_dim"] = args.head_dim
elif args.family in ("qwen3", "qwen3_moe", "qwen3_5"):
    common["head_dim"] = args.hidden // args.heads
if args.family == "qwen3_moe":
    common.update(num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
                  moe_intermediate_size=args.expert_mlp or args.mlp // args.top_k)
if args.family == "qwen3_5":
    k_heads, v_heads = (int(x) for x in args.linear_heads.split(","))
    common.update(linear_num_key_heads=k_heads, linear_num_value_heads=v_heads,
                  linear_key_head_dim=args.linear_head_dim, linear_value_head_dim=args.linear_head_dim)
classes = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
           "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
           "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"), "llama": ("LlamaConfig", "LlamaForCausalLM")}
config_cls, model_cls = (getattr(transformers, c) for c in classes[args.family])
cfg = config_cls(**common)
torch.manual_seed(args.seed)
model = model_cls(cfg)
model.save_pretrained(out, safe_serialization=True)
print(f"{out}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, vocab {tok.get_vocab_size()}")
