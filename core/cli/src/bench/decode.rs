//! The `decode` section of `rlhf bench`: milliseconds per decode step by batch size — with CUDA
//! graphs and eagerly on CUDA, eagerly elsewhere — and, with `--vs-hf`, Hugging Face
//! transformers' `generate` with a static KV cache (under `torch.compile(mode="reduce-overhead")`
//! on CUDA) on the same model, device, dtype, batches and lengths, through the driver
//! `xtask/scripts/hf_decode_bench.py` (embedded).
//!
//! Both sides sample random prompts (temperature 1, no EOS) and report the steady rate of decode
//! steps, prefill and set-up excluded. Ours: `new` tokens and `new / 4`, medians of `repeats`
//! runs after a warm-up, the difference over the difference of lengths (prefill, graph capture
//! and per-call set-up cancel). transformers': `new` tokens, every step stamped by a logits
//! processor (a CUDA event on the stream), the mean interval after the first quarter of the
//! steps, median of `repeats` runs after a warm-up that compiles (one length: its static cache
//! and compiled graphs keep one shape).

use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{bail, Context};
use tch::{Kind, Tensor};

use rlhf_generation::{generate, GenerateConfig, Sampling};
use rlhf_models::CausalLm;

use super::report::median;
use super::time_runs;

/// The HF driver, written next to the other temporary files of a run.
const SCRIPT: &str = include_str!("../../../../xtask/scripts/hf_decode_bench.py");

/// One batch size's figures, milliseconds per decode step.
#[derive(Debug, Clone, serde::Serialize)]
pub(super) struct DecodeRow {
    pub(super) batch: i64,
    /// With CUDA graphs (CUDA, when the model's step can be captured).
    pub(super) graphs_ms: Option<f64>,
    pub(super) eager_ms: f64,
    /// transformers' static-cache `generate` (`--vs-hf`).
    pub(super) hf_ms: Option<f64>,
}

impl DecodeRow {
    /// Our best time.
    pub(super) fn ours_ms(&self) -> f64 {
        self.graphs_ms.unwrap_or(self.eager_ms)
    }
}

/// What the HF side ran with.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(super) struct HfInfo {
    pub(super) compiled: bool,
    pub(super) transformers: String,
    pub(super) torch: String,
}

/// Milliseconds per decode step of `rows` random prompts of `prompt_len` tokens (see the module
/// docs), with or without CUDA graphs.
fn ms_per_step(
    model: &CausalLm,
    rows: i64,
    prompt_len: i64,
    new: i64,
    repeats: usize,
    graphs: bool,
) -> anyhow::Result<f64> {
    let device = model.device();
    let vocab = model.arch().vocab_size;
    let ids = Tensor::f_randint_low(1, vocab, [rows, prompt_len], (Kind::Int64, device))?; // [rows, P]
    let mask = Tensor::f_ones([rows, prompt_len], (Kind::Int64, device))?; // [rows, P]
    let short = (new / 4).max(1);
    let mut cfg = GenerateConfig::greedy(new, vec![], 0);
    cfg.sampling = Sampling::Sample { temperature: 1.0, top_k: None, top_p: None };
    cfg.cuda_graphs = graphs;
    let mut time = |n: i64| -> anyhow::Result<f64> {
        cfg.max_new_tokens = n;
        let runs = time_runs(device, repeats, || {
            let out = generate(model, &ids, &mask, &cfg)?;
            anyhow::ensure!(out.response_mask.size()[1] == n, "generation stopped early");
            Ok(())
        })?;
        Ok(median(&runs).unwrap_or(f64::NAN))
    };
    let (long, short_s) = (time(new)?, time(short)?);
    Ok((long - short_s) / (new - short) as f64 * 1e3)
}

/// Our figures for each batch size.
pub(super) fn run(
    model: &CausalLm,
    batches: &[i64],
    prompt_len: i64,
    new: i64,
    repeats: usize,
) -> anyhow::Result<Vec<DecodeRow>> {
    if new < 2 {
        bail!("--decode-new-tokens {new}: the decode section times two lengths, so it needs >= 2");
    }
    let graphs = model.device().is_cuda() && model.capture_blocker().is_none();
    let mut rows = Vec::new();
    for &b in batches {
        let eager_ms = ms_per_step(model, b, prompt_len, new, repeats, false)?;
        let graphs_ms = if graphs { Some(ms_per_step(model, b, prompt_len, new, repeats, true)?) } else { None };
        rows.push(DecodeRow { batch: b, graphs_ms, eager_ms, hf_ms: None });
    }
    Ok(rows)
}

/// The HF side's figures, filled into `rows`.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_hf(
    python: &Path,
    work_dir: &Path,
    model_dir: &Path,
    device: &str,
    dtype: &str,
    rows: &mut [DecodeRow],
    prompt_len: i64,
    new: i64,
    repeats: usize,
) -> anyhow::Result<HfInfo> {
    let script = work_dir.join("hf_decode_bench.py");
    std::fs::write(&script, SCRIPT).with_context(|| format!("writing {}", script.display()))?;
    let batches = rows.iter().map(|r| r.batch.to_string()).collect::<Vec<_>>().join(",");
    let device = if device.starts_with("cuda") { "cuda" } else { device };
    let mut cmd = Command::new(python);
    cmd.arg(&script)
        .arg("--model")
        .arg(model_dir)
        .args(["--device", device, "--dtype", dtype, "--batches", &batches])
        .args(["--prompt-len", &prompt_len.to_string(), "--new-tokens", &new.to_string()])
        .args(["--repeats", &repeats.to_string()]);
    if device == "cuda" {
        cmd.arg("--compile");
    }
    let out = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .with_context(|| format!("running {}", python.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let line = stderr.lines().rev().map(str::trim).find(|l| !l.is_empty()).unwrap_or("(no output)");
        bail!("transformers' decode benchmark failed ({}): {line}", out.status);
    }
    let last = stdout.lines().rev().map(str::trim).find(|l| !l.is_empty()).unwrap_or("");
    let v: serde_json::Value =
        serde_json::from_str(last).with_context(|| format!("the HF driver's last line is not JSON: {last}"))?;
    for r in rows.iter_mut() {
        r.hf_ms = v["ms_per_step"][r.batch.to_string()].as_f64();
    }
    serde_json::from_value(v).context("the HF driver's versions")
}

/// Prints the section's table.
pub(super) fn print(rows: &[DecodeRow], hf: Option<&HfInfo>) {
    let hf_name = hf.map(|h| {
        let compiled = if h.compiled { " + torch.compile" } else { "" };
        format!("transformers {} static cache{compiled}", h.transformers)
    });
    println!("decode: ms per decode step (tokens/s){}", hf_name.as_ref().map_or(String::new(), |n| format!(" vs {n}")));
    for r in rows {
        let tps = |ms: f64| r.batch as f64 / ms * 1e3;
        let mut line = format!("       batch {:>4}: eager {:.3} ms ({:.0}/s)", r.batch, r.eager_ms, tps(r.eager_ms));
        if let Some(g) = r.graphs_ms {
            line.push_str(&format!(" | CUDA graphs {g:.3} ms ({:.0}/s, {:.2}x eager)", tps(g), r.eager_ms / g));
        }
        if let Some(h) = r.hf_ms {
            line.push_str(&format!(" | HF {h:.3} ms ({:.2}x ours)", h / r.ours_ms()));
        }
        println!("{line}");
    }
}

/// The decode table of `BENCHMARKS.md`.
pub const TABLE: &str = "\
| date | device | model | settings | batch | eager ms/step | CUDA graphs ms/step | tokens/s | HF ms/step | HF / ours |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
";

/// One table row per batch size.
pub(super) fn markdown_rows(
    date: &str,
    device: &str,
    model: &str,
    settings: &str,
    rows: &[DecodeRow],
    hf: Option<&HfInfo>,
) -> Vec<String> {
    let opt = |x: Option<f64>| x.map_or("—".to_string(), |v| format!("{v:.3}"));
    let settings = match hf {
        Some(h) => format!(
            "{settings}; HF: transformers {} static cache{}",
            h.transformers,
            if h.compiled { " + torch.compile" } else { "" }
        ),
        None => settings.to_string(),
    };
    rows.iter()
        .map(|r| {
            let ratio = r.hf_ms.map_or("—".to_string(), |h| format!("{:.2}x", h / r.ours_ms()));
            format!(
                "| {date} | {device} | {model} | {settings} | {} | {:.3} | {} | {:.0} | {} | {ratio} |",
                r.batch,
                r.eager_ms,
                opt(r.graphs_ms),
                r.batch as f64 / r.ours_ms() * 1e3,
                opt(r.hf_ms)
            )
        })
        .collect()
}

/// Adds the rows to `path`'s decode table (the section is created when missing).
pub(super) fn record(
    path: &Path,
    date: &str,
    device: &str,
    model: &str,
    settings: &str,
    rows: &[DecodeRow],
    hf: Option<&HfInfo>,
) -> anyhow::Result<()> {
    let mut text = std::fs::read_to_string(path).unwrap_or_default();
    let intro = "## Decode steps\n\n`rlhf bench decode`: milliseconds per decode step (sampling, no EOS) by \
                 batch size, eagerly and with CUDA graphs — the difference of two generation lengths over the \
                 difference of their steps, so prefill, graph capture and set-up cancel; with `--vs-hf`, \
                 transformers' static-cache `generate` (compiled with `torch.compile(mode=\"reduce-overhead\")` on \
                 CUDA, as `generate` does by itself there) on the same model, batches and length in the same run — \
                 its steady rate from a timestamp per step, compilation and prefill excluded.";
    for row in markdown_rows(date, device, model, settings, rows, hf) {
        text = super::report::add_row_or_section(&text, TABLE, &row, intro);
    }
    std::fs::write(path, text).with_context(|| format!("{}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_show_each_side_and_the_ratio() {
        let rows = [
            DecodeRow { batch: 1, graphs_ms: Some(2.0), eager_ms: 10.0, hf_ms: Some(5.0) },
            DecodeRow { batch: 64, graphs_ms: None, eager_ms: 4.0, hf_ms: None },
        ];
        let hf = HfInfo { compiled: true, transformers: "5.0".into(), torch: "2.11".into() };
        let md = markdown_rows("d", "dev", "m", "bf16", &rows, Some(&hf));
        assert_eq!(md[0], "| d | dev | m | bf16; HF: transformers 5.0 static cache + torch.compile | 1 | 10.000 | 2.000 | 500 | 5.000 | 2.50x |");
        assert_eq!(md[1], "| d | dev | m | bf16; HF: transformers 5.0 static cache + torch.compile | 64 | 4.000 | — | 16000 | — | — |");
        let text = add(&md);
        assert!(text.contains("## Decode steps") && text.lines().filter(|l| l.starts_with("| d |")).count() == 2);
    }

    fn add(rows: &[String]) -> String {
        rows.iter().fold(String::from("# Benchmarks\n"), |t, r| {
            super::super::report::add_row_or_section(&t, TABLE, r, "## Decode steps")
        })
    }
}
