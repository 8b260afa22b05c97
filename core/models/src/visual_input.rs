//! Image features as a decoder's embedding step takes them (see [`crate::multimodal`]).

use tch::{Kind, Tensor};

use crate::error::Result;

/// Where a batch's image placeholders are: the image tokens among the first `prompt_len` columns,
/// and after them those `observed` marks — the images of an environment's observations in a
/// multi-turn episode. Any other image token (one the policy sampled) is text, as generation read
/// it.
#[derive(Debug)]
pub struct Slots {
    pub prompt_len: i64,
    /// `[batch, seq]`, non-zero where an observation's placeholder may be.
    pub observed: Option<Tensor>,
}

impl Slots {
    /// Placeholders in the first `prompt_len` columns only.
    pub fn prompt(prompt_len: i64) -> Slots {
        Slots { prompt_len, observed: None }
    }

    /// The same slots, sharing storage.
    pub fn shallow_clone(&self) -> Slots {
        Slots { prompt_len: self.prompt_len, observed: self.observed.as_ref().map(Tensor::shallow_clone) }
    }

    /// Where a placeholder may be, on `ids`' device.
    ///
    /// # Shapes
    /// - `ids`: `[batch, seq]` → `[batch, seq]` bool
    pub fn mask(&self, ids: &Tensor) -> Result<Tensor> {
        let size = ids.size();
        let columns = Tensor::f_arange(size[1], (Kind::Int64, ids.device()))?.f_lt(self.prompt_len)?;
        let mask = columns.f_unsqueeze(0)?.f_expand(&size, false)?;
        Ok(match &self.observed {
            Some(o) => mask.f_logical_or(&o.f_to_device(ids.device())?.f_ne(0)?)?,
            None => mask.f_contiguous()?,
        })
    }
}

/// Image features and where they go ([`Slots`]).
#[derive(Debug)]
pub struct Visual {
    /// `[placeholders, hidden]`, from [`crate::CausalLm::visual`].
    pub features: Tensor,
    /// Qwen3-VL's deep-stack features, `[placeholders, hidden]` each: the `j`-th is added to the
    /// output of decoder layer `j` at the placeholders (none for other models).
    pub deepstack: Vec<Tensor>,
    pub slots: Slots,
}

impl Visual {
    /// The same features and slots, sharing storage.
    pub fn shallow_clone(&self) -> Visual {
        Visual {
            features: self.features.shallow_clone(),
            deepstack: self.deepstack.iter().map(Tensor::shallow_clone).collect(),
            slots: self.slots.shallow_clone(),
        }
    }
}
