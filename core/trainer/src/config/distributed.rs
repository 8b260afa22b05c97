//! `[distributed]`: how data-parallel ranks hold the training state of every trained model
//! (the RL actor and critic, `rlhf sft`, `rlhf rm`, `rlhf dpo`); see [`crate::train_engine`].

use serde::{Deserialize, Serialize};

use super::KeySource;
use crate::error::Result;

/// `[distributed]` of every command.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DistributedConfig {
    /// ZeRO stage: 0 replicates the whole training state on every rank (DDP); 1 partitions the
    /// f32 masters and Adam moments over the ranks; 2 the gradients too; 3 the parameters too
    /// (gathered layer by layer inside the checkpointed layer loop, so stage 3 turns
    /// `train.gradient_checkpointing` on).
    pub zero_stage: u8,
    /// With `zero_stage = 3`: the decoder layers of the RL reference model are sharded too, each
    /// gathered just before its forward and freed after (its embeddings and head stay whole).
    pub shard_frozen: bool,
}

impl DistributedConfig {
    pub fn validate(&self, src: &KeySource) -> Result<()> {
        match self.zero_stage {
            0..=2 if self.shard_frozen => {
                Err(src
                    .error("distributed.shard_frozen", "shards frozen models like trained ones: needs zero_stage = 3"))
            }
            0..=3 => Ok(()),
            s => Err(src.error("distributed.zero_stage", &format!("{s} is not a ZeRO stage: 0, 1, 2 or 3"))),
        }
    }

    /// Stage 3 gathers each layer inside the checkpointed layer loop: it turns gradient
    /// checkpointing on (`checkpointing`, `train.gradient_checkpointing`), which needs LoRA
    /// dropout off (the recomputed layer must draw the same masks).
    pub fn apply_to_checkpointing(&self, src: &KeySource, checkpointing: &mut bool, lora_dropout: f64) -> Result<()> {
        if self.zero_stage != 3 {
            return Ok(());
        }
        if lora_dropout > 0.0 {
            return Err(src.error(
                "distributed.zero_stage",
                "stage 3 recomputes each layer in backward (gradient checkpointing), which needs lora.dropout = 0",
            ));
        }
        if !*checkpointing {
            tracing::info!("distributed.zero_stage = 3: gradient checkpointing on (layers are gathered in its loop)");
            *checkpointing = true;
        }
        Ok(())
    }

    /// The [`crate::train_engine::Strategy`] of the stage.
    pub fn strategy(&self) -> crate::train_engine::Strategy {
        crate::train_engine::Strategy::of_stage(self.zero_stage)
    }
}
