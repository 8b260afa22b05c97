//! Images in the RL step (a vision-language policy, see `docs/vision.md`). A row's images are
//! those of its prompt: every stage that runs a model over rows — the rollout, the old policy,
//! the reference, each minibatch — passes the rows' images with them, in row order. The rows
//! carry their prompt's dataset index (`records`), so a batch gathered from other data-parallel
//! ranks, concatenated by dynamic sampling or cut into minibatches finds its images again; each
//! prompt's images are decoded and patched once and shared by its G samples. A frozen tower (the
//! default) runs once per prompt too: its features are kept with the patches, and the rollout,
//! the old policy, the reference (when its tower is the actor's) and every minibatch take them.
//!
//! A row whose episode observed images ([`crate::rl::observed`]) has a record of its own, above
//! the dataset's, for the step that trains on it: its images are its prompt's, then its
//! observations', and its slots say which trajectory columns hold their placeholders.

use rlhf_models::{CausalLm, Images};
use std::collections::HashMap;
use tch::{Device, Kind, Tensor};

use crate::data::PromptDataset;
use crate::error::{Result, TrainerError};
use crate::prompt_images::PromptImages;
use crate::rl::observed::Observed;
use crate::rl::prompts::{ImageFiles, PromptBatch};

/// Per row: its images (patches and grids; none for a text-only row) — its prompt's, then its
/// episode's observations' — and the response columns of those observations' placeholders. The G
/// rows of a prompt share its patches' storage.
#[derive(Debug)]
pub struct RowImages {
    pub images: Vec<Images>,
    pub slots: Vec<Vec<i64>>,
}

impl RowImages {
    /// Rows of prompts' images only.
    pub fn of_prompts(images: Vec<Images>) -> RowImages {
        let slots = vec![Vec::new(); images.len()];
        RowImages { images, slots }
    }

    /// The rows `idx`, in that order (their patches' storage shared).
    pub fn pick(&self, idx: &[i64]) -> RowImages {
        let images = idx.iter().map(|&i| self.images[i as usize].shallow_clone()).collect();
        let slots = idx.iter().map(|&i| self.slots.get(i as usize).cloned().unwrap_or_default()).collect();
        RowImages { images, slots }
    }

    /// The images of the rows `idx` names (all with `None`) one after another ([`cat`]).
    pub fn cat(&self, idx: Option<&[i64]>) -> Result<Option<Images>> {
        cat(&self.images, idx)
    }

    /// Where the picked rows' observations' placeholders are: column `prompt_len + c` for each
    /// slot `c` of a row; `None` when no picked row has one.
    ///
    /// # Shapes
    /// → `[rows picked, width]` int64
    pub fn observed(&self, idx: Option<&[i64]>, prompt_len: i64, width: i64, device: Device) -> Result<Option<Tensor>> {
        let picked: Vec<usize> = match idx {
            Some(idx) => idx.iter().map(|&i| i as usize).collect(),
            None => (0..self.slots.len()).collect(),
        };
        if picked.iter().all(|&r| self.slots.get(r).is_none_or(Vec::is_empty)) {
            return Ok(None);
        }
        let w = width as usize;
        let mut mask = vec![0i64; picked.len() * w];
        for (i, &r) in picked.iter().enumerate() {
            for &c in self.slots.get(r).map(Vec::as_slice).unwrap_or_default() {
                let col = (prompt_len + c) as usize;
                if col >= w {
                    return Err(TrainerError::Run(format!("row {r}: an observation's image at column {col} of {w}")));
                }
                mask[i * w + col] = 1;
            }
        }
        Ok(Some(Tensor::f_from_slice(&mask)?.f_view([picked.len() as i64, width])?.f_to_device(device)?))
    }
}

/// How the run turns prompts' images into the policy's inputs, with the patches of recent
/// prompts kept.
pub struct Visual {
    prompts: PromptImages,
    patched: HashMap<usize, Images>,
    /// Prompts whose patches are kept at most (then the store starts afresh).
    capacity: usize,
    /// The rows of this step whose episodes observed images, by their own record: the prompt's
    /// record and what the observations added.
    observed: HashMap<usize, (usize, Observed)>,
    /// The next such record (counting on from the dataset's records, never reused).
    next_observed: usize,
}

impl Visual {
    /// `capacity`: prompts whose patches are kept (a few generation batches' worth).
    pub fn new(prompts: PromptImages, capacity: usize) -> Self {
        Visual {
            prompts,
            patched: HashMap::new(),
            capacity: capacity.max(1),
            observed: HashMap::new(),
            next_observed: 0,
        }
    }

    /// How prompts' (and observations') images become the policy's inputs.
    pub fn prompt_images(&self) -> &PromptImages {
        &self.prompts
    }

    /// Forgets the rows an earlier step observed images in (their patches too).
    pub fn forget_observed(&mut self) {
        for r in self.observed.keys() {
            self.patched.remove(r);
        }
        self.observed.clear();
    }

    /// Gives each of `rows` — (prompt record, what its episode observed), in the same order on
    /// every rank — a record of its own from `first` (the dataset's size) on; returns them.
    pub fn observe(&mut self, first: usize, rows: Vec<(usize, Observed)>) -> Vec<usize> {
        self.next_observed = self.next_observed.max(first);
        rows.into_iter()
            .map(|row| {
                let r = self.next_observed;
                self.next_observed += 1;
                self.observed.insert(r, row);
                r
            })
            .collect()
    }

    /// The image files of rows whose prompts are `records` (the dataset's), for an engine that
    /// decodes and patches them itself.
    pub fn files(&self, data: &PromptDataset, records: &[usize]) -> ImageFiles {
        let rows = records.iter().map(|&r| data.records.get(r).map(|p| p.images.clone()).unwrap_or_default()).collect();
        ImageFiles { placeholder: self.prompts.placeholder(), rows }
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

    /// The images of each of `records` (indices into `data.records`, or rows that observed
    /// images, see [`Visual::observe`]), in order; with `tower` (a frozen one) with their
    /// features, the records not kept yet going through the tower together once, each record's
    /// features then kept with its patches.
    pub fn rows(&mut self, data: &PromptDataset, records: &[usize], tower: Option<&CausalLm>) -> Result<RowImages> {
        let mut fresh: Vec<(usize, Images)> = Vec::new();
        for &r in records {
            if self.patched.contains_key(&r) || fresh.iter().any(|(f, _)| *f == r) {
                continue;
            }
            let (prompt, observed) = match self.observed.get(&r) {
                Some((p, o)) => (*p, o.images.iter().map(|i| i.to_ref()).collect()),
                None => (r, Vec::new()),
            };
            let record = data.records.get(prompt).ok_or_else(|| {
                TrainerError::Run(format!("prompt {prompt} of {}: no such prompt for its images", data.records.len()))
            })?;
            fresh.push((r, self.prompts.patches(&[record.images.clone(), observed].concat())?));
        }
        if let Some(model) = tower {
            with_features(model, &mut fresh)?;
        }
        let images = records
            .iter()
            .map(|r| {
                let kept = self.patched.get(r).or_else(|| fresh.iter().find(|(f, _)| f == r).map(|(_, p)| p));
                kept.map(Images::shallow_clone).ok_or_else(|| TrainerError::Run(format!("prompt {r}: no patches")))
            })
            .collect::<Result<Vec<Images>>>()?;
        let slots =
            records.iter().map(|r| self.observed.get(r).map(|(_, o)| o.slots.clone()).unwrap_or_default()).collect();
        if self.patched.len() + fresh.len() > self.capacity {
            self.patched.clear();
        }
        self.patched.extend(fresh);
        Ok(RowImages { images, slots })
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

    /// Gives this rank's rows of `batch` their images ([`Self::images_of`]) and, for an engine
    /// that processes images itself, their files (also when they have none: an episode's
    /// observations may add some).
    pub(super) fn attach_images(&mut self, batch: &mut PromptBatch) -> Result<()> {
        let records: Vec<usize> = batch.group_of_row.iter().map(|&(r, _)| r).collect();
        batch.images = self.images_of(&records)?.map(|rows| rows.cat(None)).transpose()?.flatten();
        if self.engine.is_external() {
            batch.image_files = self.visual.as_ref().map(|v| v.files(&self.data, &records));
        }
        Ok(())
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

    /// A row's observation slots mark `prompt_len + slot` in the picked rows' order; rows without
    /// observations mark nothing, and picking none of those rows gives no mask.
    #[test]
    fn observed_marks_the_picked_rows_slots_after_the_prompt() {
        let rows = RowImages { images: vec![image(0, 0.0), image(1, 1.0)], slots: vec![vec![], vec![0, 2]] };
        let mask = rows.observed(Some(&[1, 0]), 2, 5, tch::Device::Cpu).unwrap().unwrap();
        assert_eq!(Vec::<i64>::try_from(mask.view([-1])).unwrap(), [0, 0, 1, 0, 1, 0, 0, 0, 0, 0]);
        assert!(rows.observed(Some(&[0]), 2, 5, tch::Device::Cpu).unwrap().is_none());
        assert!(rows.observed(None, 3, 5, tch::Device::Cpu).is_err(), "a slot past the width");
    }
}
