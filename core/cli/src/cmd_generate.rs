//! `rlhf generate`: batched generation from the command line (with images, for a model that reads
//! them: `<image>` markers in the prompts, `--image` files in their order).

use rlhf_generation::{
    batch::to_rows, generate, generate_with_images, left_pad, GenerateConfig, GenerationError, Sampling,
};
use rlhf_tokenizer::ChatMessage;
use rlhf_trainer::prompt_images::PromptImages;
use rlhf_vision::prompt::IMAGE_MARKER;
use rlhf_vision::ImageRef;

use crate::common::ModelArgs;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt text; repeat for a batch (left-padded together).
    #[arg(long, required = true)]
    prompt: Vec<String>,
    /// Wrap each prompt as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// An image file for a model that reads images; repeat for several. The prompts' `<image>`
    /// markers take them in order.
    #[arg(long)]
    image: Vec<std::path::PathBuf>,
    #[arg(long, default_value_t = 64)]
    max_new_tokens: i64,
    /// 0 means greedy decoding.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    #[arg(long)]
    top_p: Option<f64>,
    #[arg(long)]
    top_k: Option<i64>,
    #[arg(long)]
    seed: Option<u64>,
    /// Print one JSON object per prompt: {"prompt_ids", "response_ids", "text"}.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if !(args.temperature.is_finite() && args.temperature >= 0.0) {
        anyhow::bail!("--temperature {}: must be a finite number >= 0 (0 = greedy)", args.temperature);
    }
    if let Some(p) = args.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
        anyhow::bail!("--top-p {p}: must be in (0, 1]");
    }
    if let Some(k) = args.top_k.filter(|k| *k < 0) {
        anyhow::bail!("--top-k {k}: must be >= 0 (0 = no limit)");
    }
    if args.max_new_tokens < 1 {
        anyhow::bail!("--max-new-tokens {}: must be >= 1", args.max_new_tokens);
    }
    if args.temperature == 0.0 && (args.top_p.is_some() || args.top_k.is_some()) {
        tracing::warn!(
            "--top-p and --top-k shape sampling: with --temperature 0 the decoding is greedy and ignores them"
        );
    }
    let (model, tok) = args.model.load_lm_and_tokenizer()?;
    let vision = PromptImages::for_model(model.source_dir(), model.arch(), &tok)?;
    if !args.image.is_empty() && vision.is_none() {
        anyhow::bail!("--image: {} reads no images", args.model.model.display());
    }
    let mut images = args.image.iter().map(|p| ImageRef::Path(p.clone()));
    let mut prompts = Vec::with_capacity(args.prompt.len());
    for (i, p) in args.prompt.iter().enumerate() {
        let text =
            if args.chat { tok.apply_chat_template(&[ChatMessage::new("user", p.as_str())], true)? } else { p.clone() };
        // A rendered chat template already holds its special tokens.
        let ids = match &vision {
            Some(v) => {
                let mine: Vec<ImageRef> = images.by_ref().take(p.matches(IMAGE_MARKER).count()).collect();
                v.expand(&text, &tok, !args.chat, &mine, &format!("--prompt {}", i + 1))?.1
            }
            None => tok.encode(&text, !args.chat)?,
        };
        if ids.is_empty() {
            anyhow::bail!("prompt {p:?} encodes to no tokens");
        }
        prompts.push(ids.into_iter().map(i64::from).collect::<Vec<_>>());
    }
    if images.next().is_some() {
        anyhow::bail!(
            "--image: {} images for the prompts' {IMAGE_MARKER} markers, more than they hold",
            args.image.len()
        );
    }
    let sampling = if args.temperature > 0.0 {
        Sampling::Sample { temperature: args.temperature, top_k: args.top_k, top_p: args.top_p }
    } else {
        Sampling::Greedy
    };
    let eos = tok.eos_token_ids().iter().map(|&i| i64::from(i)).collect();
    let cfg = GenerateConfig {
        sampling,
        seed: args.seed,
        ..GenerateConfig::greedy(args.max_new_tokens, eos, i64::from(tok.pad_token_id()))
    };
    let batch = left_pad(&prompts, cfg.pad_token_id, model.device())?;
    let out = match &vision {
        Some(v) if !args.image.is_empty() => {
            let refs: Vec<ImageRef> = args.image.iter().map(|p| ImageRef::Path(p.clone())).collect();
            generate_with_images(&model, &batch.input_ids, &batch.attention_mask, &v.patches(&refs)?, &cfg)
        }
        _ => generate(&model, &batch.input_ids, &batch.attention_mask, &cfg),
    }
    .map_err(|e| match e {
        e @ GenerationError::NonFiniteLogits { .. } => anyhow::anyhow!("{}: {e}", args.model.model.display()),
        e => e.into(),
    })?;
    let responses = to_rows(&out.responses()?)?;
    let masks = to_rows(&out.response_mask)?;
    for ((prompt, resp), mask) in prompts.iter().zip(&responses).zip(&masks) {
        let ids: Vec<u32> = resp.iter().zip(mask).filter(|(_, &m)| m == 1).map(|(&t, _)| t as u32).collect();
        let text = tok.decode(&ids, true)?;
        if args.json {
            let line = serde_json::json!({ "prompt_ids": prompt, "response_ids": ids, "text": text });
            println!("{line}");
        } else {
            println!("{text}");
        }
    }
    Ok(())
}
