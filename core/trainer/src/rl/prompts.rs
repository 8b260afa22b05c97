//! Stage 1, **prompts**: the next `prompts_per_batch` prompts of the dataset, each repeated
//! `samples_per_prompt` times, with a group id per row (samples of one prompt share it).

use rlhf_tokenizer::HfTokenizer;
use tch::Device;

use crate::data::PromptDataset;
use crate::error::Result;
use rlhf_generation::{left_pad, PaddedBatch};

/// One generation batch of prompts.
pub struct PromptBatch {
    /// Left-padded prompt ids and their mask, `[P·G, prompt_len]`.
    pub padded: PaddedBatch,
    /// Per row: (index into the dataset's records, group id). Group ids count prompts over the
    /// whole run, so they are unique across steps.
    pub group_of_row: Vec<(usize, i64)>,
    /// The rows' images in row order, when the policy reads images and the rows hold some
    /// (set once the batch is this rank's, see [`crate::rl::visual`]).
    pub images: Option<rlhf_models::Images>,
    /// The rows' image files, for an engine that processes images itself (vLLM); set with
    /// `images`.
    pub image_files: Option<ImageFiles>,
}

/// The image files of a batch's rows as the dataset names them (paths or encoded bytes), for an
/// engine that decodes and patches them itself.
#[derive(Debug, Clone)]
pub struct ImageFiles {
    /// The token a prompt repeats once per merged patch of each of its images.
    pub placeholder: u32,
    /// Per row: its prompt's images, in placeholder order (none for a text-only row).
    pub rows: Vec<Vec<rlhf_vision::ImageRef>>,
}

/// Token ids as the models take them.
pub fn ids_i64(ids: &[u32]) -> Vec<i64> {
    ids.iter().map(|&i| i64::from(i)).collect()
}

/// Draws the next `prompts` prompts and lays out `g` rows for each.
///
/// # Shapes
/// Returns `padded.input_ids`, `padded.attention_mask`: `[prompts · g, longest prompt]`.
pub fn next_batch(
    data: &mut PromptDataset,
    tok: &HfTokenizer,
    prompts: usize,
    g: usize,
    prompts_seen: &mut usize,
    device: Device,
) -> Result<PromptBatch> {
    let prompt_idx = data.next_batch(prompts);
    let mut rows = Vec::with_capacity(prompts * g);
    let mut group_of_row = Vec::with_capacity(prompts * g);
    for (k, &i) in prompt_idx.iter().enumerate() {
        for _ in 0..g {
            rows.push(ids_i64(&data.records[i].ids));
            group_of_row.push((i, (*prompts_seen + k) as i64));
        }
    }
    *prompts_seen += prompts;
    let padded = left_pad(&rows, i64::from(tok.pad_token_id()), device)?;
    Ok(PromptBatch { padded, group_of_row, images: None, image_files: None })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DataConfig;

    /// Three prompts × two samples: rows repeat each prompt, group ids count prompts over the run
    /// (so they stay unique across steps), and the batch is left-padded to the longest prompt.
    #[test]
    fn rows_repeat_prompts_and_group_ids_count_prompts() {
        let dir = tempfile::tempdir().unwrap();
        crate::builtin_models::write_tiny_model(dir.path(), 1).unwrap();
        let tok = HfTokenizer::from_dir(dir.path()).unwrap();
        let raw = crate::builtin::task_prompts("addition").unwrap();
        let cfg = DataConfig { shuffle: false, ..DataConfig::default() };
        let mut data = PromptDataset::new(raw, &tok, &cfg, 0).unwrap();
        let mut seen = 5;
        let batch = next_batch(&mut data, &tok, 3, 2, &mut seen, Device::Cpu).unwrap();
        assert_eq!(seen, 8);
        let groups: Vec<i64> = batch.group_of_row.iter().map(|&(_, g)| g).collect();
        assert_eq!(groups, [5, 5, 6, 6, 7, 7]);
        let records: Vec<usize> = batch.group_of_row.iter().map(|&(i, _)| i).collect();
        assert_eq!((records[0], records[2], records[4]), (records[1], records[3], records[5]));
        let longest = (0..3).map(|k| data.records[records[2 * k]].ids.len()).max().unwrap() as i64;
        assert_eq!(batch.padded.input_ids.size(), [6, longest]);
    }
}
