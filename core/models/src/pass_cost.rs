//! What a pass through a model's layers costs in forward FLOPs, by PaLM's model-FLOPs count
//! ([`crate::ArchConfig::layers_matmul_params`], [`crate::ArchConfig::attention_width`]): the
//! padding-free passes compare the layouts a batch may run in by it (its rows as they are, packed,
//! or with shared prompts computed once). Attention with a mask computes every query against
//! every key of its row, so a layout of `rows` rows `width` wide costs
//!
//! ```text
//! 2·N·rows·width + 4·L·H·rows·width²
//! ```
//!
//! with `N` the layers' matmul parameters and `L·H` the heads × head_dim summed over the attention
//! layers. The LM head is left out (every layout runs it on the same positions), and so is a
//! linear-attention layer's recurrence (it grows with the slots, as `N`'s share does).

use crate::ArchConfig;

/// Forward FLOPs per token slot and per query-key pair of a pass through the layers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PassCost {
    /// `2·N`: every matmul parameter of the layers once per slot, multiply and add.
    pub per_slot: f64,
    /// `4·L·H`: a query's score against a key and its share of the weighted values, per layer.
    pub per_pair: f64,
}

impl PassCost {
    /// The cost model of `arch`.
    pub fn of(arch: &ArchConfig) -> PassCost {
        PassCost { per_slot: 2.0 * arch.layers_matmul_params() as f64, per_pair: 4.0 * arch.attention_width() as f64 }
    }

    /// `rows` rows of `width` slots, each query against every key of its row.
    pub fn rows(&self, rows: i64, width: i64) -> f64 {
        let (rows, width) = (rows as f64, width as f64);
        self.per_slot * rows * width + self.per_pair * rows * width * width
    }

    /// A batch of `batch` rows of `seq` whose `prompts` distinct prompts (the first `from`
    /// columns) are computed once each, and the rest of every row on top of its prompt's keys
    /// ([`crate::CausalLm::hidden_states_after_prefix`]): `prompts × from` slots, then
    /// `batch × (seq − from)` queries against `seq` keys each.
    pub fn shared_prefix(&self, prompts: i64, from: i64, batch: i64, seq: i64) -> f64 {
        let rest = (batch * (seq - from)) as f64;
        self.rows(prompts, from) + self.per_slot * rest + self.per_pair * rest * seq as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// By hand: 2 rows of 3 at 10 FLOPs a slot and 1 a pair cost 2·3·10 + 2·9 = 78; two prompts of
    /// 2 under four rows of 5 cost 2·2·10 + 2·4 (prompts) + 4·3·10 + 4·3·5 (the rest) = 228.
    #[test]
    fn costs_by_hand() {
        let c = PassCost { per_slot: 10.0, per_pair: 1.0 };
        assert_eq!(c.rows(2, 3), 78.0);
        assert_eq!(c.shared_prefix(2, 2, 4, 5), 48.0 + 120.0 + 60.0);
        // Computing a prompt once for all four rows costs less than the rows whole.
        assert!(c.shared_prefix(1, 2, 4, 5) < c.rows(4, 5));
    }
}
