//! The supervised phases before RL (DeepSpeed-Chat phases 1 and 2): [`sft`] (examples in
//! [`sft_data`]) and [`rm`] (preference pairs and losses in [`pairs`]), and [`dpo`] (the same
//! pairs, trained directly into the policy), sharing the helpers of [`phase`] and the loop of [`run_loop`].
//! Their configuration lives in [`crate::config`], below both this and the RL host.

pub mod dpo;
mod dpo_batch;
pub mod pairs;
pub mod phase;
pub mod rm;
pub mod run_loop;
pub mod sft;
pub mod sft_data;
pub mod state;
