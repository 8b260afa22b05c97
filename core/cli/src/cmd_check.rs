//! `rlhf check-device`: does a model compute the same on a device and dtype as on the CPU in f32?
//!
//! The same left-padded batch of token ids goes through the model twice — on the CPU in f32 (the
//! reference) and on `--device` in `--dtype` — and the logits of every real position are compared:
//! max |Δ| and max |Δ| relative to the largest reference logit; then both decode greedily and the
//! agreement of their tokens is reported. Exit status 1 past `--tolerance` (relative; default 1e-4
//! for f32; 0.15 for bf16/f16, whose 8 mantissa bits give ~0.4 % per rounding and compound over
//! the layers: 10 % on the deliberately peaky test fixture. A broken kernel or dtype path is off by
//! O(1), which the bf16 bound still catches; the top-token agreement says more about bf16).

use anyhow::Context;
use rlhf_generation::{generate, left_pad, GenerateConfig};
use rlhf_models::CausalLm;
use tch::{Device, Kind, Tensor};

use crate::common::ModelArgs;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Largest allowed max |Δlogit| / max |reference logit| (default: 1e-4 for f32, 0.15 for bf16/f16).
    #[arg(long)]
    tolerance: Option<f64>,
    /// Sequences in the batch (left-padded to different lengths).
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Tokens of the longest sequence.
    #[arg(long, default_value_t = 48)]
    len: usize,
    /// Greedy tokens decoded by both.
    #[arg(long, default_value_t = 16)]
    new_tokens: i64,
    /// Print the figures as one JSON line too.
    #[arg(long)]
    json: bool,
}

/// Deterministic token ids in `[lo, vocab)`: row `i` has `len − 5·i` tokens (at least 1), so the
/// batch is left-padded by 0, 5, 10, ... (a 64-bit LCG; the same on every machine).
pub(crate) fn batch_ids(batch: usize, len: usize, vocab: i64) -> Vec<Vec<i64>> {
    let lo = vocab.min(4) - 1; // skip the first ids, often special tokens
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..batch)
        .map(|i| {
            let n = len.saturating_sub(5 * i).max(1);
            (0..n)
                .map(|_| {
                    state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                    lo + ((state >> 33) as i64).rem_euclid(vocab - lo)
                })
                .collect()
        })
        .collect()
}

/// Logits of `model` on `seqs` (left-padded), moved to the CPU in f32.
///
/// # Shapes
/// - returns (`[batch, len, vocab]` f32 logits, `[batch, len]` int64 mask), both on the CPU
fn logits(model: &CausalLm, seqs: &[Vec<i64>], pad: i64) -> anyhow::Result<(Tensor, Tensor)> {
    let b = left_pad(seqs, pad, model.device())?;
    let out = tch::no_grad(|| model.forward(&b.input_ids, &b.attention_mask))?;
    Ok((out.f_to_device(Device::Cpu)?.f_to_kind(Kind::Float)?, b.attention_mask.f_to_device(Device::Cpu)?))
}

/// Greedy continuations of `seqs`, as `[batch, steps]` ids on the CPU.
fn greedy(model: &CausalLm, seqs: &[Vec<i64>], pad: i64, new_tokens: i64) -> anyhow::Result<Tensor> {
    let b = left_pad(seqs, pad, model.device())?;
    // No EOS: every sequence decodes `new_tokens` tokens, so the two runs are comparable slot by slot.
    let g = generate(model, &b.input_ids, &b.attention_mask, &GenerateConfig::greedy(new_tokens, vec![], pad))?;
    Ok(g.responses()?.f_to_device(Device::Cpu)?)
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let (device, kind) = args.model.device_kind()?;
    if args.batch == 0 || args.len == 0 || args.new_tokens < 1 {
        anyhow::bail!("--batch, --len and --new-tokens must be >= 1");
    }
    let tolerance = args.tolerance.unwrap_or(if kind == Kind::Float { 1e-4 } else { 0.15 });
    let dir = &args.model.dir()?;
    // The CPU's kind decides the last bits of every float (see `crate::machine`).
    let cpu = crate::machine::describe_cpu();
    println!("cpu: {cpu}");
    let reference = CausalLm::from_dir(dir, Device::Cpu, Kind::Float)?;
    let target =
        CausalLm::from_dir(dir, device, kind).with_context(|| format!("{} on {}", dir.display(), args.model.device))?;
    let pad = args.model.load_tokenizer().map(|t| i64::from(t.pad_token_id())).unwrap_or(0);
    let seqs = batch_ids(args.batch, args.len, reference.arch().vocab_size);

    let (want, mask) = logits(&reference, &seqs, pad)?; // [b, s, V], [b, s]
    let (got, _) = logits(&target, &seqs, pad)?;
    let real = mask.f_ne(0)?.f_unsqueeze(-1)?; // [b, s, 1]
    let diff = got.f_sub(&want)?.f_abs()?.f_where_scalarother(&real, 0.0)?; // [b, s, V]
    let max_diff = diff.f_max()?.f_double_value(&[])?;
    let scale = want.f_abs()?.f_where_scalarother(&real, 0.0)?.f_max()?.f_double_value(&[])?.max(1e-12);
    let relative = max_diff / scale;
    let top_want = want.f_argmax(-1, false)?;
    let top_got = got.f_argmax(-1, false)?;
    let n_real = mask.f_ne(0)?.f_sum(Kind::Int64)?.f_int64_value(&[])?;
    let same_top =
        top_want.f_eq_tensor(&top_got)?.f_logical_and(&mask.f_ne(0)?)?.f_sum(Kind::Int64)?.f_int64_value(&[])?;

    let g_want = greedy(&reference, &seqs, pad, args.new_tokens)?; // [b, steps]
    let g_got = greedy(&target, &seqs, pad, args.new_tokens)?;
    let same_greedy = g_want.f_eq_tensor(&g_got)?.f_sum(Kind::Int64)?.f_int64_value(&[])?;
    let greedy_total = g_want.numel() as i64;

    let what = format!("{} {} vs cpu f32", args.model.device, args.model.dtype);
    println!("{what}: {} sequences, {n_real} positions, vocabulary {}", seqs.len(), reference.arch().vocab_size);
    println!(
        "max |Δlogit| {max_diff:.3e} at max |logit| {scale:.3}: relative {relative:.3e} (tolerance {tolerance:.1e})"
    );
    println!("same top token at {same_top}/{n_real} positions; greedy tokens equal {same_greedy}/{greedy_total}");
    if args.json {
        println!(
            "{}",
            serde_json::json!({"device": args.model.device, "dtype": args.model.dtype, "cpu": cpu, "max_abs_diff": max_diff,
                "max_abs_logit": scale, "relative": relative, "tolerance": tolerance, "positions": n_real,
                "same_top": same_top, "greedy_equal": same_greedy, "greedy_total": greedy_total})
        );
    }
    // NaN (a broken device path) fails too.
    if relative.is_nan() || relative > tolerance {
        anyhow::bail!(
            "{what}: logits differ by {relative:.3e} of the largest logit, over the tolerance {tolerance:.1e}"
        );
    }
    Ok(())
}
