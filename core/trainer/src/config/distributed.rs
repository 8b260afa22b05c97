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
    /// f32 masters and Adam moments over the ranks. Stages 2 (gradients) and 3 (parameters) are
    /// not built yet.
    pub zero_stage: u8,
}

impl DistributedConfig {
    pub fn validate(&self, src: &KeySource) -> Result<()> {
        match self.zero_stage {
            0 | 1 => Ok(()),
            2 | 3 => Err(src.error(
                "distributed.zero_stage",
                &format!(
                    "stage {} (sharded gradients{}) is not built yet: 0 (replicated) or 1 (optimizer state sharded)",
                    self.zero_stage,
                    if self.zero_stage == 3 { " and parameters" } else { "" }
                ),
            )),
            s => Err(src.error("distributed.zero_stage", &format!("{s} is not a ZeRO stage: 0 or 1"))),
        }
    }

    /// The [`crate::train_engine::Strategy`] of the stage.
    pub fn strategy(&self) -> crate::train_engine::Strategy {
        crate::train_engine::Strategy::of_stage(self.zero_stage)
    }
}
