//! The gated delta rule (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks"), the recurrence
//! of Gated DeltaNet linear attention. Per head, a state `S` (`[dk, dv]`) is decayed, corrected
//! towards the new value by a delta-rule write, then read by the query:
//!
//! ```text
//! S_t = exp(g_t) · S_{t−1} + β_t · k_t ⊗ (v_t − exp(g_t) · S_{t−1}ᵀ k_t)
//! o_t = S_tᵀ q_t
//! ```
//!
//! with `q`, `k` L2-normalised and `q` scaled by `dk^−½`, all in f32 whatever the model's dtype.
//! [`recurrent`] steps through the tokens as written (decoding); [`chunked`] computes the same in
//! chunks of tokens (prompts and training), as the flash-linear-attention kernels and
//! transformers' reference `torch_chunk_gated_delta_rule` do: within a chunk the writes are
//! condensed by the UT transform (a unit lower-triangular solve) into matrix products, and only the
//! state is carried from chunk to chunk.

use tch::{Kind, Tensor};

use crate::error::Result;

/// Tokens per chunk of [`chunked`] on a GPU (transformers' and flash-linear-attention's default).
pub const CHUNK: i64 = 64;

/// The chunk length of [`chunked`] for `seq` tokens on `device`. Any length computes the same
/// recurrence (up to the order of float sums); what differs is the work. On a GPU, [`CHUNK`]. On a
/// CPU, where a chunk's products (which grow with its square) are the cost, a sequence shorter than
/// [`CHUNK`] takes one chunk of its own length rounded up to 16 rather than being padded to 64: a
/// Qwen3.5 layer's recurrence over 32 rows of 32 tokens took 15–18 ms instead of 34 on a 2-core
/// CPU. Longer sequences keep [`CHUNK`] (chunks of 32 measured no faster at 128 tokens and slower
/// at 64 and 256).
fn chunk_len(seq: i64, device: tch::Device) -> i64 {
    #[cfg(test)]
    if let Some(chunk) = tests::CHUNK_OVERRIDE.with(std::cell::Cell::get) {
        return chunk;
    }
    match device {
        tch::Device::Cpu if seq < CHUNK => (seq + 15) / 16 * 16,
        _ => CHUNK,
    }
}

/// `x / √(Σ x² + 1e-6)` over the last dimension (flash-linear-attention's `l2norm`).
fn l2norm(x: &Tensor) -> Result<Tensor> {
    let sq = x.f_mul(x)?.f_sum_dim_intlist(-1, true, Kind::Float)?;
    Ok(x.f_mul(&sq.f_add_scalar(1e-6)?.f_rsqrt()?)?)
}

/// q, k, v, g and β as the recurrence reads them: heads first, f32, q and k normalised, q scaled,
/// and the key heads repeated for the value heads they serve (grouped value attention).
///
/// # Shapes
/// - `q`, `k`: `[b, s, hk, dk]`; `v`: `[b, s, hv, dv]`; `g`, `beta`: `[b, s, hv]` →
///   `q`, `k`: `[b, hv, s, dk]`; `v`: `[b, hv, s, dv]`; `g`, `beta`: `[b, hv, s]`
fn prepare(q: &Tensor, k: &Tensor, v: &Tensor, g: &Tensor, beta: &Tensor) -> Result<[Tensor; 5]> {
    let (hk, hv) = (q.size()[2], v.size()[2]);
    let heads = |t: &Tensor| -> Result<Tensor> {
        let t = if hv != hk { t.f_repeat_interleave_self_int(hv / hk, 2, None)? } else { t.shallow_clone() };
        Ok(t.f_transpose(1, 2)?.f_to_kind(Kind::Float)?.f_contiguous()?)
    };
    let (q, k) = (l2norm(&heads(q)?)?, l2norm(&heads(k)?)?);
    let q = q.f_mul_scalar((q.size()[3] as f64).powf(-0.5))?;
    let v = v.f_transpose(1, 2)?.f_to_kind(Kind::Float)?.f_contiguous()?;
    let g = g.f_transpose(1, 2)?.f_to_kind(Kind::Float)?.f_contiguous()?;
    let beta = beta.f_transpose(1, 2)?.f_to_kind(Kind::Float)?.f_contiguous()?;
    Ok([q, k, v, g, beta])
}

/// The state before the first token, in f32: `state`, or zeros `[b, hv, dk, dv]`.
fn initial_state(state: Option<&Tensor>, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    let (b, h, dk, dv) = (k.size()[0], k.size()[1], k.size()[3], v.size()[3]);
    Ok(match state {
        Some(s) => s.f_to_kind(Kind::Float)?,
        None => Tensor::f_zeros([b, h, dk, dv], (Kind::Float, k.device()))?,
    })
}

/// The recurrence token by token (decoding, usually one token). With `in_place`, `state` (f32)
/// is updated where it lies and returned — a preallocated decode cache's buffer, so a step reads
/// and writes the state once and copies nothing; it must take no part in autograd.
///
/// # Shapes
/// - `q`, `k`: `[b, s, hk, dk]`; `v`: `[b, s, hv, dv]`; `g` (log decay, ≤ 0), `beta`: `[b, s, hv]`;
///   `state`: `[b, hv, dk, dv]` f32 → (`[b, s, hv, dv]` in `v`'s dtype, the new state)
pub fn recurrent(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    state: Option<&Tensor>,
    in_place: bool,
) -> Result<(Tensor, Tensor)> {
    let kind = v.kind();
    let [q, k, v, g, beta] = prepare(q, k, v, g, beta)?;
    let mut s_t = initial_state(state, &k, &v)?;
    let in_place = in_place && state.is_some_and(|s| s.kind() == Kind::Float);
    let (b, h) = (q.size()[0], q.size()[1]);
    // One view per token (a single backward for all of them, where per-token selects would each
    // scatter into a full-size gradient).
    let (qs, ks, vs) = (q.f_split(1, 2)?, k.f_split(1, 2)?, v.f_split(1, 2)?); // [b, h, 1, d] each
    let decays = g.f_exp()?.f_view([b, h, -1, 1, 1])?.f_unbind(2)?; // [b, h, 1, 1] each
    let rates = beta.f_view([b, h, -1, 1, 1])?.f_unbind(2)?; // [b, h, 1, 1] each
    let mut out = Vec::with_capacity(qs.len());
    for t in 0..qs.len() {
        let (q_t, k_t, v_t, decay) = (&qs[t], &ks[t], &vs[t], &decays[t]);
        // The state is read once, by k and q together, and written once: with S the state before
        // the token, `kᵀ(decay·S) = decay·(kᵀS)` and `qᵀS_t = decay·(qᵀS) + (q·k)·delta`.
        let read = Tensor::f_cat(&[k_t, q_t], 2)?.f_matmul(&s_t)?; // [b, h, 2, dv]
        let (k_read, q_read) = (read.f_narrow(2, 0, 1)?, read.f_narrow(2, 1, 1)?); // [b, h, 1, dv] each
        let delta = v_t.f_sub(&k_read.f_mul(decay)?)?.f_mul(&rates[t])?; // [b, h, 1, dv]
        let qk = q_t.f_mul(k_t)?.f_sum_dim_intlist(-1, true, Kind::Float)?; // [b, h, 1, 1]
        out.push(q_read.f_mul(decay)?.f_add(&qk.f_mul(&delta)?)?); // [b, h, 1, dv]

        // decay·S + k ⊗ delta, the product added in place to the decayed state (a fresh one, or
        // the caller's buffer).
        let k_col = k_t.f_transpose(-1, -2)?; // [b, h, dk, 1]
        s_t = match in_place {
            true => s_t.f_mul_(decay)?.f_addcmul_(&k_col, &delta)?,
            false => s_t.f_mul(decay)?.f_addcmul_(&k_col, &delta)?,
        };
    }
    let o = Tensor::f_cat(&out, 2)?; // [b, h, s, dv]
    Ok((o.f_transpose(1, 2)?.f_to_kind(kind)?.f_contiguous()?, s_t))
}

/// The recurrence chunk by chunk (prompts and training), equal to [`recurrent`] up to the order
/// of float sums. `starts` marks the tokens that begin a new sequence of a packed row: there the
/// state is dropped, exactly — within a chunk no token reads a write from before its sequence's
/// start, and no chunk carries a state across one.
///
/// # Shapes
/// - `q`, `k`: `[b, s, hk, dk]`; `v`: `[b, s, hv, dv]`; `g`, `beta`: `[b, s, hv]`; `state`:
///   `[b, hv, dk, dv]` f32; `starts`: `[b, s]` bool → (`[b, s, hv, dv]` in `v`'s dtype, the state
///   after the last token)
pub fn chunked(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    state: Option<&Tensor>,
    starts: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let kind = v.kind();
    let seq = q.size()[1];
    let [q, k, v, g, beta] = prepare(q, k, v, g, beta)?;
    let (b, h, dk, dv) = (q.size()[0], q.size()[1], q.size()[3], v.size()[3]);
    let chunk = chunk_len(seq, q.device());
    let pad = (chunk - seq % chunk) % chunk;
    let n = (seq + pad) / chunk;
    // Zero tokens after the end: no decay, no write; their outputs are dropped.
    let chunks = |x: &Tensor, d: i64| -> Result<Tensor> {
        Ok(x.f_constant_pad_nd([0, 0, 0, pad])?.f_view([b, h, n, chunk, d])?)
    };
    let v_beta = chunks(&v.f_mul(&beta.f_unsqueeze(-1)?)?, dv)?; // [b, h, n, C, dv]
    let k_beta = chunks(&k.f_mul(&beta.f_unsqueeze(-1)?)?, dk)?; // [b, h, n, C, dk]
    let (q, k) = (chunks(&q, dk)?, chunks(&k, dk)?);
    let cum = g.f_constant_pad_nd([0, pad])?.f_view([b, h, n, chunk])?.f_cumsum(-1, Kind::Float)?; // [b, h, n, C]

    // Within a chunk, token i sees token j ≤ i decayed by exp(cum_i − cum_j).
    let device = q.device();
    let mut hidden = Tensor::f_ones([chunk, chunk], (Kind::Bool, device))?.f_triu(1)?; // j > i

    // Packed rows: `count` = starts at or before each token of its chunk; i sees j only with no
    // start in (j, i]; only tokens before the chunk's first start read the carried state, only
    // those after its last start write the state carried on.
    let mut read_old = None;
    let mut write_on = None;
    if let Some(starts) = starts {
        let starts = starts.f_to_kind(Kind::Int64)?.f_constant_pad_nd([0, pad])?.f_view([b, 1, n, chunk])?;
        let count = starts.f_cumsum(-1, Kind::Int64)?; // [b, 1, n, C]
        let other = count.f_unsqueeze(-1)?.f_ne_tensor(&count.f_unsqueeze(-2)?)?; // [b, 1, n, C, C]
        hidden = other.f_logical_or(&hidden)?;
        read_old = Some(count.f_eq(0)?.f_to_kind(Kind::Float)?); // [b, 1, n, C]
        let last = count.f_narrow(-1, chunk - 1, 1)?;
        write_on = Some(count.f_eq_tensor(&last)?.f_to_kind(Kind::Float)?); // [b, 1, n, C]
    }
    let decay =
        cum.f_unsqueeze(-1)?.f_sub(&cum.f_unsqueeze(-2)?)?.f_masked_fill(&hidden, f64::NEG_INFINITY)?.f_exp()?; // [b, h, n, C, C]
    let kt = k.f_transpose(-1, -2)?; // [b, h, n, dk, C]
    let ut = k_beta.f_matmul(&kt)?.f_mul(&decay)?; // strictly lower part: the writes' interactions
    let intra = q.f_matmul(&kt)?.f_mul(&decay)?; // [b, h, n, C, C]
    let cum_exp = cum.f_exp()?.f_unsqueeze(-1)?; // [b, h, n, C, 1]
    let mut decayed_k_beta = k_beta.f_mul(&cum_exp)?;
    let mut q = q.f_mul(&cum_exp)?;
    let last = cum.f_narrow(-1, chunk - 1, 1)?; // [b, h, n, 1]
    let mut k = k.f_mul(&last.f_sub(&cum)?.f_exp()?.f_unsqueeze(-1)?)?;
    let mut chunk_decay = last.f_exp()?.f_unsqueeze(-1)?; // [b, h, n, 1, 1]
    if let (Some(read), Some(write)) = (&read_old, &write_on) {
        let read = read.f_unsqueeze(-1)?;
        decayed_k_beta = decayed_k_beta.f_mul(&read)?;
        q = q.f_mul(&read)?;
        k = k.f_mul(&write.f_unsqueeze(-1)?)?;
        chunk_decay = chunk_decay.f_mul(&read.f_narrow(-2, chunk - 1, 1)?)?;
    }
    // UT transform: (I + strictly_lower(ut))⁻¹ applied to the values and to the decayed keys (two
    // triangular solves: forming the inverse, as transformers' reference does, measured faster on
    // a CPU but moved a router's gradient in Qwen3-Next by 1e-4 of its size).
    let new_values = ut.f_linalg_solve_triangular(&v_beta, false, true, true)?; // [b, h, n, C, dv]
    let k_cumdecay = ut.f_linalg_solve_triangular(&decayed_k_beta, false, true, true)?; // [b, h, n, C, dk]

    let mut s_t = initial_state(state, &k.f_view([b, h, -1, dk])?, &v)?;
    // One view per chunk (a single backward each, see `recurrent`).
    let chunks_of = |x: &Tensor| x.f_unbind(2);
    let (values, reads, queries) = (chunks_of(&new_values)?, chunks_of(&k_cumdecay)?, chunks_of(&q)?);
    let (intras, decays, keys) = (chunks_of(&intra)?, chunks_of(&chunk_decay)?, chunks_of(&k)?);
    let mut out = Vec::with_capacity(n as usize);
    for i in 0..n as usize {
        let v_new = values[i].f_sub(&reads[i].f_matmul(&s_t)?)?; // [b, h, C, dv]
        out.push(queries[i].f_matmul(&s_t)?.f_add(&intras[i].f_matmul(&v_new)?)?);
        s_t = s_t.f_mul(&decays[i])?.f_add(&keys[i].f_transpose(-1, -2)?.f_matmul(&v_new)?)?;
    }
    let o = Tensor::f_cat(&out, 2)?.f_narrow(2, 0, seq)?; // [b, h, s, dv]
    Ok((o.f_transpose(1, 2)?.f_to_kind(kind)?.f_contiguous()?, s_t))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    thread_local! {
        /// A chunk length the tests impose on [`chunked`] (every device's choice runs on a CPU).
        pub(super) static CHUNK_OVERRIDE: std::cell::Cell<Option<i64>> = const { std::cell::Cell::new(None) };
    }

    fn inputs(b: i64, s: i64, hk: i64, hv: i64, d: i64) -> [Tensor; 5] {
        tch::manual_seed(3);
        let opts = (Kind::Float, Device::Cpu);
        let q = Tensor::randn([b, s, hk, d], opts);
        let k = Tensor::randn([b, s, hk, d], opts);
        let v = Tensor::randn([b, s, hv, d], opts);
        let g = Tensor::rand([b, s, hv], opts).f_mul_scalar(-0.3).unwrap();
        let beta = Tensor::rand([b, s, hv], opts);
        [q, k, v, g, beta]
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a - b).abs().max().double_value(&[])
    }

    #[test]
    fn chunked_equals_recurrent_over_several_chunks_and_from_a_state() {
        let [q, k, v, g, beta] = inputs(2, 2 * CHUNK + 9, 2, 4, 8);
        let (o_r, s_r) = recurrent(&q, &k, &v, &g, &beta, None, false).unwrap();
        let (o_c, s_c) = chunked(&q, &k, &v, &g, &beta, None, None).unwrap();
        assert!(max_diff(&o_r, &o_c) < 1e-4, "outputs differ by {}", max_diff(&o_r, &o_c));
        assert!(max_diff(&s_r, &s_c) < 1e-4, "states differ by {}", max_diff(&s_r, &s_c));
        // Continuing from a state: the second half after the first equals the whole.
        let split = CHUNK + 3;
        let part = |x: &Tensor, from: i64, len: i64| x.narrow(1, from, len);
        let rest = q.size()[1] - split;
        let (_, s1) = chunked(
            &part(&q, 0, split),
            &part(&k, 0, split),
            &part(&v, 0, split),
            &part(&g, 0, split),
            &part(&beta, 0, split),
            None,
            None,
        )
        .unwrap();
        let (o2, s2) = chunked(
            &part(&q, split, rest),
            &part(&k, split, rest),
            &part(&v, split, rest),
            &part(&g, split, rest),
            &part(&beta, split, rest),
            Some(&s1),
            None,
        )
        .unwrap();
        assert!(max_diff(&o2, &o_r.narrow(1, split, rest)) < 1e-4);
        assert!(max_diff(&s2, &s_r) < 1e-4);
    }

    /// Every chunk length computes the recurrence: 16, 32 and 48 (a CPU's for short sequences)
    /// and 64, over several chunks, a last one cut short and packed starts.
    #[test]
    fn every_chunk_length_equals_the_recurrence() {
        let [q, k, v, g, beta] = inputs(2, 137, 2, 4, 8);
        let starts = Tensor::zeros([2, 137], (Kind::Bool, Device::Cpu));
        let _ = starts.narrow(1, 50, 1).fill_(1);
        let (o_r, s_r) = recurrent(&q, &k, &v, &g, &beta, None, false).unwrap();
        for chunk in [16, 32, 48, 64] {
            CHUNK_OVERRIDE.with(|c| c.set(Some(chunk)));
            let (o_c, s_c) = chunked(&q, &k, &v, &g, &beta, None, None).unwrap();
            let (o_p, _) = chunked(&q, &k, &v, &g, &beta, None, Some(&starts)).unwrap();
            CHUNK_OVERRIDE.with(|c| c.set(None));
            assert!(max_diff(&o_r, &o_c) < 1e-4, "chunk {chunk}: outputs differ by {}", max_diff(&o_r, &o_c));
            assert!(max_diff(&s_r, &s_c) < 1e-4, "chunk {chunk}: states differ by {}", max_diff(&s_r, &s_c));
            // After the start at 50, the row is the sequence from 50 run alone.
            let p = |x: &Tensor| x.narrow(1, 50, 87);
            let (alone, _) = recurrent(&p(&q), &p(&k), &p(&v), &p(&g), &p(&beta), None, false).unwrap();
            let d = max_diff(&o_p.narrow(1, 50, 87), &alone);
            assert!(d < 1e-4, "chunk {chunk}: the packed sequence differs by {d}");
        }
    }

    /// A decode step that updates its state where it lies computes what the plain step does, and
    /// leaves the new state in the caller's buffer.
    #[test]
    fn a_step_in_place_equals_the_plain_step() {
        let [q, k, v, g, beta] = inputs(3, 1, 2, 4, 8);
        let before = Tensor::randn([3, 4, 8, 8], (Kind::Float, Device::Cpu));
        let (o, s_new) = recurrent(&q, &k, &v, &g, &beta, Some(&before), false).unwrap();
        let buffer = before.copy();
        let (o_in, s_in) = tch::no_grad(|| recurrent(&q, &k, &v, &g, &beta, Some(&buffer), true)).unwrap();
        assert_eq!(s_in.data_ptr(), buffer.data_ptr());
        assert!(max_diff(&o, &o_in) == 0.0 && max_diff(&s_new, &buffer) == 0.0);
        assert!(max_diff(&before, &buffer) > 0.0);
    }

    #[test]
    fn packed_starts_drop_the_state_exactly() {
        // Row 0: one sequence of 70 then one of 80 (a start inside the second chunk); each must
        // equal the sequence run alone.
        let (a, c) = (70, 80);
        let [q, k, v, g, beta] = inputs(1, a + c, 1, 2, 4);
        let starts = Tensor::zeros([1, a + c], (Kind::Bool, Device::Cpu));
        let _ = starts.narrow(1, a, 1).fill_(1);
        let (o, _) = chunked(&q, &k, &v, &g, &beta, None, Some(&starts)).unwrap();
        for (from, len) in [(0, a), (a, c)] {
            let p = |x: &Tensor| x.narrow(1, from, len);
            let (alone, _) = recurrent(&p(&q), &p(&k), &p(&v), &p(&g), &p(&beta), None, false).unwrap();
            let d = max_diff(&o.narrow(1, from, len), &alone);
            assert!(d < 1e-4, "segment at {from} differs by {d}");
        }
    }
}
