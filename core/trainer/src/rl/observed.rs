//! Images in an environment's observations (a tool's screenshot, a rendered page): an
//! observation's `<image>` markers become the policy's image placeholders, one run per image as in
//! a prompt ([`crate::prompt_images::PromptImages`]), and the episode keeps the images and the
//! trajectory columns of their placeholders ([`Observed`]).
//!
//! The rows of such episodes train on their prompt's images followed by their observations', in
//! placeholder order. An image token anywhere else in a trajectory — one the policy sampled — is
//! text, in generation as in training ([`rlhf_models::multimodal::Slots`]). After the rollout,
//! every rank's observed images are gathered and each such row gets a record of its own above the
//! dataset's ([`crate::rl::visual`]), so minibatches, dynamic sampling and the gathered batch find
//! them as they find a prompt's.

use std::path::PathBuf;
use std::sync::Arc;

use rlhf_models::Images;
use rlhf_plugin_api::ObservationImage;
use rlhf_tokenizer::HfTokenizer;
use rlhf_vision::ImageRef;
use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainerError};
use crate::prompt_images::PromptImages;

/// An observation's image as the run keeps it (serialisable, for the ranks' all-gather and the
/// checkpoint of batches sampled ahead).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ObservedImage {
    Path(PathBuf),
    Bytes { name: String, bytes: Vec<u8> },
}

impl ObservedImage {
    /// The image to decode.
    pub fn to_ref(&self) -> ImageRef {
        match self {
            ObservedImage::Path(p) => ImageRef::Path(p.clone()),
            ObservedImage::Bytes { name, bytes } => {
                ImageRef::Bytes { name: name.clone(), bytes: Arc::from(bytes.as_slice()) }
            }
        }
    }
}

/// What one episode's observations added to its row: their images in order and the trajectory
/// (response) columns of their placeholders.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Observed {
    pub images: Vec<ObservedImage>,
    pub slots: Vec<i64>,
}

impl Observed {
    pub fn is_empty(&self) -> bool {
        self.images.is_empty()
    }
}

/// An observation ready to append: its token ids and, when it has images, the images, their
/// patches and the indices of `ids` that are their placeholders.
pub struct Encoded {
    pub ids: Vec<i64>,
    pub images: Vec<ObservedImage>,
    pub patches: Option<Images>,
    pub placeholders: Vec<usize>,
}

/// How an episode's observation images are read: by the policy's processor, or — for a policy
/// that reads none — refused with the reason.
#[derive(Clone, Copy)]
pub enum ObservationImages<'a> {
    Read(&'a PromptImages),
    Refused(&'static str),
}

/// `text` tokenized, its `<image>` markers expanded to `images`' placeholder runs (`at` names the
/// episode and turn); `Err` with a message for the episode when they cannot be (the episode
/// fails, as for an environment's error).
pub fn encode(
    tok: &HfTokenizer,
    text: &str,
    images: Vec<ObservationImage>,
    how: ObservationImages<'_>,
    at: &str,
) -> Result<std::result::Result<Encoded, String>> {
    if images.is_empty() {
        let ids = tok.encode(text, false)?.into_iter().map(i64::from).collect();
        return Ok(Ok(Encoded { ids, images: Vec::new(), patches: None, placeholders: Vec::new() }));
    }
    let processor = match how {
        ObservationImages::Read(p) => p,
        ObservationImages::Refused(why) => return Ok(Err(format!("{at}: an observation with images, and {why}"))),
    };
    let mut kept = Vec::with_capacity(images.len());
    for (i, image) in images.into_iter().enumerate() {
        kept.push(match image {
            ObservationImage::Bytes(bytes) => ObservedImage::Bytes { name: format!("{at} image {i}"), bytes },
            ObservationImage::Path(p) if p.is_absolute() => ObservedImage::Path(p),
            ObservationImage::Path(p) => {
                return Ok(Err(format!("{at}: image {i}: `{}` is not an absolute path", p.display())));
            }
        });
    }
    let refs: Vec<ImageRef> = kept.iter().map(ObservedImage::to_ref).collect();
    // Each image decoded once: its patches carry the grid the placeholders are expanded to.
    let patches = match processor.patches(&refs) {
        Ok(p) => p,
        Err(TrainerError::Run(e)) => return Ok(Err(format!("{at}: {e}"))),
        Err(e) => return Err(e),
    };
    let grids: Vec<[usize; 3]> = patches.grids.iter().map(|g| g.map(|x| x as usize)).collect();
    let ids = match processor.expand_grids(text, tok, false, &grids, at) {
        Ok((_, ids)) => ids,
        Err(TrainerError::Run(e)) => return Ok(Err(e)),
        Err(e) => return Err(e),
    };
    let placeholder = processor.placeholder();
    let placeholders = ids.iter().enumerate().filter(|(_, &t)| t == placeholder).map(|(i, _)| i).collect();
    let ids = ids.into_iter().map(i64::from).collect();
    Ok(Ok(Encoded { ids, images: kept, patches: Some(patches), placeholders }))
}

impl<'a> ObservationImages<'a> {
    /// For a policy that reads images with `images` (sampled by the trainer or by the vLLM
    /// engine, which is sent the images with each turn's context).
    pub fn of(images: Option<&'a PromptImages>) -> Self {
        match images {
            Some(p) => ObservationImages::Read(p),
            None => ObservationImages::Refused("the policy reads no images"),
        }
    }
}
