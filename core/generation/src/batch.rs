//! Turning token-id lists into padded `[batch, seq]` tensors.

use tch::{Device, Kind, Tensor};

use crate::error::{GenerationError, Result};

/// Token ids and their attention mask.
#[derive(Debug)]
pub struct PaddedBatch {
    /// `[batch, seq]`, int64.
    pub input_ids: Tensor,
    /// `[batch, seq]`, int64, 1 on real tokens.
    pub attention_mask: Tensor,
}

fn pad(seqs: &[Vec<i64>], pad_id: i64, device: Device, left: bool) -> Result<PaddedBatch> {
    if seqs.is_empty() {
        return Err(GenerationError::Input("empty batch".into()));
    }
    let len = seqs.iter().map(Vec::len).max().unwrap_or(0);
    if len == 0 {
        return Err(GenerationError::Input("every sequence of the batch is empty".into()));
    }
    let mut ids = Vec::with_capacity(seqs.len() * len);
    let mut mask = Vec::with_capacity(seqs.len() * len);
    for s in seqs {
        let n = len - s.len();
        if left {
            ids.extend(std::iter::repeat_n(pad_id, n));
            mask.extend(std::iter::repeat_n(0i64, n));
        }
        ids.extend_from_slice(s);
        mask.extend(std::iter::repeat_n(1i64, s.len()));
        if !left {
            ids.extend(std::iter::repeat_n(pad_id, n));
            mask.extend(std::iter::repeat_n(0i64, n));
        }
    }
    let shape = [seqs.len() as i64, len as i64];
    Ok(PaddedBatch {
        input_ids: Tensor::f_from_slice(&ids)?.f_view(shape)?.f_to_device(device)?,
        attention_mask: Tensor::f_from_slice(&mask)?.f_view(shape)?.f_to_device(device)?,
    })
}

/// Left-pads (prompts for generation).
///
/// # Shapes
/// - returns `[seqs.len(), max_len]` ids and mask
pub fn left_pad(seqs: &[Vec<i64>], pad_id: i64, device: Device) -> Result<PaddedBatch> {
    pad(seqs, pad_id, device, true)
}

/// Right-pads (scoring whole texts).
///
/// # Shapes
/// - returns `[seqs.len(), max_len]` ids and mask
pub fn right_pad(seqs: &[Vec<i64>], pad_id: i64, device: Device) -> Result<PaddedBatch> {
    pad(seqs, pad_id, device, false)
}

/// Converts a `[batch, seq]` int tensor to rows.
pub fn to_rows(t: &Tensor) -> Result<Vec<Vec<i64>>> {
    let t = t.f_to_device(Device::Cpu)?.f_to_kind(Kind::Int64)?;
    let rows = t.size()[0];
    (0..rows).map(|i| Ok(Vec::<i64>::try_from(t.get(i))?)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pads_both_sides() {
        let seqs = vec![vec![5, 6, 7], vec![8]];
        let l = left_pad(&seqs, 0, Device::Cpu).unwrap();
        assert_eq!(to_rows(&l.input_ids).unwrap(), vec![vec![5, 6, 7], vec![0, 0, 8]]);
        assert_eq!(to_rows(&l.attention_mask).unwrap(), vec![vec![1, 1, 1], vec![0, 0, 1]]);
        let r = right_pad(&seqs, 9, Device::Cpu).unwrap();
        assert_eq!(to_rows(&r.input_ids).unwrap(), vec![vec![5, 6, 7], vec![8, 9, 9]]);
        assert!(left_pad(&[], 0, Device::Cpu).is_err());
        assert!(left_pad(&[vec![]], 0, Device::Cpu).is_err());
    }
}
