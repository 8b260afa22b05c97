//! Choosing the next token from logits: greedy, or sampling after temperature, top-k and top-p —
//! applied in that order, as transformers' logits warpers do.

use tch::{Kind, Tensor};

use crate::error::{GenerationError, Result};

/// Which rows of a larger batch a call samples (see [`Sampling::next_tokens_in`]).
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

    /// Picks one token per row.
    ///
    /// # Shapes
    /// - `logits`: `[batch, vocab]` (any float kind) → `[batch]` int64
    pub fn next_tokens(&self, logits: &Tensor) -> Result<Tensor> {
        self.next_tokens_in(logits, None)
    }

    /// As [`Sampling::next_tokens`] for rows `offset..offset + batch` of a batch of `total` rows
    /// split across processes: the sampling noise is drawn for all `total` rows, exactly as
    /// `multinomial` draws it (`argmax(p / q)` with `q ~ Exp(1)`, the exponential-race form
    /// libtorch uses for one sample), and this part keeps its rows. So the processes of a
    /// data-parallel run sample together the tokens one process would sample for the whole
    /// batch, and every process's generator stays in step.
    ///
    /// # Shapes
    /// - `logits`: `[batch, vocab]` → `[batch]` int64, with `offset + batch <= total`
    pub fn next_tokens_in(&self, logits: &Tensor, window: Option<RowWindow>) -> Result<Tensor> {
        match self {
            Sampling::Greedy => Ok(logits.f_argmax(-1, false)?),
            Sampling::Sample { temperature, top_k, top_p } => {
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
                let probs = l.f_softmax(-1, Kind::Float)?;
                match window {
                    None => Ok(probs.f_multinomial(1, false)?.f_squeeze_dim(1)?),
                    Some(w) => {
                        let b = probs.size()[0];
                        if w.offset < 0 || w.offset + b > w.total {
                            return Err(GenerationError::Input(format!(
                                "rows {}..{} are outside a batch of {}",
                                w.offset,
                                w.offset + b,
                                w.total
                            )));
                        }
                        let q =
                            Tensor::f_empty([w.total, vocab], (Kind::Float, probs.device()))?.f_exponential_(1.0)?;
                        Ok(probs.f_div(&q.f_narrow(0, w.offset, b)?)?.f_argmax(-1, false)?)
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// libtorch's default generator is process-wide: tests that seed it take turns.
    static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn greedy_is_argmax() {
        let l = Tensor::from_slice(&[0.1f32, 3.0, 2.0, 1.0, 0.0, -1.0]).view([2, 3]);
        let t = Sampling::Greedy.next_tokens(&l).unwrap();
        assert_eq!(Vec::<i64>::try_from(t).unwrap(), vec![1, 0]);
    }

    #[test]
    fn top_k_one_and_tiny_top_p_are_greedy() {
        let _rng = RNG.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(0);
        let l = Tensor::randn([8, 50], (Kind::Float, tch::Device::Cpu));
        let greedy = Vec::<i64>::try_from(l.argmax(-1, false)).unwrap();
        for s in [
            Sampling::Sample { temperature: 1.0, top_k: Some(1), top_p: None },
            Sampling::Sample { temperature: 1.0, top_k: None, top_p: Some(1e-6) },
        ] {
            for _ in 0..5 {
                assert_eq!(Vec::<i64>::try_from(s.next_tokens(&l).unwrap()).unwrap(), greedy);
            }
        }
    }

    #[test]
    fn top_p_keeps_the_nucleus() {
        let _rng = RNG.lock().unwrap_or_else(|e| e.into_inner());
        // probs ~ [0.5, 0.3, 0.2]: top_p = 0.7 keeps tokens 0 and 1 only.
        let l = Tensor::from_slice(&[0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()]).view([1, 3]).repeat([2000, 1]);
        tch::manual_seed(1);
        let s = Sampling::Sample { temperature: 1.0, top_k: None, top_p: Some(0.7) };
        let t = s.next_tokens(&l).unwrap();
        let counts = t.bincount::<Tensor>(None, 3);
        let c = Vec::<i64>::try_from(counts).unwrap();
        assert_eq!(c[2], 0, "{c:?}");
        let frac0 = c[0] as f64 / 2000.0; // 0.5 / 0.8 = 0.625
        assert!((frac0 - 0.625).abs() < 0.04, "{c:?}");
    }

    /// Two halves sampled with row windows from the same generator state give exactly the
    /// tokens of the whole batch sampled at once (and leave the generator where it would be).
    #[test]
    fn row_windows_reproduce_the_whole_batch() {
        let _rng = RNG.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(5);
        let l = Tensor::randn([6, 40], (Kind::Float, tch::Device::Cpu));
        let s = Sampling::Sample { temperature: 0.9, top_k: Some(30), top_p: Some(0.95) };
        tch::manual_seed(11);
        let whole = Vec::<i64>::try_from(s.next_tokens(&l).unwrap()).unwrap();
        let after_whole = Tensor::randn([3], (Kind::Float, tch::Device::Cpu));
        let mut parts = Vec::new();
        for (offset, rows) in [(0, 4), (4, 2)] {
            tch::manual_seed(11);
            let w = RowWindow { offset, total: 6 };
            parts.extend(Vec::<i64>::try_from(s.next_tokens_in(&l.narrow(0, offset, rows), Some(w)).unwrap()).unwrap());
            let after = Tensor::randn([3], (Kind::Float, tch::Device::Cpu));
            assert!(after.equal(&after_whole));
        }
        assert_eq!(parts, whole);
        assert!(s.next_tokens_in(&l, Some(RowWindow { offset: 1, total: 6 })).is_err());
    }

    #[test]
    fn bad_parameters_are_rejected() {
        assert!(Sampling::Sample { temperature: 0.0, top_k: None, top_p: None }.validate().is_err());
        assert!(Sampling::Sample { temperature: 1.0, top_k: None, top_p: Some(1.5) }.validate().is_err());
        assert!(Sampling::Sample { temperature: 1.0, top_k: Some(-1), top_p: None }.validate().is_err());
    }
}
