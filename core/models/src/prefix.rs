//! Prompts shared by several sequences, computed once.
//!
//! GRPO's G samples of a prompt (and any rows of a batch that hold the same prompt) repeat its
//! tokens, so a full forward over `[B, P + R]` computes the same prompt activations G times. With
//! causal attention a prompt's activations do not depend on what follows it, so
//! [`CausalLm::hidden_states_after_prefix`] runs each distinct prompt once, gives its keys and
//! values to every row that holds it, and runs the completions on top: the same function, within
//! float rounding, with the autograd graph intact (the gradient of a shared prompt sums over the
//! rows that share it). This is the shared-prefix forward of "Prefix Grouper: Efficient GRPO
//! Training through Shared-Prefix Forward" (2025), and what vLLM's and SGLang's prefix caching do
//! for inference.

use std::collections::HashMap;

use tch::{Kind, Tensor};

use crate::backbone::{Backbone, Routing};
use crate::checkpointing::{self, Checkpointed};
use crate::error::{ModelError, Result};
use crate::gate::Gate;
use crate::layers::{position_ids_from_mask, KvCache, RouterStats};
use crate::model::{check_ids, CausalLm};

/// Which rows of a batch share their first `len` tokens (ids and mask both).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedPrefixes {
    /// Tokens in the prefix.
    pub len: i64,
    /// A row holding each distinct prefix, in order of first appearance.
    pub first: Vec<i64>,
    /// For each row, the index into `first` of its prefix.
    pub of_row: Vec<i64>,
}

impl SharedPrefixes {
    /// Groups the rows by their first `len` ids and mask values (one copy of the prefixes to the
    /// host).
    ///
    /// # Shapes
    /// - `input_ids`, `attention_mask`: `[batch, seq]`, `1 <= len <= seq`
    pub fn find(input_ids: &Tensor, attention_mask: &Tensor, len: i64) -> Result<Self> {
        check_ids(input_ids, attention_mask)?;
        let (batch, seq) = (input_ids.size()[0], input_ids.size()[1]);
        if len < 1 || len > seq || attention_mask.size()[1] != seq {
            return Err(ModelError::Input(format!("shared prefix of {len} tokens in rows of {seq}")));
        }
        let host = |t: &Tensor| -> Result<Vec<i64>> {
            let t = t.f_narrow(1, 0, len)?.f_to_kind(Kind::Int64)?.f_to_device(tch::Device::Cpu)?.f_contiguous()?;
            Ok(Vec::<i64>::try_from(t.f_view([-1])?)?)
        };
        let (ids, mask) = (host(input_ids)?, host(attention_mask)?);
        let width = len as usize;
        let mut seen: HashMap<(&[i64], &[i64]), i64> = HashMap::new();
        let (mut first, mut of_row) = (Vec::new(), Vec::with_capacity(batch as usize));
        for row in 0..batch as usize {
            let span = row * width..(row + 1) * width;
            let key = (&ids[span.clone()], &mask[span]);
            let next = first.len() as i64;
            let k = *seen.entry(key).or_insert(next);
            if k == next {
                first.push(row as i64);
            }
            of_row.push(k);
        }
        Ok(SharedPrefixes { len, first, of_row })
    }

    /// Whether some prefix is held by more than one row (otherwise sharing saves nothing).
    pub fn any_shared(&self) -> bool {
        self.first.len() < self.of_row.len()
    }
}

/// The inputs of a shared-prefix pass: the distinct prefixes, the rest of every row, and the
/// index of each row's prefix.
struct Split {
    /// ids, positions and mask of the distinct prefixes, `[u, p]` each.
    prefixes: (Tensor, Tensor, Tensor),
    /// ids and positions of the rest of every row, `[batch, seq − p]`, and the whole rows' mask
    /// `[batch, seq]` (the rest attends to its prefix).
    rest: (Tensor, Tensor, Tensor),
    /// `[batch]`
    of_row: Tensor,
}

impl Split {
    /// # Shapes
    /// - `input_ids`, `attention_mask`: `[batch, seq]`, `prefix.len < seq`
    fn new(input_ids: &Tensor, attention_mask: &Tensor, prefix: &SharedPrefixes) -> Result<Self> {
        check_ids(input_ids, attention_mask)?;
        let (batch, seq) = (input_ids.size()[0], input_ids.size()[1]);
        let (p, rest) = (prefix.len, seq - prefix.len);
        if prefix.of_row.len() as i64 != batch || rest < 1 || attention_mask.size()[1] != seq {
            return Err(ModelError::Input(format!(
                "shared prefixes of {} rows × {p} tokens for ids {:?} and mask {:?}",
                prefix.of_row.len(),
                input_ids.size(),
                attention_mask.size()
            )));
        }
        let device = input_ids.device();
        let first = Tensor::f_from_slice(&prefix.first)?.f_to_device(device)?; // [u]
        let of_row = Tensor::f_from_slice(&prefix.of_row)?.f_to_device(device)?; // [batch]
        let positions = position_ids_from_mask(attention_mask)?; // [batch, seq]
        let head = |t: &Tensor| -> Result<Tensor> { Ok(t.f_narrow(1, 0, p)?.f_index_select(0, &first)?) }; // [u, p]
        let tail = |t: &Tensor| -> Result<Tensor> { Ok(t.f_narrow(1, p, rest)?) }; // [batch, rest]
        Ok(Split {
            prefixes: (head(input_ids)?, head(&positions)?, head(attention_mask)?),
            rest: (tail(input_ids)?, tail(&positions)?, attention_mask.shallow_clone()),
            of_row,
        })
    }
}

impl CausalLm {
    /// Final hidden states of positions `prefix.len − 1 .. seq` (the states that predict tokens
    /// `prefix.len ..`), each distinct prefix computed once: the prefixes alone, their keys and
    /// values repeated to the rows that hold them, then the rest of every row on top. Positions
    /// and the attention mask are those of the whole rows ([`position_ids_from_mask`],
    /// [`crate::layers::attention_mask`]), so the result equals the matching slice of
    /// [`CausalLm::hidden_states`] up to float rounding.
    ///
    /// # Shapes
    /// - `input_ids`, `attention_mask`: `[batch, seq]`, `prefix.len < seq`
    /// - returns `[batch, seq − prefix.len + 1, hidden]`
    pub fn hidden_states_after_prefix(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        prefix: &SharedPrefixes,
    ) -> Result<Tensor> {
        Ok(self.after_prefix(input_ids, attention_mask, prefix, false)?.0)
    }

    /// [`CausalLm::hidden_states_after_prefix`], and the load-balancing loss of the pass as
    /// [`CausalLm::hidden_states_with_aux`] gives it for the whole rows (a shared prompt's tokens
    /// count once for each row that holds it).
    pub fn hidden_states_after_prefix_with_aux(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        prefix: &SharedPrefixes,
    ) -> Result<(Tensor, Option<Tensor>)> {
        self.after_prefix(input_ids, attention_mask, prefix, true)
    }

    /// The pass of [`CausalLm::hidden_states_after_prefix`], recording its routing for the
    /// load-balancing loss with `record` (a training pass).
    fn after_prefix(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        prefix: &SharedPrefixes,
        record: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        backbone_after_prefix(&self.backbone, &self.gate, (input_ids, attention_mask), prefix, record)
    }

    /// [`CausalLm::hidden_states_after_prefix`] as a checkpointed pass (see
    /// [`CausalLm::hidden_states_checkpointed`]): its [`Checkpointed::hidden`] is
    /// `[batch, seq − prefix.len + 1, hidden]`, bit for bit the tensor that method returns.
    pub fn hidden_states_checkpointed_after_prefix(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        prefix: &SharedPrefixes,
    ) -> Result<Checkpointed> {
        let Split { prefixes: (p_ids, p_pos, p_mask), rest: (ids, pos, mask), of_row } =
            Split::new(input_ids, attention_mask, prefix)?;
        checkpointing::forward_after_prefix(
            &self.backbone,
            &self.gate,
            (&p_ids, &p_pos, &p_mask),
            (&ids, &pos, &mask),
            &of_row,
        )
    }
}

/// The shared-prefix pass of `backbone` ([`CausalLm::hidden_states_after_prefix`]): the final
/// hidden states of positions `prefix.len − 1 .. seq`, and with `record` the pass's
/// load-balancing loss.
///
/// # Shapes
/// - `input_ids`, `attention_mask`: `[batch, seq]`, `prefix.len < seq`
/// - returns `[batch, seq − prefix.len + 1, hidden]`
pub(crate) fn backbone_after_prefix(
    backbone: &Backbone,
    gate: &Gate,
    (input_ids, attention_mask): (&Tensor, &Tensor),
    prefix: &SharedPrefixes,
    record: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let Split { prefixes: (p_ids, p_pos, p_mask), rest: (ids, pos, mask), of_row } =
        Split::new(input_ids, attention_mask, prefix)?;
    let (hidden, stats) = if gate.is_some() {
        // Sharded layers: each gathered once for both segments.
        let (pre, rest) = ((&p_ids, &p_pos, &p_mask), (&ids, &pos, &mask));
        checkpointing::forward_after_prefix_plain(backbone, gate, pre, rest, &of_row, record)?
    } else {
        let mut cache = KvCache::growing();
        let rows = checkpointing::rows_per_prefix(&of_row, p_ids.size()[0])?; // [u]
        let routing = |rows| if record { Routing::Record(rows) } else { Routing::Off };
        let (hp, sp) = backbone.run(&p_ids, &p_pos, &p_mask, Some(&mut cache), &None, routing(Some(&rows)), None)?; // [u, p, h]
        cache.select_rows(&of_row)?;
        let (hr, sr) = backbone.run(&ids, &pos, &mask, Some(&mut cache), &None, routing(None), None)?; // [batch, rest, h]
        let last = hp.f_narrow(1, prefix.len - 1, 1)?.f_index_select(0, &of_row)?; // [batch, 1, h]
        (Tensor::f_cat(&[&last, &hr], 1)?, RouterStats::sum([sp, sr])?)
    };
    Ok((hidden, stats.map(|s| s.loss()).transpose()?))
}
