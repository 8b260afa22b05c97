//! Qwen2.5-VL (Bai et al. 2025, "Qwen2.5-VL Technical Report") — transformers'
//! `modeling_qwen2_5_vl.py` (`Qwen2_5_VLForConditionalGeneration`, `model_type` `qwen2_5_vl`).
//! The language model is Qwen2 ([`crate::llama`]: biased q/k/v, RMSNorm, SwiGLU) with the
//! multimodal RoPE ([`crate::config::Mrope`], contiguous sections, `[16, 24, 24]` on the released
//! sizes); the vision tower is [`crate::vision_tower`]. An image's features replace its
//! `<|image_pad|>` placeholders in the token embeddings, and its tokens take 3-D positions
//! ([`mrope_positions`]).
//!
//! The Hub's checkpoints write the text model's keys at the top level of `config.json` (with
//! `rope_scaling: {"type": "mrope", "mrope_section": [...]}`) and store the tensors under
//! `model.layers.*` and `visual.*` ([`LEGACY`]); checkpoints saved by transformers 5 nest them
//! under `text_config`, `model.language_model.*` and `model.visual.*` ([`MULTIMODAL`]). Both load,
//! and a save keeps the names it loaded.

use tch::Tensor;

use crate::config::{vision, Family, Multimodal};
use crate::error::{ModelError, Result};

/// What both layouts share.
const BASE: Multimodal = Multimodal {
    model_type: "qwen2_5_vl",
    text_model_type: "qwen2_5_vl_text",
    family: Family::Qwen2,
    language_prefix: "model.language_model",
    vision_prefixes: &["model.visual."],
    classifier: "Qwen2_5_VLForSequenceClassification",
    keys: &[
        "vision_config",
        "image_token_id",
        "video_token_id",
        "vision_start_token_id",
        "vision_end_token_id",
        "vision_token_id",
    ],
    flat: true,
    vision: Some(vision::qwen2_5_vl),
    mrope_section: None,
    text_hook: None,
    legacy: None,
};

/// Qwen2.5-VL as transformers 5 saves it.
pub(crate) const MULTIMODAL: Multimodal = Multimodal { legacy: Some(&LEGACY), ..BASE };

/// Qwen2.5-VL as the Hub stores it (transformers 4's tensor names).
pub(crate) const LEGACY: Multimodal = Multimodal { language_prefix: "model", vision_prefixes: &["visual."], ..BASE };

/// The multimodal position of every token (transformers' `get_rope_index` for images): text
/// tokens count up from 0 on all three axes; an image of `t × h × w` merged tokens starting at
/// position `p` gives its tokens `(p + t', p + h', p + w')` in time-major, row-major order, and the
/// text after it continues from `p + max(h, w)`. Padding (mask 0) is at 0. Also returns each row's
/// delta, `max(position) + 1 − tokens`, which later tokens add to their plain position.
///
/// `grids` are the images' `[t, h, w]` in patches, in the order their placeholders appear
/// (row by row); each image's placeholder run has `t·h·w / merge²` tokens. Placeholders are only
/// where `slots` allows (the prompt's columns and an environment's observations): any other image
/// token (a sampled response's) is text, as generation reads it.
///
/// # Shapes
/// - `ids`, `mask`: `[batch, seq]` int64 → positions `[3, batch, seq]` int64 and deltas `[batch]`
///   int64, on the ids' device
pub fn mrope_positions(
    ids: &Tensor,
    mask: &Tensor,
    grids: &[[i64; 3]],
    slots: &crate::visual_input::Slots,
    image_token: i64,
    video_token: i64,
    merge: i64,
) -> Result<(Tensor, Tensor)> {
    let size = ids.size();
    let (batch, seq) = (size[0], size[1]);
    let host = |t: &Tensor| -> Result<Vec<i64>> {
        Ok(Vec::<i64>::try_from(t.f_to_device(tch::Device::Cpu)?.f_to_kind(tch::Kind::Int64)?.f_reshape([-1])?)?)
    };
    let (ids_h, mask_h) = (host(ids)?, host(mask)?);
    // The observations' marks, copied to the host only when there are any.
    let observed = slots.observed.as_ref().map(|o| host(&o.f_expand(&size, false)?)).transpose()?;
    let slot =
        |b: i64, s: i64| s < slots.prompt_len || observed.as_ref().is_some_and(|o| o[(b * seq + s) as usize] != 0);
    let mut pos = vec![0i64; (3 * batch * seq) as usize];
    let mut deltas = Vec::with_capacity(batch as usize);
    let mut images = grids.iter();
    let at = |axis: i64, b: i64, s: i64| ((axis * batch + b) * seq + s) as usize;
    for b in 0..batch {
        let row = &ids_h[(b * seq) as usize..((b + 1) * seq) as usize];
        let valid: Vec<i64> = (0..seq).filter(|&s| mask_h[(b * seq + s) as usize] != 0).collect();
        let (mut current, mut max, mut k) = (0i64, -1i64, 0usize);
        while k < valid.len() {
            // A token outside the slots is text, whatever its id (a sampled response's).
            let token = if slot(b, valid[k]) { row[valid[k] as usize] } else { -1 };
            if token == video_token {
                return Err(ModelError::Input(format!("row {b}: a video placeholder (videos are not read)")));
            }
            if token != image_token {
                (0..3).for_each(|a| pos[at(a, b, valid[k])] = current);
                max = max.max(current);
                current += 1;
                k += 1;
                continue;
            }
            let Some(&[t, h, w]) = images.next() else {
                return Err(ModelError::Input(format!("row {b}: more image placeholders than images")));
            };
            let (h, w) = (h / merge, w / merge);
            let n = (t * h * w) as usize;
            let run = valid[k..].iter().take_while(|&&s| slot(b, s) && row[s as usize] == image_token).count();
            if run < n {
                return Err(ModelError::Input(format!(
                    "row {b}: {run} image placeholders where the image has {n} tokens ({t}×{h}×{w} merged patches)"
                )));
            }
            for (i, &s) in valid[k..k + n].iter().enumerate() {
                let i = i as i64;
                let (ti, hi, wi) = (i / (h * w), (i / w) % h, i % w);
                pos[at(0, b, s)] = current + ti;
                pos[at(1, b, s)] = current + hi;
                pos[at(2, b, s)] = current + wi;
                max = max.max(current + ti.max(hi).max(wi));
            }
            current += h.max(w);
            k += n;
        }
        deltas.push(max + 1 - valid.len() as i64);
    }
    if images.next().is_some() {
        return Err(ModelError::Input(format!(
            "{} images for fewer placeholders: every image needs its run of image tokens",
            grids.len()
        )));
    }
    let device = ids.device();
    Ok((
        Tensor::f_from_slice(&pos)?.f_view([3, batch, seq])?.f_to_device(device)?,
        Tensor::f_from_slice(&deltas)?.f_to_device(device)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::visual_input::Slots;

    #[test]
    fn positions_follow_transformers_rope_index() {
        // Row 0: two text tokens, a 1×4×6-patch image (2×3 merged tokens), two text tokens.
        // Row 1: left padding, three text tokens.
        let img = 9;
        let ids = Tensor::from_slice(&[1i64, 2, img, img, img, img, img, img, 3, 4, 0, 0, 0, 0, 0, 0, 0, 5, 6, 7])
            .view([2, 10]);
        let mask = Tensor::from_slice(&[1i64, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1]).view([2, 10]);
        let (pos, deltas) = mrope_positions(&ids, &mask, &[[1, 4, 6]], &Slots::prompt(100), img, 8, 2).unwrap();
        let row = |a: i64, b: i64| Vec::<i64>::try_from(pos.get(a).get(b)).unwrap();
        assert_eq!(row(0, 0), vec![0, 1, 2, 2, 2, 2, 2, 2, 5, 6]);
        assert_eq!(row(1, 0), vec![0, 1, 2, 2, 2, 3, 3, 3, 5, 6]);
        assert_eq!(row(2, 0), vec![0, 1, 2, 3, 4, 2, 3, 4, 5, 6]);
        assert_eq!(row(1, 1), vec![0, 0, 0, 0, 0, 0, 0, 0, 1, 2]);
        // 7 − 10 for the image row; 0 for text alone.
        assert_eq!(Vec::<i64>::try_from(deltas).unwrap(), vec![-3, 0]);
        let e = mrope_positions(&ids, &mask, &[], &Slots::prompt(100), img, 8, 2).unwrap_err().to_string();
        assert!(e.contains("row 0: more image placeholders than images"), "{e}");
        let e = mrope_positions(&ids, &mask, &[[1, 4, 8]], &Slots::prompt(100), img, 8, 2).unwrap_err().to_string();
        assert!(e.contains("row 0: 6 image placeholders where the image has 8 tokens"), "{e}");
        let e = mrope_positions(&ids, &mask, &[[1, 4, 6], [1, 2, 2]], &Slots::prompt(100), img, 8, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("2 images for fewer placeholders"), "{e}");
        // Sampled after an 8-token prompt, an image or video token is text: row 0's last two
        // tokens, row 1's last one.
        let ids = Tensor::from_slice(&[1i64, 2, img, img, img, img, img, img, img, 8, 0, 0, 0, 0, 0, 0, 0, 5, 6, img])
            .view([2, 10]);
        let (pos, _) = mrope_positions(&ids, &mask, &[[1, 4, 6]], &Slots::prompt(8), img, 8, 2).unwrap();
        assert_eq!(Vec::<i64>::try_from(pos.get(0).get(0)).unwrap(), vec![0, 1, 2, 2, 2, 2, 2, 2, 5, 6]);
        assert_eq!(Vec::<i64>::try_from(pos.get(0).get(1)).unwrap(), vec![0, 0, 0, 0, 0, 0, 0, 0, 1, 2]);
    }

    /// An observation's image after the prompt takes its multimodal positions where its slots are
    /// marked; an image token the policy sampled between them stays text.
    #[test]
    fn observed_placeholders_after_the_prompt_are_images() {
        let img = 9;
        // Prompt `1 img 2` (a 1×2×2-patch image, one merged token), sampled `img 5`, observed a
        // 1×4×4-patch image (2×2 merged tokens), then `6`.
        let ids = Tensor::from_slice(&[1i64, img, 2, img, 5, img, img, img, img, 6]).view([1, 10]);
        let mask = ids.ones_like();
        let observed = Tensor::from_slice(&[0i64, 0, 0, 0, 0, 1, 1, 1, 1, 0]).view([1, 10]);
        let slots = Slots { prompt_len: 3, observed: Some(observed) };
        let (pos, deltas) = mrope_positions(&ids, &mask, &[[1, 2, 2], [1, 4, 4]], &slots, img, 8, 2).unwrap();
        let axis = |a: i64| Vec::<i64>::try_from(pos.get(a).get(0)).unwrap();
        assert_eq!(axis(0), [0, 1, 2, 3, 4, 5, 5, 5, 5, 7]);
        assert_eq!(axis(1), [0, 1, 2, 3, 4, 5, 5, 6, 6, 7]);
        assert_eq!(axis(2), [0, 1, 2, 3, 4, 5, 6, 5, 6, 7]);
        assert_eq!(Vec::<i64>::try_from(deltas).unwrap(), [-2]);
        // Without the observation's slots its image has no placeholders.
        let e = mrope_positions(&ids, &mask, &[[1, 2, 2], [1, 4, 4]], &Slots::prompt(3), img, 8, 2).unwrap_err();
        assert!(e.to_string().contains("2 images for fewer placeholders"), "{e}");
    }
}
