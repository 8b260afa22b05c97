#!/usr/bin/env python3
"""Step time of TRL's GRPOTrainer, for `rlhf bench --vs-trl` (which runs this script).

Trains on the model directory and prompts it is given with the same shape of step as the `rlhf`
GRPO `Trainer` in the benchmark: B prompts x G samples generated per step (one generation batch),
up to `--new-tokens` new tokens, sampling at temperature 1 (no top-k/top-p), one AdamW step over
the whole batch, beta (k3 KL to a reference model) and epsilon clip as given, reward 1/0 from an
exact match of the completion against the prompt's label (the reward-rules `exact_match` with
`extract = "full"`).

Deliberate departures from TRL's defaults, so both sides do the same work:
  - gradient_checkpointing=False (TRL's configs default to True; `rlhf` does not checkpoint unless
    asked), True with --gradient-checkpointing (`rlhf bench --gradient-checkpointing` on both sides);
  - bf16=False with the weights loaded in the benchmark dtype (pure f32 or pure bf16, as `rlhf`),
    instead of TRL's default bf16 autocast;
  - loss_type="grpo" and scale_rewards="group" (the `rlhf` grpo plugin's defaults).

Prompts with images (rows with an `images` list of paths, their text with `<image>` markers, as
`rlhf bench --image-size` writes them): the model loads as a vision-language model, the prompt
becomes one user message whose content parts are the text around the markers and an image part
for each, and the processor is Qwen-VL's (`Qwen2_5_VLProcessor`: the checkpoint's
`preprocessor_config.json`, its tokenizer, and a chat template that renders the parts as they
are, an image as `<|vision_start|><|image_pad|><|vision_end|>`: the token ids `rlhf` makes of the
same row). The vision tower is frozen, as `rlhf` keeps it by default (`model.freeze_vision`). TRL
suppresses sampled image tokens; `rlhf` samples them as text.

Step time is measured between consecutive `on_step_end` callbacks (after a CUDA synchronize), so
it covers everything a step does (generation, reward, reference log-probs, forward, backward,
optimizer); the first `--warmup` steps are excluded and the median of the rest is reported.

Output: progress on stderr, then one JSON line on stdout:
  {"step_s": median, "step_times": [...], "mean_completion_length": x, "peak_rss_gb": x, "trl": "1.x", ...}
(peak_rss_gb: the peak resident memory of the timed steps, after the warm-up, from Linux VmHWM)
`--check` only checks that trl, transformers and datasets import (exit 3 with a one-line error
naming the install command when they do not).
"""

import argparse
import json
import os
import statistics
import sys
import time


def fail(message, code=3):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def import_stack():
    install = f"install it with: {sys.executable} -m pip install trl"
    try:
        import trl
    except ImportError as e:
        fail(f"trl is not importable ({e}); {install}")
    try:
        import datasets  # noqa: F401
        import torch
        import transformers
    except ImportError as e:
        fail(f"a package trl needs is missing ({e}); {install}")
    return torch, transformers, trl


def parse_number(s):
    """A number written like `1,000`, `$3.50`, `-2`, `42.0`; None for anything else (no exponents)."""
    s = s.strip()
    sign = ""
    if s.startswith("-"):
        sign, s = "-", s[1:]
    elif s.startswith("+"):
        s = s[1:]
    if s.startswith("$"):
        s = s[1:]
    s = s.replace(",", "")
    whole, _, frac = s.partition(".")
    if (not whole and not frac) or not (whole.isdigit() or not whole) or not (frac.isdigit() or not frac):
        return None
    if not (whole.isascii() and frac.isascii()):
        return None
    return float(f"{sign}{whole or '0'}.{frac or '0'}")


def normalize(s):
    return s.strip().rstrip(".").rstrip()


def matches(answer, label):
    a, b = normalize(answer), normalize(label)
    x, y = parse_number(a), parse_number(b)
    if x is not None and y is not None:
        return abs(x - y) <= 1e-9 * max(abs(y), 1.0)
    return a == b


def accuracy(completions, label, **kwargs):
    """1.0 when the whole completion equals the label (numbers compared as numbers), else 0.0."""
    out = []
    for completion, lab in zip(completions, label):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        out.append(1.0 if lab is not None and matches(text, str(lab)) else 0.0)
    return out


def reset_peak_rss():
    """Resets the kernel's peak-RSS mark (VmHWM) of this process (Linux; best effort)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_gb():
    """Peak resident memory since the last reset, in GB (10^9 bytes); None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return None


# Renders each content part as it is, an image as Qwen-VL's placeholder run (expanded by the
# processor to one `<|image_pad|>` per merged patch).
VL_TEMPLATE = (
    "{% for message in messages %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endfor %}"
)


def vision_language(model_dir, dtype, tokenizer, rows):
    """The model as a vision-language model, Qwen-VL's processor over `tokenizer`, and the rows as
    conversational prompts with image parts where their `<image>` markers are, the images opened."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    # Without torchvision transformers cannot resolve the video processor's class, which images
    # do not use: skip that one check.
    check = Qwen2_5_VLProcessor.check_argument_for_proper_class
    Qwen2_5_VLProcessor.check_argument_for_proper_class = (
        lambda self, name, arg: None if name == "video_processor" else check(self, name, arg))
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    processor = Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=VL_TEMPLATE)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype)
    # The vision tower frozen, as `rlhf` keeps it by default (`model.freeze_vision`).
    for p in model.model.visual.parameters():
        p.requires_grad_(False)
    out = []
    for r in rows:
        pieces = r["prompt"].split("<image>")
        content = []
        for i, text in enumerate(pieces):
            if i > 0:
                content.append({"type": "image"})
            if text:
                content.append({"type": "text", "text": text})
        images = [Image.open(p).convert("RGB") for p in r["images"] or []]
        if len(images) != len(pieces) - 1:
            fail(f"{len(pieces) - 1} <image> markers for {len(images)} images in {r['prompt']!r}", 2)
        out.append({"prompt": [{"role": "user", "content": content}], "images": images, "label": r["label"]})
    return model, processor, out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only check that trl imports")
    ap.add_argument("--model", help="Hugging Face model directory")
    ap.add_argument("--prompts", help="JSONL of {prompt, label}: the prompt text exactly as the model sees it")
    ap.add_argument("--batch", type=int, default=4, help="prompts per step (B)")
    ap.add_argument("--group", type=int, default=4, help="samples per prompt (G)")
    ap.add_argument("--new-tokens", type=int, default=32, help="max new tokens")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--epsilon", type=float, default=0.2)
    ap.add_argument("--adam-beta2", type=float, default=0.95)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--output-dir", default=None, help="TRL's output_dir (nothing is saved there)")
    args = ap.parse_args()

    torch, transformers, trl = import_stack()
    versions = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}
    if args.check:
        print(json.dumps(versions))
        return
    if not args.model or not args.prompts:
        fail("--model and --prompts are required", 2)

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        fail("--device cuda but torch sees no CUDA device", 2)
    rows = []
    with open(args.prompts, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                rows.append({"prompt": r["prompt"], "label": r.get("label"), "images": r.get("images")})
    if not rows:
        fail(f"{args.prompts}: no prompts", 2)
    with_images = any(r["images"] for r in rows)
    if not with_images:
        for r in rows:
            del r["images"]

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    # tokenizer.json as it is, like `rlhf` (AutoTokenizer in transformers 5 may rebuild it from the
    # model type, e.g. as a Qwen2 BPE tokenizer, which need not match the file).
    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if with_images:
        model, processing_class, rows = vision_language(args.model, dtype, tokenizer, rows)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
        processing_class = tokenizer

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.marks = []
            self.lengths = []

        def _mark(self):
            if cuda:
                torch.cuda.synchronize()
            self.marks.append(time.perf_counter())

        def on_train_begin(self, *a, **kw):
            self._mark()
            if args.warmup == 0:
                reset_peak_rss()

        def on_step_end(self, *a, **kw):
            self._mark()
            if len(self.marks) == args.warmup + 1:
                reset_peak_rss()  # the timed steps start: measure their peak only, as rlhf does

        def on_log(self, args_, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(float(logs["completions/mean_length"]))

    timer = StepTimer()
    steps = args.warmup + args.repeats
    output_dir = args.output_dir or os.path.join(os.path.dirname(os.path.abspath(args.prompts)), "trl-out")
    config = GRPOConfig(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=args.batch * args.group,
        gradient_accumulation_steps=1,
        num_generations=args.group,
        max_completion_length=args.new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=args.beta,
        epsilon=args.epsilon,
        loss_type="grpo",
        scale_rewards="group",
        num_iterations=1,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=args.adam_beta2,
        adam_epsilon=1e-8,
        max_grad_norm=args.max_grad_norm,
        gradient_checkpointing=args.gradient_checkpointing,
        bf16=False,
        fp16=False,
        use_cpu=not cuda,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=args.seed,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[accuracy],
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=processing_class,
        callbacks=[timer],
    )
    trainer.train()

    times = [b - a for a, b in zip(timer.marks, timer.marks[1:])]
    timed = times[args.warmup :]
    if not timed:
        fail(f"TRL ran {len(times)} steps, none timed after {args.warmup} warm-up", 4)
    lengths = timer.lengths[args.warmup :] or timer.lengths
    result = {
        "step_s": statistics.median(timed),
        "step_times": times,
        "warmup": args.warmup,
        "mean_completion_length": statistics.mean(lengths) if lengths else None,
        "peak_rss_gb": peak_rss_gb(),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        **versions,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
