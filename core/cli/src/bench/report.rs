//! The pure parts of `rlhf bench`: medians, the FLOPs model and MFU, peak throughput of known
//! GPUs, the device name, and the `BENCHMARKS.md` row.
//!
//! FLOPs per trained token (forward + backward), PaLM's model-FLOPs formula (Chowdhery et al. 2022,
//! appendix B):
//!
//! ```text
//! flops/token = 6·N + 12·L·H·T
//! N = parameters that multiply activations: per layer q, k, v, o and the MLP (3·d·I gated, 2·d·I
//!     for GPT-2), plus the LM head d·V (embedding look-ups, norms and biases are not counted)
//! L = layers, H = heads × head_dim, T = sequence length (full T×T attention, no causal discount)
//! MFU = flops/token × tokens/s / peak FLOP/s
//! ```
//!
//! A hybrid model's Gated DeltaNet layers count their projections in `N`, leave `L` to the
//! attention layers, and add what their recurrence costs (per token and value head, forward, in
//! chunks of `C` = 64 tokens: `6·dk·dv` reading and writing the state, `5·C·dk + 3·C·dv` for the
//! within-chunk products and the two triangular solves, as full `C×C` products like attention's
//! `T×T`), times 3 for forward and backward.

use std::fmt::Write as _;
use std::path::Path;

use rlhf_models::ArchConfig;

/// Median of `xs` (the mean of the two middle values for an even count); `None` when empty.
pub fn median(xs: &[f64]) -> Option<f64> {
    if xs.is_empty() {
        return None;
    }
    let mut v = xs.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    Some(if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 })
}

/// `Σ kv_heads · head_dim` over the layers that cache keys and values (not those reusing another
/// layer's).
pub fn cached_kv_width(a: &ArchConfig) -> i64 {
    (0..a.num_layers as usize)
        .filter(|&i| !a.is_linear(i) && a.kv_source(i).is_none())
        .map(|i| a.heads(i).kv_heads * a.heads(i).head_dim)
        .sum()
}

/// Layers with attention (all but the linear-attention ones).
pub fn attention_layers(a: &ArchConfig) -> i64 {
    (0..a.num_layers as usize).filter(|&i| !a.is_linear(i)).count() as i64
}

/// Forward FLOPs per token of every linear-attention layer's recurrence: the state terms
/// `6·dk·dv` per value head, plus with `chunk` > 0 the within-chunk terms (see the module docs).
pub fn linear_attn_flops(a: &ArchConfig, chunk: i64) -> f64 {
    let Some(l) = a.linear_attn else { return 0.0 };
    let layers = a.num_layers - attention_layers(a);
    let (dk, dv) = (l.key_head_dim as f64, l.value_head_dim as f64);
    let c = chunk as f64;
    layers as f64 * l.num_value_heads as f64 * (6.0 * dk * dv + 5.0 * c * dk + 3.0 * c * dv)
}

/// Forward + backward FLOPs per token of a sequence of `seq` tokens: `6·N + 12·L·H·T`.
pub fn train_flops_per_token(matmul_params: i64, layers: i64, attn_dim: i64, seq: i64) -> f64 {
    6.0 * matmul_params as f64 + 12.0 * layers as f64 * attn_dim as f64 * seq as f64
}

/// [`train_flops_per_token`] of model `a`: attention over its attention layers, and 3× the
/// forward recurrence of its linear-attention layers ([`linear_attn_flops`]).
pub fn train_flops(a: &ArchConfig, seq: i64) -> f64 {
    let attention = train_flops_per_token(a.matmul_params(), 1, a.attention_width(), seq);
    attention + 3.0 * linear_attn_flops(a, 64)
}

/// Model FLOPs utilisation in `[0, 1]`: achieved FLOP/s over `peak_tflops` × 10¹².
pub fn mfu(flops_per_token: f64, tokens_per_s: f64, peak_tflops: f64) -> f64 {
    flops_per_token * tokens_per_s / (peak_tflops * 1e12)
}

/// Dense peak TFLOP/s (no sparsity) of known GPUs for `bf16` (tensor cores) or f32 (plain FP32:
/// libtorch does not use TF32 for matmuls unless asked). Matched on the CUDA device name; the
/// more specific names come first.
const PEAKS: &[(&str, f64, f64)] = &[
    ("H200", 989.4, 66.9),
    ("H100 PCIe", 756.0, 51.2),
    ("H100 NVL", 835.0, 60.0),
    ("H100", 989.4, 66.9),
    ("A100", 312.0, 19.5),
    ("L40S", 362.1, 91.6),
    ("L4", 121.0, 30.3),
    ("A10G", 70.0, 31.2),
    ("A10", 125.0, 31.2),
];

/// Peak TFLOP/s of the GPU called `name` at this dtype, when known.
pub fn peak_tflops(name: &str, bf16: bool) -> Option<f64> {
    PEAKS.iter().find(|(k, _, _)| name.contains(k)).map(|&(_, b, f)| if bf16 { b } else { f })
}

/// `YYYY-MM-DD` (UTC) of a Unix time (Howard Hinnant's `civil_from_days`).
pub fn utc_date(unix_secs: u64) -> String {
    let z = (unix_secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

/// `1.23B`, `494.0M`, `61.2K`, `812`.
pub fn fmt_count(n: u64) -> String {
    let x = n as f64;
    if x >= 1e9 {
        format!("{:.2}B", x / 1e9)
    } else if x >= 1e6 {
        format!("{:.1}M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.1}K", x / 1e3)
    } else {
        n.to_string()
    }
}

/// A throughput with about four significant figures: `123456`, `1234`, `123.4`, `1.234`.
pub fn fmt_rate(x: f64) -> String {
    if x >= 1000.0 {
        format!("{x:.0}")
    } else if x >= 100.0 {
        format!("{x:.1}")
    } else if x >= 10.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.3}")
    }
}

/// Seconds with three significant figures at least: `12.3`, `1.23`, `0.123`, `0.0123`.
pub fn fmt_secs(x: f64) -> String {
    if x >= 10.0 {
        format!("{x:.1}")
    } else if x >= 1.0 {
        format!("{x:.2}")
    } else if x >= 0.1 {
        format!("{x:.3}")
    } else {
        format!("{x:.4}")
    }
}

/// `ours / TRL` peak memory in GB, with the ratio when both are known; — when ours is unknown.
pub fn fmt_rss(ours: Option<f64>, trl: Option<f64>) -> String {
    match (ours, trl) {
        (Some(o), Some(t)) if t > 0.0 => format!("{o:.2} / {t:.2} ({:.2}x)", o / t),
        (Some(o), _) => format!("{o:.2}"),
        (None, _) => "—".into(),
    }
}

/// The speed-up of ours over TRL, `N.NNx`.
pub fn fmt_ratio(ratio: f64) -> String {
    format!("{ratio:.2}x")
}

/// Medians of one RL step and of each of its phases, in seconds.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct RlFigures {
    pub step_s: f64,
    pub generate: f64,
    pub score: f64,
    pub old_logprobs: f64,
    pub reference: f64,
    pub values: f64,
    pub train: f64,
    /// The largest peak resident memory of the timed steps, in GB, and per phase (in the order
    /// of the fields above); `None` where the OS does not say.
    pub peak_rss_gb: Option<f64>,
    pub phase_peak_rss_gb: [Option<f64>; 6],
}

/// One line of `BENCHMARKS.md`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Row {
    pub date: String,
    pub device: String,
    /// Directory name and parameter count.
    pub model: String,
    pub settings: String,
    pub gen_tokens_per_s: Option<f64>,
    pub train_tokens_per_s: Option<f64>,
    /// In `[0, 1]`; `None` prints `n/a` when training ran, `—` when it did not.
    pub mfu: Option<f64>,
    pub rl: Option<RlFigures>,
    /// TRL step time over ours.
    pub vs_trl: Option<f64>,
    /// TRL's peak resident memory over its timed steps, in GB.
    pub trl_peak_rss_gb: Option<f64>,
}

/// The header `BENCHMARKS.md` starts with: what the columns mean, then the table head.
pub const HEADER: &str = "\
# Benchmarks

Rows are appended by `cargo xtask bench` (`rlhf bench --record BENCHMARKS.md`); `--no-record` skips it.
Every figure is the median of `--repeats` timed runs after one untimed warm-up run.

| column | meaning |
| --- | --- |
| date | UTC day of the run |
| device | CPU model name (`/proc/cpuinfo`, since 2026-11-24 with its widest vector extension, AVX2 or AVX-512, which decides libtorch's kernels; with the libtorch thread count) or CUDA device name; since 2026-11-23 also this machine's f32 (or bf16) GEMM peak and memory-copy bandwidth, measured in the same run |
| model | model directory name and its stored parameter count |
| settings | dtype; B = prompts per batch, G = samples per prompt (B·G sequences in every section); prompt/new = prompt and generated tokens of the gen and train sections; the RL prompts and their mean token length; repeats |
| gen tok/s | generated tokens/s: B·G sequences of `prompt` random tokens, `new` tokens each sampled (temperature 1, no EOS) with the KV cache, prefill included |
| train tok/s | trained tokens/s: forward + backward + AdamW step (with grad-norm clipping) over B·G × (prompt + new) tokens |
| MFU | model FLOPs utilisation of the train section: (6·N + 12·L·H·T) × train tok/s / peak FLOP/s; N = matmul parameters (q, k, v, o, MLP, LM head), L layers, H = heads × head dim, T = sequence length; peak from `--peak-tflops`, the GPU table (dense bf16 / FP32), or else the GEMM peak measured in the same run (CPU) |
| RL step s | one GRPO step of the real `Trainer` (B prompts × G samples, up to `new` tokens, one optimizer step), then its phases: generate / score / old log-probs / reference / values / train (medians each, so they need not add up to the step) |
| vs TRL | TRL `GRPOTrainer` step time / our RL step (`--vs-trl`, `xtask/scripts/trl_grpo_bench.py`): same weights, prompts, B, G, max new tokens, lr, beta, epsilon, loss_type `grpo`, one optimizer step per generation batch; TRL with gradient checkpointing exactly when ours has it (`--gradient-checkpointing`, said in settings) and with the weights in the same dtype (no autocast); its steps timed between `on_step_end` callbacks; `2.00x` = ours twice as fast; — when not run |
| peak RSS GB | the process's peak resident memory during the timed RL steps (Linux `VmHWM`, reset when they start), ours then TRL's (`--vs-trl`); the same model weights, optimizer state and batch on both sides |

Timings on a shared machine vary with its load; compare rows of the same device and settings.

| date | device | model | settings | gen tok/s | train tok/s | MFU | RL step s (gen / score / old / ref / val / train) | vs TRL | peak RSS GB (ours / TRL) |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
";

/// A table cell: `|` escaped, no line breaks.
fn cell(s: &str) -> String {
    s.replace('|', "\\|").replace(['\n', '\r'], " ")
}

/// The row as one Markdown table line (no trailing newline).
pub fn markdown_row(r: &Row) -> String {
    let dash = || "—".to_string();
    let mfu = match (r.mfu, r.train_tokens_per_s) {
        (Some(m), _) => format!("{:.1}%", 100.0 * m),
        (None, Some(_)) => "n/a".into(),
        (None, None) => dash(),
    };
    let rl = r.rl.as_ref().map_or_else(dash, |f| {
        let parts = [f.generate, f.score, f.old_logprobs, f.reference, f.values, f.train].map(fmt_secs);
        format!("{} ({})", fmt_secs(f.step_s), parts.join(" / "))
    });
    let mut line = String::new();
    let cells = [
        cell(&r.date),
        cell(&r.device),
        cell(&r.model),
        cell(&r.settings),
        r.gen_tokens_per_s.map_or_else(dash, fmt_rate),
        r.train_tokens_per_s.map_or_else(dash, fmt_rate),
        mfu,
        rl,
        r.vs_trl.map_or_else(dash, fmt_ratio),
        fmt_rss(r.rl.as_ref().and_then(|f| f.peak_rss_gb), r.trl_peak_rss_gb),
    ];
    for c in cells {
        let _ = write!(line, "| {c} ");
    }
    line.push('|');
    line
}

/// `text` with `row` inserted after the last line of the table whose column line is `head`, or
/// `None` when `text` has no such table.
pub fn insert_into_table(text: &str, head: &str, row: &str) -> Option<String> {
    let mut lines: Vec<&str> = text.lines().collect();
    let start = lines.iter().position(|l| *l == head)?;
    let end = lines[start..].iter().position(|l| !l.starts_with('|')).map_or(lines.len(), |k| start + k);
    lines.insert(end, row);
    Some(lines.join("\n") + "\n")
}

/// `text` with `row` added to `table` (its header and separator lines), or, when `text` has no
/// such table, with `intro` (a section heading and its text) and the table with `row` appended.
pub fn add_row_or_section(text: &str, table: &str, row: &str, intro: &str) -> String {
    let head = table.lines().next().unwrap_or("");
    insert_into_table(text, head, row).unwrap_or_else(|| format!("{}\n\n{intro}\n\n{table}{row}\n", text.trim_end()))
}

/// Adds `row` to the results table of `path` (other tables may follow it), writing [`HEADER`]
/// first when the file is new or empty.
pub fn append_row(path: &Path, row: &Row) -> anyhow::Result<()> {
    let old = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => anyhow::bail!("{}: {e}", path.display()),
    };
    let line = markdown_row(row);
    let head = HEADER.lines().rev().nth(1).unwrap_or("");
    let text = match insert_into_table(&old, head, &line) {
        Some(t) => t,
        None if old.trim().is_empty() => format!("{HEADER}{line}\n"),
        None => format!("{}\n{line}\n", old.trim_end_matches('\n')),
    };
    std::fs::write(path, text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_odd_even_empty() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0]), Some(3.0));
        assert_eq!(median(&[5.0, 1.0, 3.0]), Some(3.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        // An outlier does not move it.
        assert_eq!(median(&[1.0, 1.0, 100.0]), Some(1.0));
    }

    fn fixture_arch(name: &str) -> ArchConfig {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../integration-tests/fixtures/models").join(name);
        rlhf_models::ModelConfig::from_dir(&dir).unwrap().arch
    }

    #[test]
    fn flops_formula_by_hand() {
        // Llama fixture, d 32, 4 heads of 8, 2 KV heads, I 64, V 400, 2 layers. Per layer:
        // q 32·32 + k, v 2·32·16 + o 32·32 = 3072; gated MLP 3·32·64 = 6144. LM head 32·400 = 12800.
        assert_eq!(fixture_arch("llama").matmul_params(), 2 * (3072 + 6144) + 12800);
        // GPT-2 fixture, d 32, I 4·32: c_attn 32·96 + c_proj 32·32 = 4096; MLP 2·32·128 = 8192.
        assert_eq!(fixture_arch("gpt2").matmul_params(), 2 * (4096 + 8192) + 12800);
        // 6·1000 + 12·2·8·10 = 7920.
        assert_eq!(train_flops_per_token(1000, 2, 8, 10), 7920.0);
        assert_eq!(train_flops(&fixture_arch("llama"), 10), 6.0 * 31232.0 + 12.0 * 2.0 * 32.0 * 10.0);
        // 1e12 FLOP/s of a 2 TFLOP/s peak is half.
        assert!((mfu(1e9, 1000.0, 2.0) - 0.5).abs() < 1e-12);
    }

    #[test]
    fn hybrid_flops_by_hand() {
        let dir = tempfile::tempdir().unwrap();
        let config = serde_json::json!({
            "model_type": "qwen3_5_text", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
            "linear_value_head_dim": 8
        });
        std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
        let a = rlhf_models::ModelConfig::from_dir(dir.path()).unwrap().arch;
        // Gated attention: q and its gate 32·128 + k, v 2·32·32 + o 64·32 = 8192. Gated DeltaNet:
        // in_proj_{qkv,z,b,a} 32·(64 + 32 + 4 + 4) + out_proj 32·32 = 4352. MLP 3·32·64; head 32·100.
        assert_eq!(a.matmul_params(), 8192 + 2 * 4352 + 3 * 6144 + 3200);
        assert_eq!(attention_layers(&a), 1);
        // Two linear layers of 4 value heads: 6·8·8 + 5·64·8 + 3·64·8 = 4480 each.
        assert_eq!(linear_attn_flops(&a, 64), 2.0 * 4.0 * 4480.0);
        let want = 6.0 * a.matmul_params() as f64 + 12.0 * 64.0 * 10.0 + 3.0 * 2.0 * 4.0 * 4480.0;
        assert_eq!(train_flops(&a, 10), want);
    }

    #[test]
    fn gemma4_flops_by_hand() {
        let dir = tempfile::tempdir().unwrap();
        let config = serde_json::json!({
            "model_type": "gemma4_text", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "global_head_dim": 16, "attention_k_eq_v": true, "num_global_key_value_heads": 1,
            "num_kv_shared_layers": 1, "use_double_wide_mlp": true, "hidden_size_per_layer_input": 4,
            "vocab_size_per_layer_input": 100,
            "layer_types": ["sliding_attention", "full_attention", "full_attention"]
        });
        std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
        let a = rlhf_models::ModelConfig::from_dir(dir.path()).unwrap().arch;
        // Sliding layer 0: q 32·32 + k, v 2·32·16 + o 32·32 = 3072. Full layer 1 (heads of 16, one
        // KV head, values = keys): q 32·64 + k 32·16 + o 64·32 = 4608. Full layer 2 reuses layer 1's
        // keys and values: q + o = 4096. MLPs 3·32·64 twice and 3·32·128 once; per-layer inputs
        // 3·32·4 per layer; head 32·100.
        let want = 3072 + 4608 + 4096 + 2 * 6144 + 12288 + 3 * 384 + 3200;
        assert_eq!(a.matmul_params(), want);
        assert_eq!((a.attention_width(), cached_kv_width(&a)), (32 + 64 + 64, 16 + 16));
        // With top-2 of 4 experts of 6 beside each MLP: router 32·4 and two experts 3·32·6 per layer.
        let mut moe = config.clone();
        let extra = serde_json::json!({"enable_moe_block": true, "num_experts": 4, "top_k_experts": 2,
            "moe_intermediate_size": 6});
        moe.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        std::fs::write(dir.path().join("config.json"), moe.to_string()).unwrap();
        let a = rlhf_models::ModelConfig::from_dir(dir.path()).unwrap().arch;
        assert_eq!(a.matmul_params(), want + 3 * (32 * 4 + 2 * 3 * 32 * 6));
    }

    #[test]
    fn peaks_by_device_name() {
        assert_eq!(peak_tflops("NVIDIA H100 80GB HBM3", true), Some(989.4));
        assert_eq!(peak_tflops("NVIDIA H100 PCIe", true), Some(756.0));
        assert_eq!(peak_tflops("NVIDIA H200", false), Some(66.9));
        assert_eq!(peak_tflops("NVIDIA A10G", true), Some(70.0));
        assert_eq!(peak_tflops("NVIDIA GeForce GTX 1080", true), None);
    }

    #[test]
    fn utc_dates() {
        assert_eq!(utc_date(0), "1970-01-01");
        assert_eq!(utc_date(951_782_400), "2000-02-29");
        assert_eq!(utc_date(1_763_769_600), "2025-11-22");
    }

    #[test]
    fn number_formats() {
        assert_eq!(fmt_count(494_032_768), "494.0M");
        assert_eq!(fmt_count(1_543_714_304), "1.54B");
        assert_eq!(fmt_count(61_248), "61.2K");
        assert_eq!(fmt_count(12), "12");
        assert_eq!(fmt_rate(123_456.7), "123457");
        assert_eq!(fmt_rate(12.345), "12.35");
        assert_eq!(fmt_secs(0.01234), "0.0123");
        assert_eq!(fmt_ratio(2.0), "2.00x");
        assert_eq!(fmt_ratio(0.456), "0.46x");
    }

    #[test]
    fn markdown_rows() {
        let full = Row {
            date: "2025-11-22".into(),
            device: "AMD EPYC (2 threads)".into(),
            model: "llama (180.5K)".into(),
            settings: "f32, B=2, G=4".into(),
            gen_tokens_per_s: Some(1234.5),
            train_tokens_per_s: Some(98.76),
            mfu: Some(0.1234),
            rl: Some(RlFigures {
                step_s: 1.5,
                generate: 0.5,
                score: 0.001,
                old_logprobs: 0.1,
                reference: 0.1,
                values: 0.0,
                train: 0.75,
                peak_rss_gb: Some(3.456),
                phase_peak_rss_gb: [Some(3.0), None, None, None, None, Some(3.456)],
            }),
            vs_trl: Some(2.456),
            trl_peak_rss_gb: Some(6.912),
        };
        assert_eq!(
            markdown_row(&full),
            "| 2025-11-22 | AMD EPYC (2 threads) | llama (180.5K) | f32, B=2, G=4 | 1234 | 98.76 | 12.3% \
             | 1.50 (0.500 / 0.0010 / 0.100 / 0.100 / 0.0000 / 0.750) | 2.46x | 3.46 / 6.91 (0.50x) |"
        );
        let gen_only = Row {
            date: "d".into(),
            device: "a|b".into(),
            model: "m".into(),
            settings: "s".into(),
            gen_tokens_per_s: Some(5.0),
            ..Row::default()
        };
        assert_eq!(markdown_row(&gen_only), "| d | a\\|b | m | s | 5.000 | — | — | — | — | — |");
        let cpu_train = Row { train_tokens_per_s: Some(10.0), ..gen_only };
        assert!(markdown_row(&cpu_train).contains("| 10.00 | n/a | — | — | — |"), "{}", markdown_row(&cpu_train));
        // The header's table has as many columns as a row.
        let head = HEADER.lines().rev().nth(1).unwrap();
        assert_eq!(head.matches(" | ").count(), markdown_row(&full).matches(" | ").count());
    }

    #[test]
    fn append_writes_header_once() {
        let dir = std::env::temp_dir().join(format!("rlhf-bench-report-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("BENCHMARKS.md");
        let _ = std::fs::remove_file(&path);
        let row = Row { date: "d".into(), ..Row::default() };
        append_row(&path, &row).unwrap();
        append_row(&path, &row).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.starts_with("# Benchmarks"));
        assert_eq!(text.matches("# Benchmarks").count(), 1);
        assert_eq!(text.matches("| d |").count(), 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
