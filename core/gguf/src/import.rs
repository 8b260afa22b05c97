//! GGUF → Hugging Face directory for the architectures llama.cpp writes as `llama`, `qwen2`,
//! `qwen3`, `qwen3moe`, `gemma2`, `gemma3`, `gemma4`, `phi3`, `olmo2` (OLMo 2 and 3), `gpt-oss`,
//! `qwen35`, `qwen35moe` and `qwen3next`: `model.safetensors` (dequantised), `config.json`
//! (`LlamaForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`,
//! `Gemma2ForCausalLM`, `Gemma3ForCausalLM`, `Gemma4ForCausalLM`, `Phi3ForCausalLM`, `Olmo2ForCausalLM`,
//! `Olmo3ForCausalLM`, `GptOssForCausalLM`, `Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`,
//! `Qwen3NextForCausalLM`; [`crate::params`]), `generation_config.json`, `tokenizer.json`,
//! `tokenizer_config.json` ([`crate::tokenizer`]). Qwen2's q/k/v biases and Qwen3's per-head q/k
//! norms (`attn_q_norm`, `attn_k_norm`) map to their transformers names; Qwen3-MoE's router
//! (`ffn_gate_inp`) to `mlp.gate`, and its stacked experts (`ffn_{gate,up,down}_exps`,
//! `[experts, out, in]`) are split into transformers' one tensor per expert
//! (`mlp.experts.{e}.{gate,up,down}_proj`). llama.cpp's Qwen3-MoE always renormalises the top-k
//! routing weights (`norm_topk_prob: true`, as transformers' GGUF loader sets it).
//!
//! How llama.cpp's tensor layout maps to transformers' is in [`crate::layout`].

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::error::{GgufError, Result};
use crate::layout::{
    gate_up_interleaved, hf_name, is_mtp_block, norm_shifted, required_names, transpose_last, unpermute_rows, EXPERT,
};
use crate::linear::{a_log, is_a_log, qkvz_grouped, untile};
use crate::params::{architecture, eos_value, LlamaParams, OutDtype};
use crate::reader::{GgufFile, TensorInfo};
use crate::rope::ROPE_FACTORS;
use crate::streamed::Streamed;
use crate::tokenizer::{self, SpecialIds};
use crate::transform::Transform;

/// The files an import writes, all of which must exist for an import to be complete.
pub const OUTPUT_FILES: [&str; 5] =
    ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"];

/// What an import did.
#[derive(Debug, Clone)]
pub struct ImportSummary {
    pub architecture: String,
    pub params: LlamaParams,
    pub dtype: OutDtype,
    /// Tensors written.
    pub tensors: usize,
    /// Elements written.
    pub parameters: u64,
    /// GGUF tensor types and how many tensors had each.
    pub source_types: Vec<(String, usize)>,
    pub special: SpecialIds,
    pub duplicate_tokens: usize,
    /// Tensors of the file left out: Qwen3.5's multi-token-prediction blocks.
    pub skipped: usize,
    pub files: Vec<PathBuf>,
}

struct Planned<'a> {
    info: &'a TensorInfo,
    /// With `{e}` for the expert where the tensor stacks the experts (`shape[0]` of them), each
    /// written as a tensor of its own.
    hf_name: String,
    /// transformers' (the file's with its dims reversed, up to dimensions of size 1).
    shape: Vec<usize>,
    transform: Transform,
}

impl Planned<'_> {
    /// How many tensors this one is written as: one per expert where it stacks them.
    fn expert_count(&self) -> usize {
        if self.hf_name.contains(EXPERT) {
            self.shape[0]
        } else {
            1
        }
    }
}

/// Imports a `llama`, `qwen2`, `qwen3`, `qwen3moe`, `gemma2`, `gemma3`, `gemma4`, `phi3`, `olmo2`, `gpt-oss`,
/// `qwen35`, `qwen35moe` or `qwen3next` GGUF into `out` (created if needed; existing files of the
/// same names are overwritten).
/// Everything is checked — architecture, tensor names, shapes, types, tokenizer — before the first
/// file is written.
pub fn import_llama(g: &GgufFile, out: &Path, dtype: OutDtype) -> Result<ImportSummary> {
    let path = g.path();
    let arch = architecture(g)?.to_owned();
    let params = LlamaParams::from_gguf(g)?;
    let (planned, types, skipped) = plan(g, &params)?;
    let tok = tokenizer::build(g, &arch, params.max_position_embeddings)?;
    if tok.n_tokens as u64 > params.vocab_size {
        return Err(GgufError::invalid(
            path,
            format!("{} tokens but the embedding has only {} rows", tok.n_tokens, params.vocab_size),
        ));
    }
    let (weights, written, parameters) = write_weights(g, &planned, &params, dtype, out)?;

    let mut generation = serde_json::Map::new();
    if let Some(b) = tok.special.bos {
        generation.insert("bos_token_id".into(), json!(b));
    }
    generation.insert("eos_token_id".into(), eos_value(&tok.special));
    if let Some(p) = tok.special.pad {
        generation.insert("pad_token_id".into(), json!(p));
    }
    let mut files = vec![weights];
    for (name, value) in [
        ("config.json", params.hf_config(&tok.special, dtype)),
        ("generation_config.json", Value::Object(generation)),
        ("tokenizer.json", tok.tokenizer_json),
        ("tokenizer_config.json", tok.tokenizer_config),
    ] {
        let file = out.join(name);
        let text = serde_json::to_string_pretty(&value).expect("JSON values serialise");
        std::fs::write(&file, text + "\n").map_err(|e| GgufError::io(&file, e))?;
        files.push(file);
    }
    Ok(ImportSummary {
        architecture: arch,
        params,
        dtype,
        tensors: written,
        parameters,
        source_types: types,
        special: tok.special,
        duplicate_tokens: tok.duplicate_tokens,
        skipped,
        files,
    })
}

/// GGUF tensor types and how many tensors had each.
type TypeCounts = Vec<(String, usize)>;

/// Every tensor of the file with its HF name, checked: known, of the right shape, dequantisable;
/// and every tensor the architecture needs present. With the count of each GGUF tensor type and
/// of the tensors left out.
fn plan<'a>(g: &'a GgufFile, params: &LlamaParams) -> Result<(Vec<Planned<'a>>, TypeCounts, usize)> {
    let path = g.path();
    let mut planned = Vec::with_capacity(g.tensors.len());
    let mut unknown = Vec::new();
    let mut types: TypeCounts = Vec::new();
    let mut skipped = 0;
    for info in &g.tensors {
        if params.architecture == "phi3" && ROPE_FACTORS.contains(&info.name.as_str()) {
            continue; // read into the config's `rope_scaling`
        }
        if params.gemma4.is_some() && info.name == "rope_freqs.weight" {
            continue; // read into the config's `partial_rotary_factor`
        }
        if is_mtp_block(&info.name, params) {
            skipped += 1;
            continue;
        }
        let Some((hf, transform, expected)) = hf_name(&info.name, params) else {
            unknown.push(info.name.clone());
            continue;
        };
        let shape: Vec<u64> = info.dims.iter().rev().copied().collect();
        // A `[1, n]` weight may be stored as `[n]`, a `[c, 1, k]` one as `[c, k]`.
        let squeezed = |s: &[u64]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<u64>>();
        if shape != expected && squeezed(&shape) != squeezed(&expected) {
            return Err(GgufError::invalid(
                path,
                format!("tensor `{}` has shape {shape:?} (dims reversed), expected {expected:?} for `{hf}`", info.name),
            ));
        }
        if !info.ggml_type.can_dequantize() {
            return Err(GgufError::unsupported(
                path,
                format!(
                    "tensor `{}` is {}, which this importer cannot dequantise (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, MXFP4)",
                    info.name, info.ggml_type
                ),
            ));
        }
        match types.iter_mut().find(|(t, _)| t == info.ggml_type.name()) {
            Some((_, n)) => *n += 1,
            None => types.push((info.ggml_type.name().to_owned(), 1)),
        }
        planned.push(Planned { info, hf_name: hf, shape: expected.iter().map(|&d| d as usize).collect(), transform });
    }
    if !unknown.is_empty() {
        unknown.truncate(10);
        return Err(GgufError::unsupported(
            path,
            format!("tensors with no {} counterpart in transformers: {}", params.architecture, unknown.join(", ")),
        ));
    }
    let have: HashMap<&str, ()> = planned.iter().map(|p| (p.hf_name.as_str(), ())).collect();
    if let Some(missing) = required_names(params).iter().find(|n| !have.contains_key(n.as_str())) {
        return Err(GgufError::invalid(path, format!("no tensor for `{missing}`")));
    }
    check_sources(g, &planned)?;
    // The one check of values: before anything is written.
    for p in planned.iter().filter(|p| is_a_log(&p.hf_name)) {
        to_a_log(g, p.info, &mut g.dequantize(p.info)?)?;
    }
    Ok((planned, types, skipped))
}

/// `A = −exp(A_log)` as llama.cpp stores it (`tensor`'s values) back to `A_log`; refused where an
/// `A` is not negative.
fn to_a_log(g: &GgufFile, tensor: &TensorInfo, values: &mut [f32]) -> Result<()> {
    a_log(values).map_err(|a| {
        GgufError::invalid(
            g.path(),
            format!("`{}` holds {a}, but llama.cpp stores A = −exp(A_log), always negative", tensor.name),
        )
    })
}

/// Every HF tensor comes from one tensor of the file — or from its two parts once each: the gate
/// and up experts of a `gate_up_proj` (gpt-oss, the hybrid Qwens) or its bias, the q/k/v and z
/// rows of Qwen3-Next's `in_proj_qkvz`.
fn check_sources(g: &GgufFile, planned: &[Planned]) -> Result<()> {
    // In the file's order, so a refusal names the first tensor at fault, run after run.
    let mut sources: HashMap<&str, Vec<Transform>> = HashMap::new();
    let mut order = Vec::new();
    for p in planned {
        let kinds = sources.entry(p.hf_name.as_str()).or_default();
        if kinds.is_empty() {
            order.push(p.hf_name.as_str());
        }
        kinds.push(p.transform);
    }
    for name in order {
        let kinds = &sources[name];
        let parts: Vec<Option<usize>> = kinds.iter().map(|t| t.part()).collect();
        let pair = parts.len() == 2 && parts.contains(&Some(0)) && parts.contains(&Some(1));
        if kinds.len() > 1 && !pair {
            return Err(GgufError::invalid(g.path(), format!("{} tensors of the file make `{name}`", kinds.len())));
        }
        if kinds.len() == 1 && parts[0].is_some() {
            let what = match kinds[0] {
                Transform::Qkv | Transform::Z => "the q/k/v rows (`attn_qkv`) and the z rows (`attn_gate`)",
                _ => "the gate and the up experts (or the two stacked)",
            };
            return Err(GgufError::invalid(g.path(), format!("`{name}` needs {what}; the file has one of them")));
        }
    }
    Ok(())
}

/// Puts `p`'s part into `slot` — a gate or up half (`[experts, inter, cols]`; a bias has no
/// `cols`), both stacked (gpt-oss's `[experts, 2 · inter, cols]`, each expert's gate rows first),
/// or Qwen3-Next's q/k/v or z rows — and once both are there, transformers' tensor and its shape:
/// gpt-oss's interleaved `gate_up_proj` ([`gate_up_interleaved`]), the hybrid Qwens' stacked one
/// (`[experts, 2 · inter, cols]`), or Qwen3-Next's `in_proj_qkvz` ([`qkvz_grouped`]).
fn join_parts(
    slot: &mut [Option<Vec<f32>>; 2],
    p: &Planned,
    values: Vec<f32>,
    params: &LlamaParams,
) -> Option<(Vec<f32>, Vec<usize>)> {
    let s = &p.shape;
    let mut inter = s[1];
    match p.transform.part() {
        Some(i) => slot[i] = Some(values),
        None => {
            // `GateUp`: split into the two halves.
            inter /= 2;
            let per = values.len() / s[0];
            let (gate, up): (Vec<&[f32]>, Vec<&[f32]>) = values.chunks(per).map(|e| e.split_at(per / 2)).unzip();
            *slot = [Some(gate.concat()), Some(up.concat())];
        }
    }
    if slot.iter().any(Option::is_none) {
        return None;
    }
    let [Some(first), Some(second)] = slot.each_mut().map(Option::take) else { return None };
    if let (Transform::Qkv | Transform::Z, Some(l)) = (p.transform, params.linear) {
        let cols = s[1];
        let joined = qkvz_grouped(&first, &second, &l);
        let rows = joined.len() / cols;
        return Some((joined, vec![rows, cols]));
    }
    if params.linear.is_some() || params.gemma4.is_some() {
        // Stacked, each expert's gate rows first.
        let per = first.len() / s[0];
        let joined: Vec<f32> =
            first.chunks(per).zip(second.chunks(per)).flat_map(|(g, u)| g.iter().chain(u).copied()).collect();
        return Some((joined, vec![s[0], 2 * inter, s[2]]));
    }
    let joined = gate_up_interleaved(&first, &second, s[0], inter);
    let shape = match s.get(2) {
        Some(&cols) => vec![s[0], cols, 2 * inter],
        None => vec![s[0], 2 * inter],
    };
    Some((joined, shape))
}

/// Dequantises (un-permuting, un-shifting and splitting where the layout says) and writes
/// `out/model.safetensors` (making `out`) one tensor at a time ([`Streamed`]); returns its path,
/// the tensors written and their elements. On an error nothing of it is left (nor `out`, if this
/// made it and it is empty).
fn write_weights(
    g: &GgufFile,
    planned: &[Planned],
    params: &LlamaParams,
    dtype: OutDtype,
    out: &Path,
) -> Result<(PathBuf, usize, u64)> {
    let made = !out.exists();
    std::fs::create_dir_all(out).map_err(|e| GgufError::io(out, e))?;
    let weights = out.join("model.safetensors");
    // A bound on the header: per tensor written (each expert's apart), its name, an expert's
    // number, and at most 200 bytes of dtype, a shape of 4 dims and 2 offsets with their JSON.
    let room = 64 + planned.iter().map(|p| p.expert_count() * (p.hf_name.len() + 24 + 200)).sum::<usize>();
    let written = Streamed::create(&weights, dtype.safetensors_name(), room)
        .and_then(|file| stream_weights(g, planned, params, dtype, file));
    if written.is_err() && made {
        let _ = std::fs::remove_dir(out); // only if empty
    }
    let (tensors, parameters) = written?;
    Ok((weights, tensors, parameters))
}

/// [`write_weights`] into `file`: the tensors written and their elements.
fn stream_weights(
    g: &GgufFile,
    planned: &[Planned],
    params: &LlamaParams,
    dtype: OutDtype,
    mut file: Streamed,
) -> Result<(usize, u64)> {
    let mut parameters = 0u64;
    let bytes = |values: &[f32]| -> Vec<u8> {
        match dtype {
            OutDtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            OutDtype::Bf16 => values.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect(),
        }
    };
    // Two-part tensors' first parts by HF name, until both are read.
    let mut halves: HashMap<&str, [Option<Vec<f32>>; 2]> = HashMap::new();
    let heads = params.linear.map(|l| (l.key_heads as usize, (l.value_heads / l.key_heads) as usize));
    for p in planned {
        let values = g.dequantize(p.info)?;
        parameters += values.len() as u64;
        let s = &p.shape;
        let (mut values, shape) = match p.transform {
            Transform::Plain => (values, s.clone()),
            Transform::Unpermute(n_head) => (unpermute_rows(&values, s[0], s[1], n_head as usize), s.clone()),
            Transform::Transpose => (transpose_last(&values, s[0], s[1], s[2]), vec![s[0], s[2], s[1]]),
            Transform::Gate | Transform::Up | Transform::GateUp | Transform::Qkv | Transform::Z => {
                let slot = halves.entry(p.hf_name.as_str()).or_default();
                match join_parts(slot, p, values, params) {
                    Some(joined) => joined,
                    None => continue,
                }
            }
            Transform::Untile { start, head_dim } => {
                let heads = heads.expect("only hybrid files untile");
                (untile(&values, s[0], (start as usize, head_dim as usize), heads, true), s.clone())
            }
            Transform::UntileColumns { head_dim } => {
                let heads = heads.expect("only hybrid files untile");
                (untile(&values, s[0], (0, head_dim as usize), heads, false), s.clone())
            }
        };
        if norm_shifted(&p.hf_name, params) {
            values.iter_mut().for_each(|v| *v -= 1.0);
        }
        if is_a_log(&p.hf_name) {
            to_a_log(g, p.info, &mut values)?;
        }
        if p.hf_name.contains(EXPERT) {
            // `[experts, out, in]`, one `[out, in]` tensor per expert.
            let per = values.len() / shape[0];
            for (e, chunk) in values.chunks(per).enumerate() {
                file.push(p.hf_name.replace(EXPERT, &e.to_string()), shape[1..].to_vec(), &bytes(chunk))?;
            }
        } else {
            file.push(p.hf_name.clone(), shape, &bytes(&values))?;
        }
    }
    Ok((file.finish(&[("format", "pt")])?, parameters))
}
