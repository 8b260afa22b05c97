//! The parameter gate of a sharded model (ZeRO stage 3, Rajbhandari et al. 2020; PyTorch FSDP2):
//! when a model's parameters are partitioned over data-parallel ranks, each unit — one decoder
//! layer, or the rest of the model (embeddings, final norm, heads) — is made whole just before it
//! runs and freed after. The model only says *when* ([`crate::checkpointing`] calls the gate
//! around every layer of a checkpointed pass); the trainer's sharding strategy says *how*
//! (all-gather, reduce-scatter). Every call is a collective on the trainer's side: every rank
//! must make the same calls in the same order, which the checkpointed pass does for any input.

use std::sync::Arc;

/// A unit of parameters gathered and freed together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unit {
    /// Everything outside the decoder layers: embeddings, final norm, LM or scalar head. Gathered
    /// for the whole of a pass (the caller's head and loss read it between forward and backward).
    Outer,
    /// Decoder layer `i`.
    Layer(usize),
}

/// The unit of the parameter named `name` (its path in the checkpoint): the decoder layer of a
/// `…layers.N.…` (Llama, Mistral, Qwen2) or `…h.N.…` (GPT-2) path, [`Unit::Outer`] otherwise.
pub fn unit_of(name: &str) -> Unit {
    let parts: Vec<&str> = name.split('.').collect();
    for w in parts.windows(2) {
        if matches!(w[0], "layers" | "h") {
            if let Ok(i) = w[1].parse::<usize>() {
                return Unit::Layer(i);
            }
        }
    }
    Unit::Outer
}

/// Gathers and frees a sharded model's units around their use.
pub trait ParamGate: Send + Sync {
    /// Makes the parameters of `unit` whole before it runs (a no-op where they already are).
    fn gather(&self, unit: Unit) -> Result<(), String>;
    /// Ends one use of `unit`: with `grads` (after its backward) its gradients are reduced over
    /// the ranks into this rank's shard and freed; its parameters are freed once no pass still
    /// uses them.
    fn release(&self, unit: Unit, grads: bool) -> Result<(), String>;
    /// Starts gathering `unit`, the next to run, while the current one computes (FSDP's
    /// prefetch); its [`ParamGate::gather`] then waits for it. Optional.
    fn prefetch(&self, unit: Unit) -> Result<(), String> {
        let _ = unit;
        Ok(())
    }
}

impl std::fmt::Debug for dyn ParamGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ParamGate")
    }
}

/// A model's gate, where it has one.
pub type Gate = Option<Arc<dyn ParamGate>>;

#[cfg(all(target_os = "linux", target_env = "gnu"))]
extern "C" {
    fn malloc_trim(pad: usize) -> std::os::raw::c_int;
}

/// Hands the heap pages freed with whole weights back to the OS (glibc's `malloc_trim`): glibc
/// keeps freed blocks for reuse, so without this the resident set would not shrink when a
/// sharded model frees its weights, or the buffers its projections were laid in.
pub fn return_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` only releases free memory of the allocator; it takes no pointers.
    unsafe {
        malloc_trim(0);
    }
}

fn gate_err(e: String) -> crate::error::ModelError {
    crate::error::ModelError::Gate(e)
}

/// Makes `unit` whole (with a gate).
pub(crate) fn gather(gate: &Gate, unit: Unit) -> crate::error::Result<()> {
    match gate {
        Some(g) => g.gather(unit).map_err(gate_err),
        None => Ok(()),
    }
}

/// Ends a use of `unit` (with a gate); with `grads`, after its backward.
pub(crate) fn release(gate: &Gate, unit: Unit, grads: bool) -> crate::error::Result<()> {
    match gate {
        Some(g) => g.release(unit, grads).map_err(gate_err),
        None => Ok(()),
    }
}

/// Starts gathering `unit` ahead of its use (with a gate).
pub(crate) fn prefetch(gate: &Gate, unit: Unit) -> crate::error::Result<()> {
    match gate {
        Some(g) => g.prefetch(unit).map_err(gate_err),
        None => Ok(()),
    }
}

/// `f()` between gathering and (forward) releasing layer `i`, the next layer (`i + 1`) prefetched
/// meanwhile.
pub(crate) fn gated<T>(gate: &Gate, i: usize, f: impl FnOnce() -> crate::error::Result<T>) -> crate::error::Result<T> {
    gather(gate, Unit::Layer(i))?;
    prefetch(gate, Unit::Layer(i + 1))?;
    let out = f()?;
    release(gate, Unit::Layer(i), false)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_follow_the_layer_paths() {
        assert_eq!(unit_of("model.layers.12.self_attn.q_proj.weight"), Unit::Layer(12));
        assert_eq!(unit_of("transformer.h.3.attn.c_attn.bias"), Unit::Layer(3));
        assert_eq!(unit_of("model.layers.0.mlp.down_proj.lora_a"), Unit::Layer(0));
        assert_eq!(unit_of("model.embed_tokens.weight"), Unit::Outer);
        assert_eq!(unit_of("lm_head.weight"), Unit::Outer);
        assert_eq!(unit_of("score.weight"), Unit::Outer);
        assert_eq!(unit_of("model.norm.weight"), Unit::Outer);
    }
}
