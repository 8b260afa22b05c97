//! Projections that share an input (q, k and v; gate and up) computed as one GEMM.
//!
//! The parameters stay what they are — one variable per checkpoint name, so the optimizer, LoRA,
//! ZeRO and saving see transformers' names and shapes — but at load their storage is laid out
//! back to back in one buffer ([`FusedRows::new`] re-points each weight and bias at its slice).
//! Every pass computes them as one GEMM against the weights stacked: a pass that sends no
//! gradient to them (generation, old log-probs, the frozen reference) reads the buffer itself; a
//! pass that trains them stacks the parameters with `cat` (a copy of the weights, through which
//! autograd splits the gradient back), and when a parameter's storage was swapped since (ZeRO
//! stage 3 gathers a sharded weight into new storage) so does every pass — a sharded model lets
//! go of its buffers ([`FusedRows::release`]), which would otherwise keep every part's weights
//! whole on every rank. The stacked values are
//! the buffer's bit for bit, so every pass computes the same numbers — sampling, scoring and
//! training agree exactly, with or without activation checkpointing. Layers with an active LoRA
//! adapter run their parts one by one.

use tch::Tensor;

use super::{grad_enabled, linear, Linear};
use crate::error::Result;

/// The buffer behind several [`Linear`]s' weights (and biases), stacked along the output rows.
#[derive(Debug)]
pub struct FusedRows {
    weight: Tensor,       // [Σ out, in]
    bias: Option<Tensor>, // [Σ out]
}

impl FusedRows {
    /// Moves the weights (and biases, when every part has one) of `parts` into one buffer and
    /// makes each part's tensors views of their rows. `None` for layers stored `[in, out]`
    /// (GPT-2's `Conv1D`), of different input sizes or kinds, or with a bias on some parts only,
    /// which stay as they are.
    pub fn new(parts: &mut [&mut Linear]) -> Result<Option<FusedRows>> {
        let Some(first) = parts.first() else { return Ok(None) };
        let (in_dim, kind, device) = (first.dims().0, first.weight.kind(), first.weight.device());
        let with_bias = first.bias.is_some();
        let same = parts.iter().all(|p| {
            !p.transposed()
                && p.dims().0 == in_dim
                && p.weight.kind() == kind
                && p.weight.device() == device
                && p.bias.is_some() == with_bias
                && p.bias.as_ref().is_none_or(|b| b.kind() == kind)
        });
        if !same {
            return Ok(None);
        }
        let weight = tch::no_grad(|| Tensor::f_cat(&parts.iter().map(|p| &p.weight).collect::<Vec<_>>(), 0))?;
        let bias = if with_bias {
            let biases: Vec<&Tensor> = parts.iter().filter_map(|p| p.bias.as_ref()).collect();
            Some(tch::no_grad(|| Tensor::f_cat(&biases, 0))?)
        } else {
            None
        };
        let mut row = 0;
        for p in parts.iter_mut() {
            let out = p.dims().1;
            p.weight.f_set_data(&weight.f_narrow(0, row, out)?)?;
            if let (Some(b), Some(all)) = (p.bias.as_mut(), bias.as_ref()) {
                b.f_set_data(&all.f_narrow(0, row, out)?)?;
            }
            row += out;
        }
        Ok(Some(FusedRows { weight, bias }))
    }

    /// A buffer the parts already view, row after row (no bias): a mixture's experts whose
    /// weights were laid in one stack after their own buffers were made.
    ///
    /// # Shapes
    /// `weight`: `[Σ out, in]`
    pub(crate) fn over(weight: Tensor) -> FusedRows {
        FusedRows { weight, bias: None }
    }

    /// Lets go of the buffer: ZeRO stage 3 frees each variable's storage while the model is
    /// sharded and gathers it into new storage, so a buffer kept here would hold every part's
    /// whole weights on every rank, stale. Every later pass stacks the parts with `cat`.
    pub fn release(&mut self) {
        self.weight = Tensor::new();
        if self.bias.is_some() {
            self.bias = Some(Tensor::new());
        }
    }

    /// Whether the buffer itself can stand for `parts` in this pass: no gradient would reach
    /// them (grad mode off, or frozen weights) and each still views its rows. Host work only: no
    /// tensor operation is dispatched.
    fn reads_buffer(&self, parts: &[&Linear]) -> bool {
        if !self.weight.defined() {
            return false;
        }
        let grad = grad_enabled();
        let mut row = 0i64;
        let elt = self.weight.kind().elt_size_in_bytes() as i64;
        let base = self.weight.data_ptr() as i64;
        for p in parts {
            if grad && p.weight.requires_grad() {
                return false;
            }
            let (in_dim, out) = p.dims();
            if p.weight.data_ptr() as i64 != base + row * in_dim * elt {
                return false;
            }
            if let (Some(b), Some(all)) = (&p.bias, &self.bias) {
                if b.data_ptr() as i64 != all.data_ptr() as i64 + row * elt {
                    return false;
                }
            }
            row += out;
        }
        row == self.weight.size()[0]
    }

    /// The outputs of `parts` side by side, `[..., Σ out]`, as one GEMM (see the module docs);
    /// `None` when a part has an active LoRA adapter (the caller runs the parts).
    ///
    /// # Shapes
    /// - `x`: `[..., in]` → `[..., Σ out]`
    pub fn try_forward(this: Option<&FusedRows>, parts: &[&Linear], x: &Tensor) -> Result<Option<Tensor>> {
        let Some(f) = this else { return Ok(None) };
        if parts.iter().any(|p| p.lora.as_ref().is_some_and(|l| !l.is_disabled())) {
            return Ok(None);
        }
        if f.reads_buffer(parts) {
            return Ok(Some(linear(x, &f.weight, f.bias.as_ref())?));
        }
        let weight = Tensor::f_cat(&parts.iter().map(|p| &p.weight).collect::<Vec<_>>(), 0)?;
        let bias = match f.bias {
            Some(_) => Some(Tensor::f_cat(&parts.iter().filter_map(|p| p.bias.as_ref()).collect::<Vec<_>>(), 0)?),
            None => None,
        };
        Ok(Some(linear(x, &weight, bias.as_ref())?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{nn, Device, Kind};

    fn linear(vs: &nn::Path<'_>, name: &str, out: i64, inp: i64) -> Linear {
        let p = vs.sub(name);
        let w = p.f_var_copy("weight", &Tensor::randn([out, inp], (Kind::Float, Device::Cpu))).unwrap();
        let b = p.f_var_copy("bias", &Tensor::randn([out], (Kind::Float, Device::Cpu))).unwrap();
        Linear { weight: w, bias: Some(b), transposed: false, lora: None }
    }

    /// The parts become views of one buffer (the var store's variables too), one GEMM gives
    /// their outputs side by side, and a pass that trains them does not take it.
    #[test]
    fn parts_share_one_buffer_and_one_gemm() {
        let vs = nn::VarStore::new(Device::Cpu);
        let root = vs.root();
        let (mut q, mut k) = (linear(&root, "q", 6, 4), linear(&root, "k", 2, 4));
        let x = Tensor::randn([3, 4], (Kind::Float, Device::Cpu));
        let want = Tensor::cat(&[q.forward(&x).unwrap(), k.forward(&x).unwrap()], -1);
        let fused = FusedRows::new(&mut [&mut q, &mut k]).unwrap().unwrap();
        assert_eq!(vs.variables()["k.weight"].data_ptr(), k.weight.data_ptr());
        let got = tch::no_grad(|| FusedRows::try_forward(Some(&fused), &[&q, &k], &x)).unwrap();
        let got = got.expect("one GEMM without gradients");
        assert!(got.allclose(&want, 1e-6, 1e-6, false));
        // A trained pass stacks the parameters: the same numbers, and gradients reach each.
        let trained = FusedRows::try_forward(Some(&fused), &[&q, &k], &x).unwrap().unwrap();
        assert!(trained.equal(&got));
        trained.sum(Kind::Float).backward();
        assert!(q.weight.grad().defined() && k.bias.as_ref().unwrap().grad().defined());
        // An optimizer's in-place update reaches the buffer.
        let _ = tch::no_grad(|| vs.variables()["q.weight"].shallow_clone().fill_(0.5));
        let after = tch::no_grad(|| FusedRows::try_forward(Some(&fused), &[&q, &k], &x)).unwrap().unwrap();
        assert!(after.narrow(1, 0, 6).allclose(
            &(x.sum_dim_intlist(-1, true, Kind::Float) * 0.5 + q.bias.as_ref().unwrap()),
            1e-5,
            1e-5,
            false
        ));
    }

    /// A released buffer is freed once its parts no longer view it, as when ZeRO stage 3 frees
    /// the variables' storage: nothing else keeps the parts' weights whole. (Resident memory of
    /// this process, Linux only; 256 MB against allocations of a few MB by the other tests.)
    #[test]
    fn a_released_buffer_is_freed_with_its_parts() {
        let rss_mb = || -> Option<i64> {
            let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
            Some(statm.split_whitespace().nth(1)?.parse::<i64>().ok()? * 4096 / (1 << 20))
        };
        if rss_mb().is_none() {
            return;
        }
        let vs = nn::VarStore::new(Device::Cpu);
        let root = vs.root();
        let part = |name: &str| {
            let w = root.f_var_copy(name, &Tensor::ones([4096, 8192], (Kind::Float, Device::Cpu))).unwrap();
            Linear { weight: w, bias: None, transposed: false, lora: None }
        };
        let (mut a, mut b) = (part("a"), part("b"));
        let mut fused = FusedRows::new(&mut [&mut a, &mut b]).unwrap().unwrap();
        for p in [&a, &b] {
            p.weight.shallow_clone().set_data(&Tensor::empty([0], (Kind::Float, Device::Cpu)));
        }
        let held = rss_mb().unwrap();
        fused.release();
        let freed = held - rss_mb().unwrap();
        assert!(freed >= 200, "releasing a 256 MB buffer freed {freed} MB");
        // Without the buffer the parts are stacked per pass.
        let x = Tensor::ones([1, 4], (Kind::Float, Device::Cpu));
        let (mut q, mut k) = (linear(&root, "q", 6, 4), linear(&root, "k", 2, 4));
        let want = Tensor::cat(&[q.forward(&x).unwrap(), k.forward(&x).unwrap()], -1);
        let mut small = FusedRows::new(&mut [&mut q, &mut k]).unwrap().unwrap();
        small.release();
        let got = tch::no_grad(|| FusedRows::try_forward(Some(&small), &[&q, &k], &x)).unwrap().unwrap();
        assert!(got.allclose(&want, 1e-6, 1e-6, false));
    }
}
