"""Decode time per step of Hugging Face transformers' `generate` with a static KV cache, under
`torch.compile(mode="reduce-overhead")` (CUDA graphs through Inductor) on CUDA, as `generate`
compiles a static-cache decode by itself there (its `CompileConfig`, made explicit here): the
fastest decoder a PyTorch user has without vLLM. `rlhf bench decode --vs-hf` runs this beside its own decode on the
same model, device, dtype, batch sizes and lengths, and prints the ratio.

For each batch size, random prompts of --prompt-len tokens are sampled (temperature 1, no top-k or
top-p) to exactly --new-tokens (EOS suppressed by `min_new_tokens`), once to warm up (and compile),
then --repeats times timed: a logits processor stamps every decode step (a CUDA event on the
stream, so nothing waits; the clock on a CPU), and a step's time is the mean interval between
consecutive stamps after the first quarter of the steps — the decode's steady rate, prefill and
compilation excluded (one length, so the static cache and its compiled graphs keep one shape).
The median over the repeats is reported. The last line of stdout is one JSON object:
{"ms_per_step": {"B": ms, ...}, "compiled": bool, "transformers": ..., "torch": ...}.
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
    p.add_argument("--compile", action="store_true", help='compile the decode step (torch.compile, "reduce-overhead")')
    p.add_argument("--seed", type=int, default=42)
    a = p.parse_args()

    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, CompileConfig, LogitsProcessor, LogitsProcessorList
    except ImportError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)

    device = torch.device("cuda:0" if a.device == "cuda" else a.device)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).to(device).eval()
    model.generation_config.cache_implementation = "static"
    model.generation_config.pad_token_id = 0
    if a.compile:
        # generate compiles the forward of a static-cache decode itself on CUDA; on other devices
        # only when told to.
        model.generation_config.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead")
        model.generation_config.compile_config._compile_all_devices = device.type != "cuda"
    else:
        model.generation_config.disable_compile = True
    vocab = model.config.vocab_size
    torch.manual_seed(a.seed)

    class Stamps(LogitsProcessor):
        """Stamps every decode step as it reaches the device."""

        def __init__(self):
            self.stamps = []

        def __call__(self, input_ids, scores):
            if device.type == "cuda":
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                self.stamps.append(e)
            else:
                self.stamps.append(time.perf_counter())
            return scores

        def ms_per_step(self):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                times = [self.stamps[0].elapsed_time(e) for e in self.stamps]
            else:
                times = [(t - self.stamps[0]) * 1e3 for t in self.stamps]
            first = len(times) // 4
            return (times[-1] - times[first]) / (len(times) - 1 - first)

    def run(ids):
        stamps = Stamps()
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=a.new_tokens,
                min_new_tokens=a.new_tokens,
                logits_processor=LogitsProcessorList([stamps]),
            )
        assert out.shape[1] == ids.shape[1] + a.new_tokens, out.shape
        return stamps.ms_per_step()

    result = {}
    for b in [int(x) for x in a.batches.split(",") if x]:
        ids = torch.randint(1, vocab, (b, a.prompt_len), device=device)
        run(ids)  # warm-up and compilation
        ms = statistics.median(run(ids) for _ in range(a.repeats))
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
