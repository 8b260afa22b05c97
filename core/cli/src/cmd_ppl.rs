//! `rlhf ppl`: perplexity of a JSONL file's `text` fields under a model; a line's `images` (paths
//! relative to the file, or `{bytes, path}` structs as `datasets` writes them) fill its `<image>`
//! markers for a model that reads images.

use std::path::{Path, PathBuf};

use anyhow::Context;

use rlhf_trainer::prompt_images::PromptImages;
use rlhf_vision::prompt::{images_of, IMAGE_MARKER};
use rlhf_vision::ImageRef;

use crate::common::ModelArgs;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// JSONL file; every non-blank line is an object with a string `text` (and, for a model that
    /// reads images, optionally `images` for its `<image>` markers).
    #[arg(long)]
    data: PathBuf,
    /// Sequences per forward pass.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Print `{"ppl": .., "nll": .., "tokens": ..}` as the last line of stdout.
    #[arg(long)]
    json: bool,
}

/// One line of the file: its text and its images.
pub struct Line {
    pub text: String,
    pub images: Vec<ImageRef>,
}

/// Reads every non-blank line's `text` and `images`; errors name the file and line.
pub fn read_lines(path: &Path) -> anyhow::Result<Vec<Line>> {
    let content = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
    let base = path.parent().unwrap_or(Path::new("."));
    let mut lines = Vec::new();
    for (i, line) in content.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = format!("{}:{}", path.display(), i + 1);
        let value: serde_json::Value =
            serde_json::from_str(line).map_err(|e| anyhow::anyhow!("{at}: not valid JSON: {e}"))?;
        let text = match value.get("text") {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(other) => anyhow::bail!("{at}: text: expected a string, got {other}"),
            None => anyhow::bail!("{at}: missing key `text`"),
        };
        let images = match value.get("images") {
            Some(v) => images_of(v, base, &at).map_err(anyhow::Error::msg)?,
            None => Vec::new(),
        };
        lines.push(Line { text, images });
    }
    if lines.is_empty() {
        anyhow::bail!("{}: no data (the file has no lines)", path.display());
    }
    Ok(lines)
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let lines = read_lines(&args.data)?;
    let (model, tok) = args.model.load_lm_and_tokenizer()?;
    let with_images = lines.iter().any(|l| !l.images.is_empty() || l.text.contains(IMAGE_MARKER));
    let vision = match with_images {
        true => PromptImages::for_model(model.source_dir(), model.arch(), &tok)?,
        false => None,
    };
    if with_images && vision.is_none() {
        anyhow::bail!("{}: lines hold images, and {} reads none", args.data.display(), args.model.model.display());
    }
    let (mut seqs, mut images) = (Vec::with_capacity(lines.len()), Vec::with_capacity(lines.len()));
    for (i, l) in lines.iter().enumerate() {
        let ids = match &vision {
            Some(v) => {
                let at = format!("{}: line {}", args.data.display(), i + 1);
                images.push(v.patches(&l.images)?);
                v.expand(&l.text, &tok, true, &l.images, &at)?.1
            }
            None => tok.encode(&l.text, true)?,
        };
        seqs.push(ids.into_iter().map(i64::from).collect::<Vec<_>>());
    }
    let pad = i64::from(tok.pad_token_id());
    let images = vision.as_ref().map(|_| images.as_slice());
    let r = rlhf_generation::perplexity_with_images(&model, &seqs, images, args.batch_size, pad)
        .with_context(|| format!("{}", args.data.display()))?;
    if args.json {
        println!("{}", serde_json::json!({ "ppl": r.ppl, "nll": r.nll, "tokens": r.tokens }));
    } else {
        println!("ppl {:.6}  (mean nll {:.6} over {} predicted tokens, {} lines)", r.ppl, r.nll, r.tokens, lines.len());
    }
    Ok(())
}
