//! Linear layers in both weight layouts, and the MLP activations.

use tch::{Kind, Tensor};

use crate::config::Activation;
use crate::error::Result;
use crate::weights::WeightLoader;

/// `y = x Wᵀ + b` with `W: [out, in]` (torch `nn.Linear`), or `y = x W + b` with `W: [in, out]`
/// (GPT-2's `Conv1D`, stored transposed; we keep it as stored so saving round-trips bit-exactly).
#[derive(Debug)]
pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    pub(crate) transposed: bool,
    /// A LoRA update added to the output, when applied.
    pub lora: Option<crate::lora::LoraAdapter>,
}

impl Linear {
    /// Loads `weight: [out, in]` and, if `bias`, `bias: [out]`.
    pub fn load(w: &WeightLoader, in_dim: i64, out_dim: i64, bias: bool) -> Result<Self> {
        let weight = w.get("weight", &[out_dim, in_dim])?;
        let bias = if bias { Some(w.get("bias", &[out_dim])?) } else { None };
        Ok(Linear { weight, bias, transposed: false, lora: None })
    }

    /// Loads a GPT-2 `Conv1D`: `weight: [in, out]`, `bias: [out]`.
    pub fn load_conv1d(w: &WeightLoader, in_dim: i64, out_dim: i64) -> Result<Self> {
        let weight = w.get("weight", &[in_dim, out_dim])?;
        let bias = Some(w.get("bias", &[out_dim])?);
        Ok(Linear { weight, bias, transposed: true, lora: None })
    }

    /// `(in, out)` feature sizes.
    pub fn dims(&self) -> (i64, i64) {
        let s = self.weight.size();
        if self.transposed {
            (s[0], s[1])
        } else {
            (s[1], s[0])
        }
    }

    /// Whether the weight is stored `[in, out]` (GPT-2's `Conv1D`).
    pub fn transposed(&self) -> bool {
        self.transposed
    }

    /// # Shapes
    /// - `x`: `[..., in]` → `[..., out]`
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = if self.transposed {
            let y = x.f_matmul(&self.weight)?;
            match &self.bias {
                Some(b) => y.f_add(b)?,
                None => y,
            }
        } else {
            linear(x, &self.weight, self.bias.as_ref())?
        };
        match &self.lora {
            Some(l) if !l.is_disabled() => l.forward(x)?.f_add(&y).map_err(Into::into),
            _ => Ok(y),
        }
    }
}

/// Rows up to which [`linear`] puts the weight on the left on the CPU.
pub const FEW_ROWS: i64 = 32;

/// `y = x Wᵀ + b` (torch's `F.linear`) with `W: [out, in]`.
///
/// On the CPU in f32 with at most [`FEW_ROWS`] rows — a decode step — it is computed as `(W xᵀ)ᵀ`.
/// MKL's sgemm first copies ("packs") its right-hand operand into panels; in `x Wᵀ` that operand
/// is the whole weight, re-packed on every call, which at 16 rows took about as long as the
/// product itself. With the weight on the left it is streamed once and only the few rows of `x`
/// are packed: 1.1–1.8× faster per layer of SmolLM2 at 4–32 rows (its decode at 16 rows 1.25×,
/// at 32 rows 1.1×; a 3M-parameter Qwen2's at 32 rows ~1.2×), the same sums in another order
/// (results within f32 rounding of `F.linear`'s). From 64 rows on the two are even, and at 128
/// `F.linear` wins, so larger inputs, bf16 (oneDNN is faster there) and other devices use `F.linear`.
///
/// # Shapes
/// - `x`: `[..., in]`, `w`: `[out, in]`, `bias`: `[out]` → `[..., out]`
pub fn linear(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let (out, inp) = (w.size()[0], w.size()[1]);
    let rows = if inp == 0 { 0 } else { x.numel() as i64 / inp };
    // bf16 goes to oneDNN's kernels through `F.linear`, which are faster there (SmolLM2's decode
    // GEMMs at 16 rows: 17 ms with `F.linear`, 26 ms weight-on-the-left).
    let f32_cpu = w.device() == tch::Device::Cpu && w.kind() == Kind::Float;
    if !f32_cpu || x.dim() == 0 || rows == 0 || rows > FEW_ROWS {
        return Ok(x.f_linear(w, bias)?);
    }
    let y = w.f_mm(&x.f_reshape([rows, inp])?.f_transpose(0, 1)?)?.f_transpose(0, 1)?; // [rows, out], column-major
    let y = match bias {
        Some(b) => y.f_add(b)?,
        None => y,
    };
    let mut shape = x.size();
    if let Some(last) = shape.last_mut() {
        *last = out;
    }
    Ok(y.f_contiguous()?.f_view(shape.as_slice())?)
}

/// Applies an MLP activation elementwise.
pub fn activate(x: &Tensor, act: Activation) -> Result<Tensor> {
    Ok(match act {
        Activation::Silu => x.f_silu()?,
        Activation::GeluTanh => x.f_gelu("tanh")?,
        Activation::Gelu => x.f_gelu("none")?,
        Activation::Relu => x.f_relu()?,
    })
}
