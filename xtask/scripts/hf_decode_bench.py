"""Decode time per step of Hugging Face transformers' `generate` with a static KV cache, optionally
under `torch.compile(mode="reduce-overhead")` (CUDA graphs through Inductor): the fastest decoder a
PyTorch user has without vLLM. `rlhf bench decode --vs-hf` runs this beside its own decode on the
same model, device, dtype, batch sizes and lengths, and prints the ratio.

For each batch size, random prompts of --prompt-len tokens are sampled (temperature 1, no top-k or
top-p) to exactly --new-tokens and to a quarter of that (EOS suppressed by `min_new_tokens`); the
decode time per step is the difference of the two medians over the difference of the lengths, so
prefill, compilation left over and per-call set-up cancel. The last line of stdout is one JSON
object: {"ms_per_step": {"B": ms, ...}, "compiled": bool, "transformers": ..., "torch": ...}.
"""

import argparse
import json
import statistics
import sys
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compile", action="store_true", help='torch.compile(mode="reduce-overhead") the forward')
    p.add_argument("--seed", type=int, default=42)
    a = p.parse_args()

    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)

    device = torch.device("cuda:0" if a.device == "cuda" else a.device)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).to(device).eval()
    model.generation_config.cache_implementation = "static"
    model.generation_config.pad_token_id = 0
    if a.compile:
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    vocab = model.config.vocab_size
    torch.manual_seed(a.seed)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def run(ids, new):
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=new,
                min_new_tokens=new,
            )
        sync()
        assert out.shape[1] == ids.shape[1] + new, out.shape
        return time.perf_counter() - t

    short = max(1, a.new_tokens // 4)
    result = {}
    for b in [int(x) for x in a.batches.split(",") if x]:
        ids = torch.randint(1, vocab, (b, a.prompt_len), device=device)
        for _ in range(2):  # warm-up (and compilation) at both lengths
            run(ids, a.new_tokens)
            run(ids, short)
        longs = [run(ids, a.new_tokens) for _ in range(a.repeats)]
        shorts = [run(ids, short) for _ in range(a.repeats)]
        ms = (statistics.median(longs) - statistics.median(shorts)) / (a.new_tokens - short) * 1e3
        result[str(b)] = ms
        print(f"hf: batch {b}: {ms:.3f} ms per decode step", file=sys.stderr)
    print(
        json.dumps(
            {
                "ms_per_step": result,
                "compiled": a.compile,
                "transformers": transformers.__version__,
                "torch": torch.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
