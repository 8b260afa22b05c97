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
    /// f32 masters and Adam moments over the ranks; 2 the gradients too. Stage 3 (parameters)
    /// is not built yet.
    pub zero_stage: u8,
}

impl DistributedConfig {
    pub fn validate(&self, src: &KeySource) -> Result<()> {
        match self.zero_stage {
            0..=2 => Ok(()),
            3 => Err(src.error(
                "distributed.zero_stage",
                "stage 3 (sharded parameters) is not built yet: 0 (replicated), 1 (optimizer state sharded) or 2 \
                 (optimizer state and gradients sharded)",
            )),
            s => Err(src.error("distributed.zero_stage", &format!("{s} is not a ZeRO stage: 0, 1 or 2"))),
        }
    }

    /// The [`crate::train_engine::Strategy`] of the stage.
    pub fn strategy(&self) -> crate::train_engine::Strategy {
        crate::train_engine::Strategy::of_stage(self.zero_stage)
    }
}
