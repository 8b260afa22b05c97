//! ZeRO stage 3 (P_os+g+p; PyTorch FSDP2's per-parameter sharding): the parameters themselves are
//! partitioned. Every variable of the model — trained or frozen (a LoRA base too) — is cut as in
//! [`super::sharded`]: `n` elements padded to `W·c`, `c = ⌈n / W⌉`, rank r keeps chunk r in the
//! variable's dtype. While the model is **sharded** its variables hold no storage (`set_data` to
//! an empty tensor, as FSDP1 frees a flat parameter) and the checkpointed layer loop calls the
//! [`ParamGate`]: a unit (one decoder layer, or the outer unit — embeddings, final norm, heads)
//! is all-gathered just before it runs and freed after; after its recomputation in backward its
//! gradients are reduce-scattered at once into this rank's gradient shard (in the weights'
//! dtype, as stage 2's) and freed.
//! A rank then holds its shards, one whole layer, the outer unit during a pass, and the
//! activations the checkpointed pass keeps.
//!
//! While the model is **whole** ([`Params::gather_all`]) the gate does nothing and the engine
//! behaves as at stage 2 (gradients reduce-scattered per micro-batch): generation, scoring,
//! evaluation, checkpoints and export run on whole weights, gathered once per phase — DeepSpeed-
//! Chat's Hybrid Engine, which keeps decoding at full speed instead of gathering every layer for
//! every generated token.
//!
//! Every gate call is a collective: the ranks must make the same calls in the same order, which
//! the checkpointed pass guarantees for any input; the training loops keep the ranks in step
//! (a rank with a non-finite loss still runs its backward, a micro-batch with fewer rows than
//! ranks runs whole).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use rlhf_collective::World;
use rlhf_models::{ParamGate, Unit};
use tch::nn::VarStore;
use tch::{Kind, Tensor};

use crate::error::{Result, TrainerError};

/// One variable of the model and this rank's chunk of it.
struct PVar {
    name: String,
    var: Tensor,
    shape: Vec<i64>,
    numel: i64,
    chunk: i64,
    /// Where its chunk sits in the gradient shard (trained variables only).
    grad_at: Option<i64>,
    /// Sharded (in a unit); otherwise always whole and `data` empty.
    managed: bool,
    /// This rank's chunk `[chunk]`, in the variable's dtype.
    data: Tensor,
}

/// The variables of one unit (indices into `vars`, name order) and how many passes use it now.
struct UnitState {
    vars: Vec<usize>,
    users: usize,
}

struct State {
    world: World,
    vars: Vec<PVar>,
    units: HashMap<Unit, UnitState>,
    /// Index into `vars` of each name.
    index: HashMap<String, usize>,
    /// Every unit, outer first then the layers in order.
    order: Vec<Unit>,
    /// The variables hold their whole tensors (the gate is a no-op).
    whole: bool,
    /// This rank's shard `[s]` of the trained variables' gradients summed over the ranks and the
    /// step's backward passes so far (in the variables' dtype; made by the step's first reduction).
    grads: Option<Tensor>,
    /// Elements of that shard.
    s: i64,
    /// The unit being gathered ahead of its use ([`ParamGate::prefetch`]), at most one.
    inflight: Option<Inflight>,
    /// The gradient reduction in flight, at most one.
    reducing: Option<Reducing>,
    kind: Kind,
    device: tch::Device,
}

/// A unit's gradient reduce-scatter in flight, into `mine` (`[len]`), and where each of its
/// variables' chunks goes: (offset in the gradient shard, offset in `mine`, elements).
struct Reducing {
    pending: rlhf_collective::Pending,
    mine: Tensor,
    parts: Vec<(i64, i64, i64)>,
}

/// A unit's all-gather in flight, into `full` (`[W, len]`).
struct Inflight {
    unit: Unit,
    pending: rlhf_collective::Pending,
    full: Tensor,
}

/// The sharded parameters of one model, shared by its engine and its gate.
#[derive(Clone)]
pub struct Params(Arc<Mutex<State>>);

fn err(e: impl std::fmt::Display) -> TrainerError {
    TrainerError::Distributed(format!("zero stage 3: {e}"))
}

impl Params {
    /// Shards every variable of `vs` over the ranks of `world`; `trained` gives, for each trained
    /// variable's name, where its chunk sits in the engine's shard of `s` elements. The model
    /// stays whole until [`Params::shard`].
    pub fn new(vs: &VarStore, world: &World, trained: &HashMap<String, i64>, s: i64) -> Result<Self> {
        Self::build(vs, world, trained, s, true)
    }

    /// The decoder layers of a frozen model (`[distributed] shard_frozen`: the RL reference
    /// model), sharded from now on; the outer unit (embeddings, final norm, head) stays whole on
    /// every rank, since the frozen model's head runs after its forward, outside any pass.
    pub fn frozen(vs: &VarStore, world: &World) -> Result<Self> {
        let p = Self::build(vs, world, &HashMap::new(), 0, false)?;
        p.shard()?;
        Ok(p)
    }

    fn build(vs: &VarStore, world: &World, trained: &HashMap<String, i64>, s: i64, outer: bool) -> Result<Self> {
        let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        let (w, rank) = (world.size() as i64, world.rank() as i64);
        let (kind, device) =
            named.first().map(|(_, t)| (t.kind(), t.device())).unwrap_or((Kind::Float, tch::Device::Cpu));
        let mut vars = Vec::with_capacity(named.len());
        let mut units: HashMap<Unit, UnitState> = HashMap::new();
        for (i, (name, var)) in named.into_iter().enumerate() {
            let numel = var.numel() as i64;
            let chunk = (numel + w - 1) / w;
            let unit = rlhf_models::gate::unit_of(&name);
            if unit == Unit::Outer && !outer {
                let data = Tensor::f_empty([0], (var.kind(), var.device()))?;
                vars.push(PVar { shape: var.size(), name, var, numel, chunk, grad_at: None, managed: false, data });
                continue;
            }
            let data = tch::no_grad(|| -> Result<Tensor> { Ok(own_chunk(&var, w, rank, chunk)?.f_detach_copy()?) })?;
            units.entry(unit).or_insert(UnitState { vars: vec![], users: 0 }).vars.push(i);
            let grad_at = trained.get(&name).copied();
            vars.push(PVar { shape: var.size(), name, var, numel, chunk, grad_at, managed: true, data });
        }
        let mut order: Vec<Unit> = units.keys().copied().collect();
        order.sort_by_key(|u| match u {
            Unit::Outer => 0,
            Unit::Layer(i) => i + 1,
        });
        let index = vars.iter().enumerate().map(|(i, v)| (v.name.clone(), i)).collect();
        let state = State {
            world: world.clone(),
            vars,
            units,
            index,
            order,
            whole: true,
            grads: None,
            s,
            inflight: None,
            reducing: None,
            kind,
            device,
        };
        Ok(Params(Arc::new(Mutex::new(state))))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the variables hold their whole tensors.
    pub fn is_whole(&self) -> bool {
        self.lock().whole
    }

    /// Whole → sharded (no collective): each chunk is re-read from the whole variable (so what
    /// changed the weights while whole — a resumed checkpoint — is kept) and the variables freed.
    /// The variables must have no gradients left.
    pub fn shard(&self) -> Result<()> {
        let mut st = self.lock();
        if !st.whole {
            return Ok(());
        }
        if let Some(f) = st.inflight.take() {
            f.pending.wait().map_err(crate::dist::err)?;
        }
        st.finish_reduce()?;
        let w = st.world.size() as i64;
        let rank = st.world.rank() as i64;
        tch::no_grad(|| -> Result<()> {
            for v in st.vars.iter().filter(|v| v.managed) {
                v.data.shallow_clone().f_copy_(&own_chunk(&v.var, w, rank, v.chunk)?)?;
                free(&v.var)?;
            }
            Ok(())
        })?;
        st.whole = false;
        for u in st.units.values_mut() {
            u.users = 0;
        }
        // The heap pages freed with the whole weights go back to the OS.
        rlhf_models::gate::return_freed_memory();
        Ok(())
    }

    /// Sharded → whole: every unit all-gathered into its variables (a collective).
    pub fn gather_all(&self) -> Result<()> {
        let mut st = self.lock();
        if st.whole {
            return Ok(());
        }
        for unit in st.order.clone() {
            st.gather_unit(unit)?;
        }
        st.whole = true;
        Ok(())
    }

    /// Takes the gradient shard `[s]` reduced so far (f32), `None` when nothing was reduced.
    pub fn take_grads(&self) -> Result<Option<Tensor>> {
        let mut st = self.lock();
        st.finish_reduce()?;
        Ok(st.grads.take().map(|g| g.f_to_kind(Kind::Float)).transpose()?)
    }

    /// Drops the gradient shard reduced so far.
    pub fn clear_grads(&self) -> Result<()> {
        let mut st = self.lock();
        st.finish_reduce()?;
        st.grads = None;
        Ok(())
    }

    /// This rank's chunk `[chunk]` of the variable `name` as f32 (the chunk itself when f32).
    pub fn chunk_f32(&self, name: &str) -> Result<Tensor> {
        let st = self.lock();
        let v = st.var(name)?;
        Ok(v.data.f_to_kind(Kind::Float)?)
    }

    /// Overwrites this rank's chunk of `name` with `value` `[chunk]` (rounded to its dtype).
    pub fn set_chunk(&self, name: &str, value: &Tensor) -> Result<()> {
        let st = self.lock();
        let v = st.var(name)?;
        tch::no_grad(|| v.data.shallow_clone().f_copy_(value))?;
        Ok(())
    }

    /// Bytes of this rank's chunks of the trained variables.
    pub fn trained_bytes(&self) -> usize {
        let st = self.lock();
        let elt = st.kind.elt_size_in_bytes();
        st.vars.iter().filter(|v| v.grad_at.is_some()).map(|v| v.chunk as usize * elt).sum()
    }

    /// The gate the model calls in its checkpointed passes.
    pub fn gate(&self) -> Arc<dyn ParamGate> {
        Arc::new(self.clone())
    }
}

impl State {
    fn var(&self, name: &str) -> Result<&PVar> {
        self.index.get(name).map(|&i| &self.vars[i]).ok_or_else(|| err(format!("no variable `{name}`")))
    }

    /// This rank's chunks of `unit`'s variables laid end to end `[len]`, and an empty `[W, len]`
    /// for every rank's.
    fn gather_buffers(&self, unit: Unit) -> Result<(Tensor, Tensor)> {
        let u = &self.units[&unit];
        let refs: Vec<&Tensor> = u.vars.iter().map(|&i| &self.vars[i].data).collect();
        let len: i64 = u.vars.iter().map(|&i| self.vars[i].chunk).sum();
        let mine = Tensor::f_cat(&refs, 0)?;
        let full = Tensor::f_empty([self.world.size() as i64, len], (self.kind, self.device))?;
        Ok((mine, full))
    }

    /// Starts gathering `unit` (one collective, waited for by [`State::gather_unit`]).
    fn prefetch_unit(&mut self, unit: Unit) -> Result<()> {
        let (mine, full) = tch::no_grad(|| self.gather_buffers(unit))?;
        let pending = self.world.all_gather_into_async(&full.f_view([-1])?, &mine).map_err(crate::dist::err)?;
        self.inflight = Some(Inflight { unit, pending, full });
        Ok(())
    }

    /// All-gathers `unit`'s chunks into its variables (one collective, or the prefetched one).
    fn gather_unit(&mut self, unit: Unit) -> Result<()> {
        if !self.units.contains_key(&unit) {
            return Ok(());
        }
        let full = match self.inflight.take() {
            Some(f) if f.unit == unit => {
                f.pending.wait().map_err(crate::dist::err)?;
                f.full
            }
            other => {
                if let Some(f) = other {
                    // Prefetched and not used (every rank alike): finish it first.
                    f.pending.wait().map_err(crate::dist::err)?;
                }
                let (mine, full) = tch::no_grad(|| self.gather_buffers(unit))?;
                self.world.all_gather_into(&full.f_view([-1])?, &mine).map_err(crate::dist::err)?;
                full
            }
        };
        let u = &self.units[&unit];
        tch::no_grad(|| -> Result<()> {
            let mut at = 0;
            for &i in &u.vars {
                let v = &self.vars[i];
                let whole = full.f_narrow(1, at, v.chunk)?.f_contiguous()?.f_view([-1])?.f_narrow(0, 0, v.numel)?;
                v.var.shallow_clone().f_set_data(&whole.f_view(v.shape.as_slice())?)?;
                at += v.chunk;
            }
            Ok(())
        })
    }

    /// Starts reduce-scattering the gradients of `unit`'s trained variables (one collective; a
    /// variable without a gradient adds zeros) and frees them; the result is added into the
    /// gradient shard when the next reduction starts or the step takes the shard
    /// ([`State::finish_reduce`]), so it travels while the layer below recomputes.
    fn reduce_unit(&mut self, unit: Unit) -> Result<()> {
        self.finish_reduce()?;
        let Some(u) = self.units.get(&unit) else { return Ok(()) };
        let w = self.world.size() as i64;
        let vars: Vec<&PVar> = u.vars.iter().map(|&i| &self.vars[i]).filter(|v| v.grad_at.is_some()).collect();
        let len: i64 = vars.iter().map(|v| v.chunk).sum();
        if len == 0 {
            return Ok(());
        }
        let reducing = tch::no_grad(|| -> Result<Reducing> {
            // Rank-major: row r holds chunk r of every variable of the unit.
            let input = Tensor::f_zeros([w, len], (self.kind, self.device))?;
            let (mut at, mut parts) = (0, Vec::with_capacity(vars.len()));
            for v in &vars {
                let g = v.var.grad();
                if g.defined() {
                    let flat = g.f_reshape([-1])?;
                    let pad = w * v.chunk - v.numel;
                    let flat = if pad > 0 { flat.f_constant_pad_nd([0, pad])? } else { flat };
                    input.f_narrow(1, at, v.chunk)?.f_copy_(&flat.f_view([w, v.chunk])?)?;
                }
                rlhf_collective::release_grad(&v.var).map_err(err)?;
                parts.push((v.grad_at.unwrap_or(0), at, v.chunk));
                at += v.chunk;
            }
            let mine = Tensor::f_empty([len], (self.kind, self.device))?;
            let pending = self.world.reduce_scatter_async(&mine, &input.f_view([-1])?).map_err(crate::dist::err)?;
            Ok(Reducing { pending, mine, parts })
        })?;
        self.reducing = Some(reducing);
        Ok(())
    }

    /// Waits for the reduction in flight, if any, and adds its result into the gradient shard.
    fn finish_reduce(&mut self) -> Result<()> {
        let Some(r) = self.reducing.take() else { return Ok(()) };
        r.pending.wait().map_err(crate::dist::err)?;
        tch::no_grad(|| -> Result<()> {
            let grads = match &self.grads {
                Some(g) => g.shallow_clone(),
                None => Tensor::f_zeros([self.s], (self.kind, self.device))?,
            };
            for (grad_at, at, chunk) in r.parts {
                let _ = grads.f_narrow(0, grad_at, chunk)?.f_add_(&r.mine.f_narrow(0, at, chunk)?)?;
            }
            self.grads = Some(grads);
            Ok(())
        })
    }
}

impl ParamGate for Params {
    fn gather(&self, unit: Unit) -> std::result::Result<(), String> {
        let mut st = self.lock();
        if st.whole {
            return Ok(());
        }
        let first = match st.units.get_mut(&unit) {
            Some(u) => {
                u.users += 1;
                u.users == 1
            }
            None => false,
        };
        if first {
            st.gather_unit(unit).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    fn prefetch(&self, unit: Unit) -> std::result::Result<(), String> {
        let mut st = self.lock();
        // The same decision on every rank: their calls and unit states are the same.
        let idle = st.units.get(&unit).is_some_and(|u| u.users == 0);
        if st.whole || st.inflight.is_some() || !idle {
            return Ok(());
        }
        st.prefetch_unit(unit).map_err(|e| e.to_string())
    }

    fn release(&self, unit: Unit, grads: bool) -> std::result::Result<(), String> {
        let mut st = self.lock();
        if st.whole {
            return Ok(());
        }
        if grads {
            st.reduce_unit(unit).map_err(|e| e.to_string())?;
        }
        let st = &mut *st;
        let Some(u) = st.units.get_mut(&unit) else { return Ok(()) };
        u.users = u.users.saturating_sub(1);
        if u.users == 0 {
            for &i in &u.vars {
                free(&st.vars[i].var).map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    }
}

/// Rank `rank`'s chunk `[chunk]` of `var` (a view where no padding is needed): its elements
/// flat, zero-padded to `w · chunk`, cut into `w` chunks.
fn own_chunk(var: &Tensor, w: i64, rank: i64, chunk: i64) -> Result<Tensor> {
    let flat = var.f_detach()?.f_reshape([-1])?;
    let pad = w * chunk - flat.numel() as i64;
    let flat = if pad > 0 { flat.f_constant_pad_nd([0, pad])? } else { flat };
    Ok(flat.f_view([w, chunk])?.f_select(0, rank)?)
}

/// Points `var` at an empty tensor of its dtype and device, freeing its storage.
fn free(var: &Tensor) -> Result<()> {
    let empty = Tensor::f_empty([0], (var.kind(), var.device()))?;
    var.shallow_clone().f_set_data(&empty)?;
    Ok(())
}
