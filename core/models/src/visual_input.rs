//! Image features as a decoder's embedding step takes them (see [`crate::multimodal`]).

use tch::Tensor;

/// Image features and where they go: the image placeholders among the first `prompt_len` columns
/// of the ids (a sampled response may hold an image token; it is text, as generation read it).
#[derive(Debug)]
pub struct Visual {
    /// `[placeholders, hidden]`, from [`crate::CausalLm::visual`].
    pub features: Tensor,
    /// Qwen3-VL's deep-stack features, `[placeholders, hidden]` each: the `j`-th is added to the
    /// output of decoder layer `j` at the placeholders (none for other models).
    pub deepstack: Vec<Tensor>,
    pub prompt_len: i64,
}

impl Visual {
    /// The same features and prompt length, sharing storage.
    pub fn shallow_clone(&self) -> Visual {
        Visual {
            features: self.features.shallow_clone(),
            deepstack: self.deepstack.iter().map(Tensor::shallow_clone).collect(),
            prompt_len: self.prompt_len,
        }
    }
}
