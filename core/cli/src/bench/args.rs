//! The arguments of `rlhf bench` and which sections they select.

use std::path::PathBuf;

/// A part of the benchmark.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Section {
    Gen,
    Train,
    Rl,
    Dp,
    Overlap,
    Decode,
    All,
}

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Run only this section (`rlhf bench gen` = `--only gen`); default: gen, train and rl (`all`
    /// adds dp, overlap and decode).
    #[arg(value_enum)]
    pub(super) section: Option<Section>,
    /// Hugging Face model directory or Hub id (any supported family), or a random model written by
    /// `rlhf`: `builtin:tiny`, `builtin:qwen2-0.5b` (Qwen2.5-0.5B's shape) or `builtin:qwen2-6x256`
    /// (6 layers of hidden size 256: a decode bound by the host).
    #[arg(long, default_value = "builtin:tiny")]
    pub(super) model: String,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub(super) device: String,
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16"])]
    pub(super) dtype: String,
    /// Prompts per batch (B).
    #[arg(long, default_value_t = 4)]
    pub(super) batch: i64,
    /// Samples per prompt (G); the gen and train sections run B·G sequences too.
    #[arg(long, short = 'g', default_value_t = 4)]
    pub(super) group: i64,
    /// Prompt tokens of the gen and train sections (random tokens).
    #[arg(long, default_value_t = 32)]
    pub(super) prompt_len: i64,
    /// The RL sections' `data.max_prompt_len`: longer prompts are cut from the left. The default
    /// keeps chat prompts whole, system prompt included.
    #[arg(long, default_value_t = 512)]
    pub(super) rl_prompt_len: i64,
    /// New tokens per sequence (the RL section's max_new_tokens).
    #[arg(long, default_value_t = 32)]
    pub(super) new_tokens: i64,
    /// Timed runs per figure (the median is reported), after one untimed warm-up run.
    #[arg(long, visible_alias = "runs", default_value_t = 3)]
    pub(super) repeats: usize,
    /// Ranks of the dp section (each on one thread, against one rank on one thread).
    #[arg(long, default_value_t = 2)]
    pub(super) ranks: usize,
    /// Steps of each run of the overlap section.
    #[arg(long, default_value_t = 12)]
    pub(super) overlap_steps: usize,
    /// Skip the preset's supervised warm-up in the overlap section (its rewards then compare
    /// an untrained policy).
    #[arg(long)]
    pub(super) overlap_no_warmup: bool,
    /// Run the overlap section on these vLLM servers (comma-separated URLs, serving the model as
    /// `policy`), synchronously and at max_staleness 1; started by you, e.g. pinned to other cores.
    #[arg(long, value_delimiter = ',')]
    pub(super) overlap_vllm: Vec<String>,
    /// Batch sizes of the decode section (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,8,64")]
    pub(super) decode_batches: Vec<i64>,
    /// New tokens per sequence of the decode section, >= 2 (it times this length and a quarter of it).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(i64).range(2..))]
    pub(super) decode_new_tokens: i64,
    /// Also time transformers' static-cache `generate` (under torch.compile on CUDA) in the decode
    /// section, on the same model, batches and lengths; prints HF / ours.
    #[arg(long)]
    pub(super) vs_hf: bool,
    /// Sections to run, comma-separated: gen, train, rl, dp, overlap, decode, all.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub(super) only: Vec<Section>,
    /// Prompts JSONL for the RL section (`prompt` or `messages`, and `label`); default: the built-in
    /// addition task.
    #[arg(long)]
    pub(super) prompts: Option<PathBuf>,
    /// Give every RL prompt one image this many pixels a side: the built-in visual task's scenes
    /// and questions (`builtin:shapes-train`) drawn at that size, for a model that reads images
    /// (`builtin:tiny-qwen2.5-vl`, `builtin:qwen2.5-vl-100m`, or a Qwen-VL checkpoint over that
    /// task's words); with --vs-trl TRL gets the same images. 0: no images.
    #[arg(long, default_value_t = 0)]
    pub(super) image_size: u32,
    /// Peak TFLOP/s of the device for MFU (default: by CUDA device name, else the GEMM peak this run measures).
    #[arg(long, value_parser = positive)]
    pub(super) peak_tflops: Option<f64>,
    /// Memory bandwidth in GB/s for the decode bound (default: by CUDA device name, else the copy rate this run
    /// measures).
    #[arg(long, value_parser = positive)]
    pub(super) hbm_gbps: Option<f64>,
    /// Also time TRL's GRPOTrainer on the same model, prompts, B, G and lengths; prints TRL/ours.
    #[arg(long)]
    pub(super) vs_trl: bool,
    /// Activation checkpointing per decoder layer in the RL section (`train.gradient_checkpointing`),
    /// and in TRL's with --vs-trl (its `gradient_checkpointing`).
    #[arg(long)]
    pub(super) gradient_checkpointing: bool,
    /// The RL and dp sections' algorithm: its preset (`grpo`, `ppo` with its critic, `rloo`,
    /// `gspo`, `ppo-seq`, `reinforce-pp`) under the benchmark's overrides. `--vs-trl` and the
    /// overlap section run GRPO only.
    #[arg(long, default_value = "grpo")]
    pub(super) algo: String,
    /// The RL section's passes padding-free (`train.padding_free`; ours only).
    #[arg(long)]
    pub(super) padding_free: bool,
    /// Train the RL section's minibatches in micro-batches of at most N tokens
    /// (`train.micro_batch_tokens`; needs --padding-free; ours only).
    #[arg(long, value_name = "N", requires = "padding_free")]
    pub(super) micro_batch_tokens: Option<usize>,
    /// Sample the RL section's rollouts with a bf16 copy of the policy (`rollout.decode_dtype = "bf16"`; ours only).
    #[arg(long)]
    pub(super) bf16_decode: bool,
    /// Python for --vs-trl and --vs-hf (default: $RLHF_PYTHON, else python3).
    #[arg(long)]
    pub(super) python: Option<PathBuf>,
    /// TRL driver (default: the built-in copy of xtask/scripts/trl_grpo_bench.py).
    #[arg(long)]
    pub(super) trl_script: Option<PathBuf>,
    /// Append the result as a row to this Markdown file (created with a header if missing).
    #[arg(long)]
    pub(super) record: Option<PathBuf>,
    /// Do not append to the --record file.
    #[arg(long)]
    pub(super) no_record: bool,
    /// Also print every figure as one JSON line.
    #[arg(long)]
    pub(super) json: bool,
    /// Profile one more run of the gen, train and rl sections with libtorch's profiler after the
    /// timed ones: writes `gen.json`, `train.json` and `rl.json` (Chrome traces: Perfetto,
    /// chrome://tracing) into this directory and prints the kernels (on CUDA) or operators (CPU)
    /// that took the most time.
    #[arg(long)]
    pub(super) profile: Option<PathBuf>,
    /// Seed of the random prompts, the built-in model and the RL run.
    #[arg(long, default_value_t = 42)]
    pub(super) seed: u64,
}

impl BenchArgs {
    /// Which sections run: gen, train, rl, dp, overlap, decode.
    pub(super) fn sections(&self) -> [bool; 6] {
        let mut picked: Vec<Section> = self.only.clone();
        picked.extend(self.section);
        // `dp` and `overlap` start `rlhf train` processes (dp needs a prompt per rank), `decode`
        // times several batch sizes: asked for by name (or `all`), not run by default.
        if picked.is_empty() {
            return [true, true, true, false, false, false];
        }
        if picked.contains(&Section::All) {
            return [true; 6];
        }
        [Section::Gen, Section::Train, Section::Rl, Section::Dp, Section::Overlap, Section::Decode]
            .map(|s| picked.contains(&s))
    }
}

/// A finite number > 0 (a peak rate).
fn positive(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("`{s}` is not a number > 0")),
    }
}

#[cfg(test)]
mod tests {
    /// A peak of 0, below 0 or not a number would print an infinite or negative MFU.
    #[test]
    fn peaks_are_positive_numbers() {
        assert_eq!(super::positive("989.4"), Ok(989.4));
        // Two lengths to time: a decode section of one new token is refused by name.
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            bench: super::BenchArgs,
        }
        let e = <Cli as clap::Parser>::try_parse_from(["bench", "decode", "--decode-new-tokens", "1"]).err().unwrap();
        assert!(e.to_string().contains("--decode-new-tokens"), "{e}");
        for bad in ["0", "-1", "nan", "inf", "fast"] {
            assert!(super::positive(bad).is_err(), "{bad}");
        }
    }
}
