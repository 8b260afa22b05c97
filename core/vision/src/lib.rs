//! Images for vision-language models: decoding to RGB as transformers does with Pillow
//! ([`load`]), Pillow's resampling bit for bit ([`resample`]), and the Qwen-VL image processor's
//! patches ([`qwen`]). No tch: the patches are plain `f32` rows the models turn into tensors.

pub mod error;
pub mod load;
pub mod prompt;
pub mod qwen;
pub mod resample;
pub mod shapes;

pub use error::{Result, VisionError};
pub use load::{load_bytes, load_path, RgbImage};
pub use prompt::ImageRef;
pub use qwen::{smart_resize, Patches, QwenVlProcessor};
pub use resample::{resize, Filter};
