"""A randomly initialised Qwen2 with its own byte-level BPE tokenizer of the same vocabulary, for
benchmarks of a small compute-bound step (the shape of a Qwen2 block at toy scale):
`python random_qwen2.py OUT_DIR [--hidden 256 --layers 4 --heads 8 --kv-heads 2 --mlp 704 --vocab 512]`.

The tokenizer is trained at run time (Hugging Face `tokenizers`, byte-level BPE) on sums written as
the built-in addition task writes them, so every prompt and every sampled id decodes; the model's
embeddings are tied, as in Qwen2-0.5B."""

import argparse
import json
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import Qwen2Config, Qwen2ForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--hidden", type=int, default=256)
ap.add_argument("--layers", type=int, default=4)
ap.add_argument("--heads", type=int, default=8)
ap.add_argument("--kv-heads", type=int, default=2)
ap.add_argument("--mlp", type=int, default=704)
ap.add_argument("--vocab", type=int, default=512)
ap.add_argument("--seed", type=int, default=0)
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

cfg = Qwen2Config(
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
torch.manual_seed(args.seed)
model = Qwen2ForCausalLM(cfg)
model.save_pretrained(out, safe_serialization=True)
print(f"{out}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, vocab {tok.get_vocab_size()}")
