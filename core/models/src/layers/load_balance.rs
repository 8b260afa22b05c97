//! The load-balancing loss of a mixture of experts (Fedus et al. 2021, "Switch Transformers",
//! eqs. 4–6), as transformers' `load_balancing_loss_func` computes it over every sparse layer of
//! one forward together (`output_router_logits`):
//!
//! `aux = E · Σₑ fₑ · Pₑ`, `fₑ = cₑ / N`, `Pₑ = pₑ / N`
//!
//! where, over the real tokens of all sparse layers, `cₑ` counts the top-k choices of expert `e`,
//! `pₑ` sums the router probabilities of `e` and `N` counts the tokens (each layer counts its
//! tokens again), and `E` is the number of experts. Uniform routing gives `aux = k`. The counts
//! carry no gradient, so `aux` is linear in the probabilities: `∂aux/∂pₑ = E · cₑ / N²` is fixed by
//! the forward, and a checkpointed backward adds each layer's share `Σₑ (∂aux/∂pₑ) · pₑ,layer` when
//! it recomputes the layer ([`crate::checkpointing`]).
//!
//! A token counts with a weight: 1 for a real token, 0 for padding, and for a prompt computed once
//! for the rows that share it ([`crate::prefix`]) the number of those rows — the statistics of the
//! pass over every whole row.

use std::sync::Mutex;

use tch::{Kind, Tensor};

use crate::error::Result;

/// Routing statistics of one forward, summed over the sparse layers it went through.
#[derive(Debug)]
pub struct RouterStats {
    /// `[experts]` f32: the weighted top-k choices of each expert (no graph).
    pub chosen: Tensor,
    /// `[experts]` f32: the weighted sum of each expert's router probability (with the forward's
    /// graph when it has one).
    pub probs: Tensor,
    /// `[]` f32: the weighted tokens, counted once per layer (no graph).
    pub tokens: Tensor,
}

impl RouterStats {
    /// Both forwards' statistics together.
    pub fn add(&self, other: &RouterStats) -> Result<RouterStats> {
        Ok(RouterStats {
            chosen: self.chosen.f_add(&other.chosen)?,
            probs: self.probs.f_add(&other.probs)?,
            tokens: self.tokens.f_add(&other.tokens)?,
        })
    }

    /// The statistics of several forwards together (`None` where none has any).
    pub fn sum(stats: impl IntoIterator<Item = Option<RouterStats>>) -> Result<Option<RouterStats>> {
        let mut total: Option<RouterStats> = None;
        for s in stats.into_iter().flatten() {
            total = Some(match total {
                Some(t) => t.add(&s)?,
                None => s,
            });
        }
        Ok(total)
    }

    /// `∂aux/∂p = E · c / N²`, `[experts]` f32 (no graph).
    pub fn grad_of_probs(&self) -> Result<Tensor> {
        let experts = self.chosen.size()[0] as f64;
        Ok(self.chosen.f_mul_scalar(experts)?.f_div(&self.tokens.f_square()?)?.f_detach()?)
    }

    /// The loss, `[]` f32, with the graph of [`RouterStats::probs`].
    pub fn loss(&self) -> Result<Tensor> {
        Ok(self.probs.f_mul(&self.grad_of_probs()?)?.f_sum(Kind::Float)?)
    }
}

/// Where the sparse layers of one forward add their [`RouterStats`], with each token's weight.
#[derive(Debug)]
pub struct RouterRecord {
    /// `[batch, seq]` f32.
    weights: Tensor,
    stats: Mutex<Option<RouterStats>>,
}

impl RouterRecord {
    /// A record of the tokens whose key-mask entries are `mask` (`[batch, seq]`, 1 for a real
    /// token).
    pub fn new(mask: &Tensor) -> Result<Self> {
        Ok(RouterRecord { weights: mask.f_to_kind(Kind::Float)?, stats: Mutex::new(None) })
    }

    /// Counts each row's tokens `rows[b]` times (`[batch]`): a prompt shared by that many rows.
    pub fn scale_rows(&mut self, rows: &Tensor) -> Result<()> {
        self.weights = self.weights.f_mul(&rows.f_to_kind(Kind::Float)?.f_unsqueeze(-1)?)?;
        Ok(())
    }

    /// Adds one layer's routing: `probs` `[tokens, experts]` f32 (the router's softmax) and
    /// `chosen` `[tokens, k]` (the experts each token went to), tokens in `[batch, seq]` order.
    pub(crate) fn add(&self, probs: &Tensor, chosen: &Tensor) -> Result<()> {
        let w = self.weights.f_reshape([-1])?; // [tokens]
        let experts = probs.size()[1];
        let k = chosen.size()[1];
        let counts = Tensor::f_zeros([experts], (Kind::Float, w.device()))?.f_scatter_add(
            0,
            &chosen.f_reshape([-1])?,
            &w.f_repeat_interleave_self_int(k, None, None)?,
        )?;
        let layer = RouterStats {
            chosen: counts,
            probs: probs.f_mul(&w.f_unsqueeze(-1)?)?.f_sum_dim_intlist(0, false, Kind::Float)?,
            tokens: w.f_sum(Kind::Float)?,
        };
        let mut stats = self.stats.lock().unwrap_or_else(|p| p.into_inner());
        *stats = Some(match stats.take() {
            Some(s) => s.add(&layer)?,
            None => layer,
        });
        Ok(())
    }

    /// What the layers added since the last call (`None` when no sparse layer ran), and resets.
    pub fn take(&self) -> Option<RouterStats> {
        self.stats.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// transformers' `load_balancing_loss_func` on two layers of three tokens (the last one
    /// padding), E = 4, k = 2, written out by hand.
    #[test]
    fn matches_the_switch_transformer_formula() {
        let record = RouterRecord::new(&Tensor::from_slice(&[1i64, 1, 0]).view([1, 3])).unwrap();
        let p1 = Tensor::from_slice(&[0.4f32, 0.3, 0.2, 0.1, 0.1, 0.2, 0.3, 0.4, 0.25, 0.25, 0.25, 0.25]).view([3, 4]);
        let c1 = Tensor::from_slice(&[0i64, 1, 3, 2, 0, 1]).view([3, 2]);
        let p2 = Tensor::from_slice(&[0.7f32, 0.1, 0.1, 0.1, 0.1, 0.7, 0.1, 0.1, 0.1, 0.1, 0.1, 0.7]).view([3, 4]);
        let c2 = Tensor::from_slice(&[0i64, 1, 1, 0, 3, 2]).view([3, 2]);
        record.add(&p1, &c1).unwrap();
        record.add(&p2, &c2).unwrap();
        let stats = record.take().unwrap();
        assert!(record.take().is_none());
        // Real tokens only: counts c = [3, 3, 1, 1], probability sums p = [1.3, 1.3, 0.7, 0.7], N = 4.
        let (c, p, n) = ([3.0, 3.0, 1.0, 1.0], [1.3, 1.3, 0.7, 0.7], 4.0);
        let want: f64 = 4.0 * c.iter().zip(&p).map(|(c, p)| (c / n) * (p / n)).sum::<f64>();
        let got = stats.loss().unwrap().double_value(&[]);
        assert!((got - want).abs() < 1e-6, "{got} vs {want}");
    }
}
