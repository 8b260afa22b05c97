//! The local engine's bf16 decode copy (`rollout.decode_dtype = "bf16"`).
//!
//! On a CPU with bf16 dot products (AVX512_BF16) a decode step's small GEMMs run about 3× faster
//! in bf16 than in f32 (SmolLM2's layers at 16 rows: 17 ms against 51–56 ms per token step). The
//! copy holds the decoder layers' weights in bf16 and samples from the policy's own f32 output
//! head (the same tensor, not a copy), so the logits it samples from are f32 — the mismatch with
//! the policy comes from the bf16 hidden states alone. The copy is refreshed after every optimizer
//! step; the sampled tokens' log-probs under the copy travel as behaviour log-probs, so
//! `[rollout.is_correction]` corrects for the mismatch as it does for vLLM (which also samples in
//! bf16 in verl's and OpenRLHF's setups), and `is/*` metrics measure it.

use rlhf_models::CausalLm;
use tch::Kind;

use crate::error::Result;

/// A bf16 copy of the policy for sampling.
pub struct Bf16Decode {
    model: CausalLm,
    /// The optimizer step whose weights the copy holds.
    version: Option<usize>,
}

impl Bf16Decode {
    /// The policy's architecture loaded from its directory in bf16 (weights replaced at the first
    /// [`Bf16Decode::sync`]), sampling from the policy's own output head.
    pub fn new(actor: &CausalLm) -> Result<Self> {
        let mut model = CausalLm::from_dir(actor.source_dir(), actor.device(), Kind::BFloat16)?;
        model.freeze();
        model.set_output_head(actor.lm_head_weight().shallow_clone())?;
        Ok(Bf16Decode { model, version: None })
    }

    /// Copies (and rounds) the policy's weights into the copy unless it already holds those of
    /// optimizer step `version`.
    pub fn sync(&mut self, actor: &CausalLm, version: usize) -> Result<()> {
        if self.version != Some(version) {
            self.model.vs.copy(&actor.vs)?;
            self.version = Some(version);
        }
        Ok(())
    }

    /// The copy, to sample with.
    pub fn model(&self) -> &CausalLm {
        &self.model
    }
}
