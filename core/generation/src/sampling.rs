//! Choosing the next token from logits: greedy, or sampling after temperature, top-k and top-p —
//! applied in that order, as transformers' logits warpers do.

use tch::{Kind, Tensor};

use crate::error::{GenerationError, Result};

/// Where a decode's rows sit in a larger batch split across processes: its noise is keyed by
/// the global row (see [`crate::noise`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowWindow {
    pub offset: i64,
    pub total: i64,
}

/// How to pick the next token.
#[derive(Debug, Clone, PartialEq)]
pub enum Sampling {
    /// Argmax.
    Greedy,
    /// Multinomial sampling from the warped distribution.
    Sample {
        /// > 0; divides the logits.
        temperature: f64,
        /// Keep the k most likely tokens (None or 0: no limit).
        top_k: Option<i64>,
        /// Keep the smallest set whose probability reaches p, in (0, 1] (None or 1: no limit).
        top_p: Option<f64>,
    },
}

impl Sampling {
    /// Checks the parameters.
    pub fn validate(&self) -> Result<()> {
        if let Sampling::Sample { temperature, top_k, top_p } = self {
            if !(*temperature > 0.0 && temperature.is_finite()) {
                return Err(GenerationError::Input(format!("temperature must be > 0, got {temperature}")));
            }
            if let Some(k) = top_k {
                if *k < 0 {
                    return Err(GenerationError::Input(format!("top_k must be >= 0, got {k}")));
                }
            }
            if let Some(p) = top_p {
                if !(*p > 0.0 && *p <= 1.0) {
                    return Err(GenerationError::Input(format!("top_p must be in (0, 1], got {p}")));
                }
            }
        }
        Ok(())
    }

    /// Picks one token per row: the argmax, or with `uniforms` one draw from the warped
    /// distribution by inverse-transform sampling — the token where the row's cumulative
    /// probability first exceeds its uniform `u`. With the uniforms of [`crate::noise`] a token
    /// is a pure function of (key, global row, step): it depends neither on the other rows nor
    /// on the rank that holds the row, and libtorch's generator is not touched. Every operation
    /// keeps its shape and nothing is read back to the host, so this runs inside a captured
    /// decode step.
    ///
    /// # Shapes
    /// - `logits`: `[batch, vocab]` (any float kind); `uniforms`: `[batch]` f32 in `[0, 1)`
    ///   (required when sampling) → `[batch]` int64
    pub fn next_tokens(&self, logits: &Tensor, uniforms: Option<&Tensor>) -> Result<Tensor> {
        let Some(probs) = self.warped_probs(logits)? else { return Ok(logits.f_argmax(-1, false)?) };
        let u = uniforms.ok_or_else(|| GenerationError::Input("sampling needs one uniform per row".into()))?;
        let cum = probs.f_cumsum(-1, Kind::Float)?; // [b, vocab]
        let vocab = cum.size()[1];
        // Scaled by the row's total so the float cumsum's last value bounds the draw.
        let target = u.f_unsqueeze(1)?.f_mul(&cum.f_narrow(1, vocab - 1, 1)?)?; // [b, 1]

        // The first index whose cumulative sum exceeds the target: tokens of zero probability
        // (cut by top-k/top-p) add nothing to the sum and are never picked.
        let idx = target.f_searchsorted(&cum, false, true, "right", None::<Tensor>)?; // [b, 1]
        Ok(idx.f_clamp_max(vocab - 1)?.f_squeeze_dim(1)?)
    }

    /// The distribution to sample from after temperature, top-k and top-p, `[batch, vocab]` f32;
    /// `None` when greedy.
    fn warped_probs(&self, logits: &Tensor) -> Result<Option<Tensor>> {
        let Sampling::Sample { temperature, top_k, top_p } = self else { return Ok(None) };
        let mut l = logits.f_to_kind(Kind::Float)?.f_div_scalar(*temperature)?;
        let vocab = l.size()[1];
        if let Some(k) = top_k.filter(|&k| k > 0 && k < vocab) {
            let (vals, _) = l.f_topk(k, -1, true, true)?;
            let kth = vals.f_narrow(1, k - 1, 1)?; // [b, 1]
            l = l.f_masked_fill(&l.f_lt_tensor(&kth)?, f64::NEG_INFINITY)?;
        }
        if let Some(p) = top_p.filter(|&p| p < 1.0) {
            // transformers: sort ascending, drop the tokens whose cumulative mass is <= 1 - p,
            // always keeping the most likely one.
            let (sorted, idx) = l.f_sort(-1, false)?;
            let cum = sorted.f_softmax(-1, Kind::Float)?.f_cumsum(-1, Kind::Float)?;
            let remove = cum.f_le(1.0 - p)?;
            let _ = remove.f_narrow(1, vocab - 1, 1)?.f_fill_(0)?;
            let remove = remove.f_scatter(1, &idx, &remove)?;
            l = l.f_masked_fill(&remove, f64::NEG_INFINITY)?;
        }
        Ok(Some(l.f_softmax(-1, Kind::Float)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::noise::uniform_table;

    /// libtorch's default generator is process-wide: tests that seed or draw from it take turns.
    static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// `n` uniforms of key `key` (one decode step of `n` rows).
    fn uniforms(key: u64, n: i64) -> Tensor {
        uniform_table(key, 0, n, 1, tch::Device::Cpu).unwrap().view([n])
    }

    #[test]
    fn greedy_is_argmax() {
        let l = Tensor::from_slice(&[0.1f32, 3.0, 2.0, 1.0, 0.0, -1.0]).view([2, 3]);
        let t = Sampling::Greedy.next_tokens(&l, None).unwrap();
        assert_eq!(Vec::<i64>::try_from(t).unwrap(), vec![1, 0]);
    }

    #[test]
    fn top_k_one_and_tiny_top_p_are_greedy() {
        let _rng = RNG.lock().unwrap_or_else(|e| e.into_inner());
        let l = Tensor::randn([8, 50], (Kind::Float, tch::Device::Cpu));
        let greedy = Vec::<i64>::try_from(l.argmax(-1, false)).unwrap();
        for s in [
            Sampling::Sample { temperature: 1.0, top_k: Some(1), top_p: None },
            Sampling::Sample { temperature: 1.0, top_k: None, top_p: Some(1e-6) },
        ] {
            for key in 0..5 {
                assert_eq!(Vec::<i64>::try_from(s.next_tokens(&l, Some(&uniforms(key, 8))).unwrap()).unwrap(), greedy);
            }
        }
    }

    #[test]
    fn top_p_keeps_the_nucleus() {
        // probs ~ [0.5, 0.3, 0.2]: top_p = 0.7 keeps tokens 0 and 1 only.
        let l = Tensor::from_slice(&[0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()]).view([1, 3]).repeat([2000, 1]);
        let s = Sampling::Sample { temperature: 1.0, top_k: None, top_p: Some(0.7) };
        let t = s.next_tokens(&l, Some(&uniforms(1, 2000))).unwrap();
        let c = Vec::<i64>::try_from(t.bincount::<Tensor>(None, 3)).unwrap();
        assert_eq!(c[2], 0, "{c:?}");
        let frac0 = c[0] as f64 / 2000.0; // 0.5 / 0.8 = 0.625
        assert!((frac0 - 0.625).abs() < 0.04, "{c:?}");
    }

    /// Sampling draws from the warped distribution, never picks a token cut by top-k, is a
    /// function of its uniforms, and leaves libtorch's generator untouched.
    #[test]
    fn sampling_follows_the_warped_distribution() {
        let p = [0.5f32, 0.3, 0.15, 0.05];
        let l = Tensor::from_slice(&p.map(f32::ln)).view([1, 4]).repeat([4000, 1]);
        let s = Sampling::Sample { temperature: 1.0, top_k: Some(3), top_p: None };
        let u = uniforms(42, 4000);
        let _rng = RNG.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(3);
        let t = s.next_tokens(&l, Some(&u)).unwrap();
        let after = Tensor::randn([3], (Kind::Float, tch::Device::Cpu));
        tch::manual_seed(3);
        assert!(Tensor::randn([3], (Kind::Float, tch::Device::Cpu)).equal(&after));
        let c = Vec::<i64>::try_from(t.bincount::<Tensor>(None, 4)).unwrap();
        assert_eq!(c[3], 0, "{c:?}");
        for (i, want) in [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95].iter().enumerate() {
            assert!((c[i] as f64 / 4000.0 - want).abs() < 0.03, "{c:?}");
        }
        assert!(s.next_tokens(&l, Some(&u)).unwrap().equal(&t));
        assert!(!s.next_tokens(&l, Some(&uniforms(43, 4000))).unwrap().equal(&t));
        assert!(s.next_tokens(&l, None).is_err());
    }

    #[test]
    fn bad_parameters_are_rejected() {
        assert!(Sampling::Sample { temperature: 0.0, top_k: None, top_p: None }.validate().is_err());
        assert!(Sampling::Sample { temperature: 1.0, top_k: None, top_p: Some(1.5) }.validate().is_err());
        assert!(Sampling::Sample { temperature: 1.0, top_k: Some(-1), top_p: None }.validate().is_err());
    }
}
