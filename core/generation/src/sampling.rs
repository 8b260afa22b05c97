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
        let Some(probs) = self.warped_probs(logits)? else { return Ok(logits.f_argmax(-1, false)?) };
        match window {
            None => Ok(probs.f_multinomial(1, false)?.f_squeeze_dim(1)?),
            Some(w) => {
                let b = window_rows(&probs, w)?;
                let vocab = probs.size()[1];
                let q = Tensor::f_empty([w.total, vocab], (Kind::Float, probs.device()))?.f_exponential_(1.0)?;
                Ok(probs.f_div(&q.f_narrow(0, w.offset, b)?)?.f_argmax(-1, false)?)
            }
        }
    }

    /// As [`Sampling::next_tokens_in`], with noise that is a pure function of (`key`, global row,
    /// `position`) instead of libtorch's process-wide generator: one uniform `u` per row from a
    /// counter-based hash (splitmix64), and the token where the row's cumulative probability first
    /// exceeds `u` (inverse-transform sampling — one draw from the same warped distribution). So a
    /// thread can sample while another uses the generator (an asynchronous rollout worker), and a
    /// row's token depends on neither the other rows nor the rank that holds it.
    ///
    /// # Shapes
    /// - `logits`: `[batch, vocab]` → `[batch]` int64
    pub fn next_tokens_keyed(
        &self,
        logits: &Tensor,
        window: Option<RowWindow>,
        key: u64,
        position: i64,
    ) -> Result<Tensor> {
        let Some(probs) = self.warped_probs(logits)? else { return Ok(logits.f_argmax(-1, false)?) };
        let b = probs.size()[0];
        let offset = match window {
            Some(w) => {
                window_rows(&probs, w)?;
                w.offset
            }
            None => 0,
        };
        let u: Vec<f32> = (0..b).map(|i| keyed_uniform(key, (offset + i) as u64, position as u64)).collect();
        let cum = probs.f_cumsum(-1, Kind::Float)?; // [b, vocab]
        let vocab = cum.size()[1];
        // Scaled by the row's total so the float cumsum's last value bounds the draw.
        let target = Tensor::f_from_slice(&u)?.f_to_device(probs.device())?.f_unsqueeze(1)?.f_mul(&cum.f_narrow(
            1,
            vocab - 1,
            1,
        )?)?; // [b, 1]
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

/// The rows of `probs` when they sit in window `w` (an error when they do not fit).
fn window_rows(probs: &Tensor, w: RowWindow) -> Result<i64> {
    let b = probs.size()[0];
    if w.offset < 0 || w.offset + b > w.total {
        return Err(GenerationError::Input(format!(
            "rows {}..{} are outside a batch of {}",
            w.offset,
            w.offset + b,
            w.total
        )));
    }
    Ok(b)
}

/// splitmix64's finaliser (Steele, Lea and Flood, "Fast splittable pseudorandom number
/// generators", 2014).
fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform in `[0, 1)` for (`key`, `row`, `position`): 24 bits of a hash, exact in f32.
fn keyed_uniform(key: u64, row: u64, position: u64) -> f32 {
    let h = mix64(mix64(mix64(key) ^ row) ^ position);
    (h >> 40) as f32 / (1u64 << 24) as f32
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

    /// Keyed sampling draws from the warped distribution, never picks a token cut by top-k, is a
    /// function of (key, global row, position) alone — a row window gives the whole batch's
    /// tokens — and leaves libtorch's generator untouched.
    #[test]
    fn keyed_sampling_is_a_function_of_its_key() {
        let _rng = RNG.lock().unwrap_or_else(|e| e.into_inner());
        let p = [0.5f32, 0.3, 0.15, 0.05];
        let l = Tensor::from_slice(&p.map(f32::ln)).view([1, 4]).repeat([4000, 1]);
        let s = Sampling::Sample { temperature: 1.0, top_k: Some(3), top_p: None };
        tch::manual_seed(3);
        let before = Tensor::randn([3], (Kind::Float, tch::Device::Cpu));
        tch::manual_seed(3);
        let t = s.next_tokens_keyed(&l, None, 42, 7).unwrap();
        assert!(Tensor::randn([3], (Kind::Float, tch::Device::Cpu)).equal(&before));
        let c = Vec::<i64>::try_from(t.bincount::<Tensor>(None, 4)).unwrap();
        assert_eq!(c[3], 0, "{c:?}");
        for (i, want) in [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95].iter().enumerate() {
            assert!((c[i] as f64 / 4000.0 - want).abs() < 0.03, "{c:?}");
        }
        let whole = Vec::<i64>::try_from(s.next_tokens_keyed(&l.narrow(0, 0, 10), None, 42, 7).unwrap()).unwrap();
        let mut parts = Vec::new();
        for (offset, rows) in [(0, 6), (6, 4)] {
            let w = RowWindow { offset, total: 10 };
            let part = s.next_tokens_keyed(&l.narrow(0, offset, rows), Some(w), 42, 7).unwrap();
            parts.extend(Vec::<i64>::try_from(part).unwrap());
        }
        assert_eq!(parts, whole);
        let other = Vec::<i64>::try_from(s.next_tokens_keyed(&l.narrow(0, 0, 10), None, 43, 7).unwrap()).unwrap();
        let later = Vec::<i64>::try_from(s.next_tokens_keyed(&l.narrow(0, 0, 10), None, 42, 8).unwrap()).unwrap();
        assert_ne!(other, whole);
        assert_ne!(later, whole);
    }

    #[test]
    fn bad_parameters_are_rejected() {
        assert!(Sampling::Sample { temperature: 0.0, top_k: None, top_p: None }.validate().is_err());
        assert!(Sampling::Sample { temperature: 1.0, top_k: None, top_p: Some(1.5) }.validate().is_err());
        assert!(Sampling::Sample { temperature: 1.0, top_k: Some(-1), top_p: None }.validate().is_err());
    }
}
