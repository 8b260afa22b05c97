//! `rlhf ppl`: perplexity of a JSONL file's `text` fields under a model.

use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::common::ModelArgs;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// JSONL file; every non-blank line is an object with a string `text`.
    #[arg(long)]
    data: PathBuf,
    /// Sequences per forward pass.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Print `{"ppl": .., "nll": .., "tokens": ..}` as the last line of stdout.
    #[arg(long)]
    json: bool,
}

/// Reads the `text` field of every non-blank line; errors name the file and line.
pub fn read_texts(path: &Path) -> anyhow::Result<Vec<String>> {
    let content = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
    let mut texts = Vec::new();
    for (i, line) in content.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| anyhow::anyhow!("{}:{}: not valid JSON: {e}", path.display(), i + 1))?;
        match value.get("text") {
            Some(serde_json::Value::String(s)) => texts.push(s.clone()),
            Some(other) => anyhow::bail!("{}:{}: text: expected a string, got {other}", path.display(), i + 1),
            None => anyhow::bail!("{}:{}: missing key `text`", path.display(), i + 1),
        }
    }
    if texts.is_empty() {
        anyhow::bail!("{}: no data (the file has no lines)", path.display());
    }
    Ok(texts)
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let texts = read_texts(&args.data)?;
    let (model, tok) = args.model.load_lm_and_tokenizer()?;
    let mut seqs = Vec::with_capacity(texts.len());
    for t in &texts {
        seqs.push(tok.encode(t, true)?.into_iter().map(i64::from).collect::<Vec<_>>());
    }
    let r = rlhf_generation::perplexity(&model, &seqs, args.batch_size, i64::from(tok.pad_token_id()))
        .with_context(|| format!("{}", args.data.display()))?;
    if args.json {
        println!("{}", serde_json::json!({ "ppl": r.ppl, "nll": r.nll, "tokens": r.tokens }));
    } else {
        println!("ppl {:.6}  (mean nll {:.6} over {} predicted tokens, {} lines)", r.ppl, r.nll, r.tokens, texts.len());
    }
    Ok(())
}
