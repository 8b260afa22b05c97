//! Images in the RL step (a vision-language policy, see `docs/vision.md`). A row's images are
//! those of its prompt: every stage that runs a model over rows — the rollout, the old policy,
//! the reference, each minibatch — passes the rows' images with them, in row order. The rows
//! carry their prompt's dataset index (`records`), so a batch gathered from other data-parallel
//! ranks, concatenated by dynamic sampling or cut into minibatches finds its images again; each
//! prompt's images are decoded and patched once and shared by its G samples. A frozen tower (the
//! default) runs once per prompt too: its features are kept with the patches, and the rollout,
//! the old policy, the reference (when its tower is the actor's) and every minibatch take them.

use rlhf_models::{CausalLm, Images};
use std::collections::HashMap;
use tch::{Kind, Tensor};

use crate::data::PromptDataset;
use crate::error::{Result, TrainerError};
use crate::prompt_images::PromptImages;

/// Per row: its prompt's images (patches and grids; none for a text-only prompt). The G rows of
/// a prompt share its patches' storage.
pub type RowImages = Vec<Images>;

/// How the run turns prompts' images into the policy's inputs, with the patches of recent
/// prompts kept.
pub struct Visual {
    prompts: PromptImages,
    patched: HashMap<usize, Images>,
    /// Prompts whose patches are kept at most (then the store starts afresh).
    capacity: usize,
}

impl Visual {
    /// `capacity`: prompts whose patches are kept (a few generation batches' worth).
    pub fn new(prompts: PromptImages, capacity: usize) -> Self {
        Visual { prompts, patched: HashMap::new(), capacity: capacity.max(1) }
    }

    /// [`Visual::rows`], or `None` when none of `records` holds an image (the text-only passes
    /// then run).
    pub fn rows_with_images(
        &mut self,
        data: &PromptDataset,
        records: &[usize],
        tower: Option<&CausalLm>,
    ) -> Result<Option<RowImages>> {
        if records.iter().all(|&r| data.records.get(r).is_some_and(|p| p.images.is_empty())) {
            return Ok(None);
        }
        self.rows(data, records, tower).map(Some)
    }

    /// The images of each of `records` (indices into `data.records`), in order; with `tower` (a
    /// frozen one) with their features, the prompts not kept yet going through the tower together
    /// once, each prompt's features then kept with its patches.
    pub fn rows(&mut self, data: &PromptDataset, records: &[usize], tower: Option<&CausalLm>) -> Result<RowImages> {
        let mut fresh: Vec<(usize, Images)> = Vec::new();
        for &r in records {
            if self.patched.contains_key(&r) || fresh.iter().any(|(f, _)| *f == r) {
                continue;
            }
            let record = data.records.get(r).ok_or_else(|| {
                TrainerError::Run(format!("prompt {r} of {}: no such prompt for its images", data.records.len()))
            })?;
            fresh.push((r, self.prompts.patches(&record.images)?));
        }
        if let Some(model) = tower {
            with_features(model, &mut fresh)?;
        }
        let out = records
            .iter()
            .map(|r| {
                let kept = self.patched.get(r).or_else(|| fresh.iter().find(|(f, _)| f == r).map(|(_, p)| p));
                kept.map(Images::shallow_clone).ok_or_else(|| TrainerError::Run(format!("prompt {r}: no patches")))
            })
            .collect::<Result<RowImages>>()?;
        if self.patched.len() + fresh.len() > self.capacity {
            self.patched.clear();
        }
        self.patched.extend(fresh);
        Ok(out)
    }
}

/// Gives each of `prompts`' images its features from `model`'s tower, all of them in one pass.
fn with_features(model: &CausalLm, prompts: &mut [(usize, Images)]) -> Result<()> {
    let rows: Vec<Images> = prompts.iter().map(|(_, p)| p.shallow_clone()).collect();
    let Some(all) = cat(&rows, None)? else { return Ok(()) };
    let mut features = model.with_features(&all)?.features.unwrap_or_default().into_iter();
    for (_, p) in prompts.iter_mut() {
        p.features = Some(features.by_ref().take(p.grids.len()).collect());
    }
    Ok(())
}

impl super::Trainer {
    /// The images of rows whose prompts are `records`, in row order; `None` when the policy reads
    /// no images or none of the rows holds one (the text-only passes then run).
    pub(super) fn images_of(&mut self, records: &[usize]) -> Result<Option<RowImages>> {
        let tower = self.frozen_features.then_some(&self.actor);
        match self.visual.as_mut() {
            Some(visual) => visual.rows_with_images(&self.data, records, tower),
            None => Ok(None),
        }
    }

    /// [`Self::images_of`] a `[B]` i64 tensor of records.
    pub(super) fn images_of_tensor(&mut self, records: &Tensor) -> Result<Option<RowImages>> {
        let records = Vec::<i64>::try_from(records.f_to_kind(Kind::Int64)?.f_to_device(tch::Device::Cpu)?)?;
        self.images_of(&records.into_iter().map(|r| r.max(0) as usize).collect::<Vec<_>>())
    }
}

/// The images a critic's pass reads: the rows' (with the actor's features when the critic's
/// tower is the actor's); `None` for rows without images or a critic that reads none.
pub(crate) fn critic_images(
    critic: &rlhf_models::ScalarHeadModel,
    images: Option<&Images>,
    shares: bool,
) -> Option<Images> {
    let images = images.filter(|_| critic.vision().is_some())?;
    Some(if shares { images.shallow_clone() } else { images.without_features() })
}

/// What RL on prompts with images does not do yet, refused before anything is built: vLLM (its
/// requests carry no images yet). (Environments run on such prompts with text observations.)
pub fn check_run(cfg: &crate::config::RlConfig) -> Result<()> {
    let refuse = |key: &str, what: &str| {
        Err(TrainerError::Config(format!(
            "{}: {key}: {what}, and data.prompts `{}` holds images",
            cfg.source_of(key),
            cfg.data.prompts
        )))
    };
    if cfg.rollout.engine == crate::config::EngineKind::Vllm {
        return refuse("rollout.engine", "the vLLM engine is not sent images yet");
    }
    Ok(())
}

/// The images of the rows `idx` names (all rows with `None`), one after another in row order —
/// the layout the model takes them in; `None` when those rows hold no image (the text-only
/// passes then run).
pub fn cat(rows: &[Images], idx: Option<&[i64]>) -> Result<Option<Images>> {
    let picked: Vec<&Images> = match idx {
        Some(idx) => idx
            .iter()
            .map(|&i| {
                rows.get(i as usize)
                    .ok_or_else(|| TrainerError::Run(format!("row {i} of {} has no images entry", rows.len())))
            })
            .collect::<Result<_>>()?,
        None => rows.iter().collect(),
    };
    Ok(Images::concat(&picked)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(rows: i64, fill: f64) -> Images {
        let pixel_values = Tensor::full([rows, 3], fill, (Kind::Float, tch::Device::Cpu));
        Images::new(pixel_values, if rows > 0 { vec![[1, 1, rows]] } else { vec![] })
    }

    /// Rows' images come out in the order asked, text-only rows adding none.
    #[test]
    fn cat_lays_out_the_picked_rows_images_in_row_order() {
        let rows = vec![image(2, 1.0), image(0, 0.0), image(1, 3.0)];
        let all = cat(&rows, None).unwrap().unwrap();
        assert_eq!(all.grids, [[1, 1, 2], [1, 1, 1]]);
        assert_eq!(
            Vec::<f32>::try_from(all.pixel_values.sum_dim_intlist(1, false, Kind::Float)).unwrap(),
            [3.0, 3.0, 9.0]
        );
        let some = cat(&rows, Some(&[2, 1, 0])).unwrap().unwrap();
        assert_eq!(some.grids, [[1, 1, 1], [1, 1, 2]]);
        assert_eq!(Vec::<f32>::try_from(some.pixel_values.select(1, 0)).unwrap(), [3.0, 1.0, 1.0]);
        assert!(cat(&rows, Some(&[1])).unwrap().is_none());
        assert!(cat(&rows, Some(&[3])).is_err());
    }
}
