//! Log-probabilities and entropy of given tokens.
//!
//! The LM head and the fp32 log-softmax are applied to a bounded number of rows at a time, so the
//! `[tokens, vocab]` fp32 tensor never exists for the whole batch in the forward. A training pass
//! ([`token_logprobs_pass`], with or without activation checkpointing) of more than one chunk
//! keeps no logits: its log-probs are computed without a graph, and its backward
//! ([`LogProbPass::backward`]) recomputes the head one chunk at a time (the chunked linear +
//! log-softmax + gather of Liger-Kernel's fused linear cross-entropy, here with libtorch's own
//! operators), so at most one chunk's `[rows, vocab]` logits and their gradient exist at once, in
//! the forward and in the backward. [`token_logprobs`] called with gradients on lets autograd keep
//! every chunk's logits.

use tch::{Kind, Tensor};

use rlhf_models::{position_ids_from_mask, CausalLm, Checkpointed, Images, Packing, PassCost, SharedPrefixes, Visual};

use crate::error::{GenerationError, Result};

/// Options of [`token_logprobs`].
#[derive(Debug, Clone, Copy)]
pub struct LogProbOptions {
    /// Upper bound on `rows × vocab` fp32 logits materialised at once.
    pub max_chunk_elements: i64,
    /// Also compute the entropy of each predictive distribution.
    pub entropy: bool,
    /// Compute a prompt (the first `from` tokens) that several rows share once for all of them
    /// ([`CausalLm::hidden_states_after_prefix`]): GRPO's G samples of a prompt. Equal to the
    /// plain pass within float rounding; without shared prompts it is the plain pass.
    pub share_prefix: bool,
    /// Run the layers padding-free ([`rlhf_models::packing`]): the rows without their padding, packed
    /// into as few rows as hold them — with `share_prefix`, each shared prompt laid once in a
    /// packed row and its rows' completions after it, where the model allows
    /// ([`Packing::sharing`]), in rows as wide as pays ([`Packing::cheapest`]). Equal to the plain
    /// pass within float rounding; the layout of the fewest forward FLOPs runs (packed, shared
    /// prefix, or plain: [`rlhf_models::PassCost`]). Passes with images are not packed.
    pub pack: bool,
    /// The packed rows' least width when shared prompts are laid once: 0 for the batch's own,
    /// wider to hold at least so many of a prompt's rows after one copy of it (DPO's chosen and
    /// rejected answers). Wider rows still are tried where they cost less ([`Packing::cheapest`]).
    pub pack_width: i64,
}

impl Default for LogProbOptions {
    fn default() -> Self {
        LogProbOptions { max_chunk_elements: 1 << 26, entropy: false, share_prefix: false, pack: false, pack_width: 0 }
    }
}

/// Output of [`token_logprobs`].
#[derive(Debug)]
pub struct TokenLogProbs {
    /// `log p(ids[t] | ids[..t])` for `t` in `from..seq`, fp32, `[batch, seq - from]`.
    pub logprobs: Tensor,
    /// Entropy of the same distributions, fp32, `[batch, seq - from]`.
    pub entropy: Option<Tensor>,
    /// A training pass's mixture-of-experts load-balancing loss (`[]` f32, unweighted; with a
    /// gradient) where the model computes it ([`CausalLm::router_aux_loss_coef`]): add it times
    /// that coefficient to the loss built on the log-probs. `None` otherwise.
    pub aux_loss: Option<Tensor>,
}

/// Log-probs of the tokens at positions `from..seq`, each predicted from its prefix.
///
/// # Shapes
/// - `input_ids`, `attention_mask`: `[batch, seq]`; `1 <= from < seq`
/// - returns `[batch, seq - from]` (fp32)
pub fn token_logprobs(
    model: &CausalLm,
    input_ids: &Tensor,
    attention_mask: &Tensor,
    from: i64,
    opts: LogProbOptions,
) -> Result<TokenLogProbs> {
    check_from(input_ids, from)?;
    let layout = layout(model, input_ids, attention_mask, from, opts)?;
    if let Layout::Packed(p) = &layout {
        let hidden = p.unpack(&model.hidden_states(&p.ids, &p.mask, &p.positions, None)?)?; // [b, seq, h]
        return from_hidden(model, &hidden, input_ids, from, opts);
    }
    if let Layout::Prefix(prefix) = &layout {
        let hidden = model.hidden_states_after_prefix(input_ids, attention_mask, prefix)?; // [b, seq − from + 1, h]
        return from_hidden(model, &hidden, &after_prefix(input_ids, from)?, 1, opts);
    }
    let positions = position_ids_from_mask(attention_mask)?;
    let hidden = model.hidden_states(input_ids, attention_mask, &positions, None)?; // [b, seq, h]
    from_hidden(model, &hidden, input_ids, from, opts)
}

/// The images of a batch and where their placeholders are read: in the first `prompt_len` columns
/// and, after them, where `observed` is set (a multi-turn episode's observations); any other image
/// token, in a sampled response, is text, as generation read it. A batch whose prompts and answers
/// interleave (left-padded supervised pairs) takes the whole width.
#[derive(Debug, Clone, Copy)]
pub struct ImageInputs<'a> {
    pub images: &'a Images,
    pub prompt_len: i64,
    /// `[batch, seq]`, non-zero at an observation's placeholders.
    pub observed: Option<&'a Tensor>,
}

impl<'a> ImageInputs<'a> {
    /// `images` placed in the first `prompt_len` columns only.
    pub fn prompt(images: &'a Images, prompt_len: i64) -> Self {
        ImageInputs { images, prompt_len, observed: None }
    }

    /// The slots these inputs allow ([`rlhf_models::multimodal::Slots`]).
    pub fn slots(&self) -> rlhf_models::multimodal::Slots {
        rlhf_models::multimodal::Slots {
            prompt_len: self.prompt_len,
            observed: self.observed.map(Tensor::shallow_clone),
        }
    }
}

/// [`token_logprobs`] of sequences whose prompts hold images (a vision-language model): the
/// images' features in place of their placeholders, every token at its multimodal position — the
/// positions generation gave them ([`crate::generate_with_images`]).
///
/// # Shapes
/// As [`token_logprobs`].
pub fn token_logprobs_with_images(
    model: &CausalLm,
    input_ids: &Tensor,
    attention_mask: &Tensor,
    images: ImageInputs<'_>,
    from: i64,
    opts: LogProbOptions,
) -> Result<TokenLogProbs> {
    check_from(input_ids, from)?;
    let (positions, visual) = image_inputs(model, input_ids, attention_mask, images)?;
    let hidden = model.hidden_states_with_images(input_ids, attention_mask, &positions, &visual, None)?;
    from_hidden(model, &hidden, input_ids, from, opts)
}

/// The multimodal positions of the batch and its images' features, placed in the prompts' columns.
///
/// # Shapes
/// - `input_ids`, `attention_mask`: `[batch, seq]` → positions `[3, batch, seq]`
fn image_inputs(
    model: &CausalLm,
    input_ids: &Tensor,
    attention_mask: &Tensor,
    images: ImageInputs<'_>,
) -> Result<(Tensor, Visual)> {
    let slots = images.slots();
    let (positions, _) = model.image_positions(input_ids, attention_mask, &images.images.grids, &slots)?;
    Ok((positions, model.visual(images.images, slots)?))
}

/// [`token_logprobs`] as a checkpointed pass (activation checkpointing, see
/// [`rlhf_models::checkpointing`]): neither the layers nor the LM head keep an autograd graph.
/// The returned log-probs (and entropy) are leaves that require a gradient: build the loss from
/// them, backpropagate it, then call [`LogProbPass::backward`], which recomputes the
/// head chunk by chunk and then the layers one by one.
///
/// # Shapes
/// As [`token_logprobs`].
pub fn token_logprobs_checkpointed(
    model: &CausalLm,
    input_ids: &Tensor,
    attention_mask: &Tensor,
    from: i64,
    opts: LogProbOptions,
) -> Result<(TokenLogProbs, LogProbPass)> {
    check_from(input_ids, from)?;
    let layout = layout(model, input_ids, attention_mask, from, opts)?;
    if let Layout::Packed(p) = &layout {
        let layers = model.hidden_states_checkpointed(&p.ids, &p.mask, &p.positions)?;
        let aux = layers.aux_loss().map(Tensor::shallow_clone);
        let unpacked = p.unpack(layers.hidden())?;
        let layers = Layers::Checkpointed(Box::new(layers), Some(unpacked));
        let (lp, pass) = head_pass(model, layers, input_ids.shallow_clone(), from, opts)?;
        return Ok((TokenLogProbs { aux_loss: aux, ..lp }, pass));
    }
    // The hidden states of a shared-prefix pass start at position `from − 1`: the head reads
    // them with the ids from there on, predicting from index 1.
    let (layers, ids, from) = match &layout {
        Layout::Prefix(prefix) => (
            model.hidden_states_checkpointed_after_prefix(input_ids, attention_mask, prefix)?,
            after_prefix(input_ids, from)?,
            1,
        ),
        _ => {
            let positions = position_ids_from_mask(attention_mask)?;
            (model.hidden_states_checkpointed(input_ids, attention_mask, &positions)?, input_ids.shallow_clone(), from)
        }
    };
    let aux = layers.aux_loss().map(Tensor::shallow_clone);
    let (lp, pass) = head_pass(model, Layers::Checkpointed(Box::new(layers), None), ids, from, opts)?;
    Ok((TokenLogProbs { aux_loss: aux, ..lp }, pass))
}

/// The head of a training pass over `layers`: log-probs (and entropy) computed without a graph,
/// handed out as leaves that require a gradient, with the pass that backpropagates them.
fn head_pass(
    model: &CausalLm,
    layers: Layers,
    ids: Tensor,
    from: i64,
    opts: LogProbOptions,
) -> Result<(TokenLogProbs, LogProbPass)> {
    let rows = ids.size()[0] * (ids.size()[1] - from);
    if let Layers::Graph(hidden) = &layers {
        if rows <= rows_per_chunk(model, opts) {
            // One chunk: the graph keeps the logits a recompute would make anyway, so the head
            // stays in the layers' graph and the loss's backward goes through both.
            let lp = from_hidden(model, hidden, &ids, from, opts)?;
            let leaves = TokenLogProbs { logprobs: Tensor::new(), entropy: None, aux_loss: None };
            return Ok((lp, LogProbPass { layers, ids, from, opts, leaves }));
        }
    }
    let lp = tch::no_grad(|| from_hidden(model, layers.hidden(), &ids, from, opts))?;
    let out = TokenLogProbs {
        logprobs: lp.logprobs.f_detach()?.f_set_requires_grad(true)?,
        entropy: lp.entropy.map(|e| e.f_detach()?.f_set_requires_grad(true)).transpose()?,
        aux_loss: None,
    };
    let leaves = TokenLogProbs {
        logprobs: out.logprobs.shallow_clone(),
        entropy: out.entropy.as_ref().map(Tensor::shallow_clone),
        aux_loss: None,
    };
    Ok((out, LogProbPass { layers, ids, from, opts, leaves }))
}

/// The layers under a log-prob pass: checkpointed (their inputs kept, recomputed in the
/// backward; of a packed pass, with their output unpacked through a graph to the checkpointed
/// output), or their output with its autograd graph.
#[derive(Debug)]
enum Layers {
    Checkpointed(Box<Checkpointed>, Option<Tensor>),
    Graph(Tensor),
}

impl Layers {
    /// The last hidden states, `[batch, seq, hidden]`.
    fn hidden(&self) -> &Tensor {
        match self {
            Layers::Checkpointed(_, Some(unpacked)) => unpacked,
            Layers::Checkpointed(c, None) => c.hidden(),
            Layers::Graph(h) => h,
        }
    }
}

/// A log-prob pass waiting for its backward: the layers (checkpointed, or with their graph) and
/// what the LM head needs to be recomputed.
#[derive(Debug)]
pub struct LogProbPass {
    layers: Layers,
    /// The ids aligned with `layers.hidden()`, and the first position whose token is predicted.
    ids: Tensor,
    from: i64,
    opts: LogProbOptions,
    /// The log-probs (and entropy) handed to the caller; the loss leaves its gradient on them.
    leaves: TokenLogProbs,
}

impl LogProbPass {
    /// Accumulates the parameter gradients of the pass once the loss built on its log-probs has
    /// been backpropagated: the head first, chunk by chunk — each chunk's logits recomputed with
    /// a graph and `Σ logprobs ⊙ g (+ Σ entropy ⊙ g_entropy)` backpropagated through them, `g` the
    /// gradient the loss left on the log-probs — which leaves `∂L/∂hidden` on the layers' output;
    /// then the layers (recomputed one by one when checkpointed, [`CausalLm::backward_checkpointed`],
    /// else through their graph). Nothing happens when the loss did not use the log-probs. Call
    /// it once per backpropagated loss.
    pub fn backward(&self, model: &CausalLm) -> Result<()> {
        if !self.leaves.logprobs.defined() {
            return Ok(()); // the head was in the layers' graph: the loss's backward did it all
        }
        let grad = |t: &Tensor| Some(t.grad()).filter(Tensor::defined);
        let g_lp = grad(&self.leaves.logprobs);
        let g_ent = self.leaves.entropy.as_ref().and_then(grad);
        if g_lp.is_none() && g_ent.is_none() {
            return Ok(());
        }
        // The head's input as a leaf of its own: the chunks fill disjoint rows of its gradient,
        // which then goes through the row selection to the layers' output in one backward.
        let (selected, targets) = head_rows(self.layers.hidden(), &self.ids, self.from)?;
        let rows = selected.f_detach()?.f_set_requires_grad(true)?;
        let total = rows.size()[0];
        let flat = |g: Tensor| g.f_reshape([total]);
        let (g_lp, g_ent) = (g_lp.map(flat).transpose()?, g_ent.map(flat).transpose()?);
        // The last chunk first: the order in which one backward through every chunk's graph
        // would sum their gradients into the head's weight.
        for (start, len) in chunks(total, rows_per_chunk(model, self.opts)).into_iter().rev() {
            let h = rows.f_narrow(0, start, len)?;
            let (lp, ent) = chunk_logprobs(model, &h, &targets.f_narrow(0, start, len)?, g_ent.is_some())?;
            let mut terms = Vec::with_capacity(2);
            if let Some(g) = &g_lp {
                terms.push(lp.f_mul(&g.f_narrow(0, start, len)?)?.f_sum(Kind::Float)?);
            }
            if let (Some(g), Some(ent)) = (&g_ent, &ent) {
                terms.push(ent.f_mul(&g.f_narrow(0, start, len)?)?.f_sum(Kind::Float)?);
            }
            let term = match terms.as_slice() {
                [one] => one.shallow_clone(),
                [a, b] => a.f_add(b)?,
                _ => continue,
            };
            term.f_backward()?;
        }
        let g_rows = rows.grad();
        if g_rows.defined() {
            // Through the row selection to the layers' output (and, with their graph, through
            // the layers themselves).
            selected.f_mul(&g_rows)?.f_sum(Kind::Float)?.f_backward()?;
        }
        match &self.layers {
            Layers::Checkpointed(c, _) => Ok(model.backward_checkpointed(c)?),
            Layers::Graph(_) => Ok(()),
        }
    }
}

/// The log-probs of a training step with the pass that backpropagates them (see the module
/// docs): the layers checkpointed ([`token_logprobs_checkpointed`], under
/// `train.gradient_checkpointing`) or with their autograd graph; either way the head keeps at
/// most one chunk's logits (a batch that fits in one chunk keeps its head in the graph: the
/// recompute would make those logits anyway). Build the loss from the returned log-probs,
/// backpropagate it, then call [`LogProbPass::backward`].
///
/// # Shapes
/// As [`token_logprobs`].
pub fn token_logprobs_pass(
    model: &CausalLm,
    input_ids: &Tensor,
    attention_mask: &Tensor,
    from: i64,
    opts: LogProbOptions,
    checkpointed: bool,
) -> Result<(TokenLogProbs, LogProbPass)> {
    if checkpointed {
        return token_logprobs_checkpointed(model, input_ids, attention_mask, from, opts);
    }
    check_from(input_ids, from)?;
    let layout = layout(model, input_ids, attention_mask, from, opts)?;
    if let Layout::Packed(p) = &layout {
        let (hidden, aux) = model.hidden_states_with_aux(&p.ids, &p.mask, &p.positions)?;
        let (lp, pass) = head_pass(model, Layers::Graph(p.unpack(&hidden)?), input_ids.shallow_clone(), from, opts)?;
        return Ok((TokenLogProbs { aux_loss: aux, ..lp }, pass));
    }
    let ((hidden, aux), ids, from) = match &layout {
        Layout::Prefix(prefix) => (
            model.hidden_states_after_prefix_with_aux(input_ids, attention_mask, prefix)?,
            after_prefix(input_ids, from)?,
            1,
        ),
        _ => {
            let positions = position_ids_from_mask(attention_mask)?;
            (model.hidden_states_with_aux(input_ids, attention_mask, &positions)?, input_ids.shallow_clone(), from)
        }
    };
    let (lp, pass) = head_pass(model, Layers::Graph(hidden), ids, from, opts)?;
    Ok((TokenLogProbs { aux_loss: aux, ..lp }, pass))
}

/// [`token_logprobs_pass`] of sequences whose prompts hold `images` (see
/// [`token_logprobs_with_images`]): the features go through the tower once, with a graph when the
/// tower trains (its gradient then arrives through the embeddings). A prompt with images is never
/// shared across rows (`opts.share_prefix` is ignored).
///
/// # Shapes
/// As [`token_logprobs`].
pub fn token_logprobs_pass_with_images(
    model: &CausalLm,
    input_ids: &Tensor,
    attention_mask: &Tensor,
    images: ImageInputs<'_>,
    from: i64,
    opts: LogProbOptions,
    checkpointed: bool,
) -> Result<(TokenLogProbs, LogProbPass)> {
    check_from(input_ids, from)?;
    let (positions, visual) = image_inputs(model, input_ids, attention_mask, images)?;
    let layers = if checkpointed {
        let c = model.hidden_states_checkpointed_with_images(input_ids, attention_mask, &positions, &visual)?;
        Layers::Checkpointed(Box::new(c), None)
    } else {
        Layers::Graph(model.hidden_states_with_images(input_ids, attention_mask, &positions, &visual, None)?)
    };
    head_pass(model, layers, input_ids.shallow_clone(), from, opts)
}

/// How a log-prob pass lays its rows out for the layers.
#[derive(Debug)]
enum Layout {
    /// Padding-free ([`LogProbOptions::pack`]), shared prompts laid once where the model allows.
    Packed(Packing),
    /// Each shared prompt computed once, the rest of every row on top ([`LogProbOptions::share_prefix`]).
    Prefix(SharedPrefixes),
    /// The rows as they are.
    Plain,
}

/// The layout of the fewest forward FLOPs through the layers ([`PassCost`]) among those `opts`
/// allow: the rows packed padding-free ([`Packing::cheapest`]: each shared prompt laid once per
/// packed row where the model attends by the mask alone, [`CausalLm::packs_shared_prompts`], in
/// rows as wide as pays, else the rows whole); each shared prompt computed once and the rest of
/// every row on top; the rows as they are. Packing wins a tie. All compute the same numbers within
/// float rounding.
fn layout(
    model: &CausalLm,
    input_ids: &Tensor,
    attention_mask: &Tensor,
    from: i64,
    opts: LogProbOptions,
) -> Result<Layout> {
    let (batch, seq) = (input_ids.size()[0], input_ids.size()[1]);
    let prefix = match opts.share_prefix {
        true => Some(SharedPrefixes::find(input_ids, attention_mask, from)?).filter(SharedPrefixes::any_shared),
        false => None,
    };
    let cost = PassCost::of(model.arch());
    let packed = match opts.pack {
        true => {
            let shares = |width: i64| model.packs_shared_prompts(width);
            Packing::cheapest(input_ids, attention_mask, prefix.as_ref(), opts.pack_width, &shares, cost)?
        }
        false => None,
    };
    let packed_cost = packed.as_ref().map(|p| cost.rows(p.rows(), p.width()));
    let prefix_cost = prefix.as_ref().map(|p| cost.shared_prefix(p.first.len() as i64, from, batch, seq));
    tracing::debug!(
        "log-prob pass of {batch} rows × {seq}: packed {} ({}), shared prompts {:?} slots ({}), padded {} slots ({})",
        packed.as_ref().map_or("None".to_string(), |p| format!("Some({} rows × {})", p.rows(), p.width())),
        gflops(packed_cost),
        prefix.as_ref().map(|p| p.first.len() as i64 * from + batch * (seq - from)),
        gflops(prefix_cost),
        batch * seq,
        gflops(Some(cost.rows(batch, seq)))
    );
    Ok(match (packed, prefix) {
        (Some(p), _) if prefix_cost.is_none_or(|c| packed_cost.is_some_and(|pc| pc <= c)) => Layout::Packed(p),
        (_, Some(prefix)) => Layout::Prefix(prefix),
        _ => Layout::Plain,
    })
}

/// A layout's forward cost for the debug log: `"1.234 GFLOP"`, or `"-"`.
fn gflops(cost: Option<f64>) -> String {
    cost.map_or("-".into(), |c| format!("{:.3} GFLOP", c / 1e9))
}

/// The ids from position `from − 1` on, aligned with the hidden states a shared-prefix pass
/// returns: `[batch, seq]` → `[batch, seq − from + 1]`.
fn after_prefix(input_ids: &Tensor, from: i64) -> Result<Tensor> {
    let seq = input_ids.size()[1];
    Ok(input_ids.f_narrow(1, from - 1, seq - from + 1)?)
}

fn check_from(input_ids: &Tensor, from: i64) -> Result<()> {
    let size = input_ids.size();
    if size.len() != 2 || from < 1 || from >= size[1] {
        return Err(GenerationError::Input(format!(
            "token_logprobs: ids {size:?}, from = {from}: need 1 <= from < seq"
        )));
    }
    Ok(())
}

/// The LM head, log-softmax and gather over positions `from - 1 .. seq - 1` of `hidden`, in
/// chunks of at most `opts.max_chunk_elements` logits.
///
/// # Shapes
/// - `hidden`: `[batch, seq, hidden]`; `input_ids`: `[batch, seq]` → `[batch, seq - from]`
fn from_hidden(
    model: &CausalLm,
    hidden: &Tensor,
    input_ids: &Tensor,
    from: i64,
    opts: LogProbOptions,
) -> Result<TokenLogProbs> {
    let (batch, seq) = (input_ids.size()[0], input_ids.size()[1]);
    let n = seq - from;
    let (h, targets) = head_rows(hidden, input_ids, from)?;
    let mut lps = Vec::new();
    let mut ents = Vec::new();
    for (start, len) in chunks(batch * n, rows_per_chunk(model, opts)) {
        let (lp, ent) =
            chunk_logprobs(model, &h.f_narrow(0, start, len)?, &targets.f_narrow(0, start, len)?, opts.entropy)?;
        lps.push(lp);
        ents.extend(ent);
    }
    let logprobs = Tensor::f_cat(&lps, 0)?.f_view([batch, n])?;
    let entropy = if opts.entropy { Some(Tensor::f_cat(&ents, 0)?.f_view([batch, n])?) } else { None };
    Ok(TokenLogProbs { logprobs, entropy, aux_loss: None })
}

/// The head's input rows, positions `from − 1 .. seq − 1` of `hidden`, and the tokens they
/// predict.
///
/// # Shapes
/// - `hidden`: `[batch, seq, hidden]`; `input_ids`: `[batch, seq]`
/// - returns (`[batch · (seq − from), hidden]`, `[batch · (seq − from), 1]`)
fn head_rows(hidden: &Tensor, input_ids: &Tensor, from: i64) -> Result<(Tensor, Tensor)> {
    let (batch, seq) = (input_ids.size()[0], input_ids.size()[1]);
    let n = seq - from;
    let h = hidden.f_narrow(1, from - 1, n)?.f_reshape([batch * n, -1])?;
    let targets = input_ids.f_narrow(1, from, n)?.f_reshape([batch * n, 1])?;
    Ok((h, targets))
}

/// Rows of logits per chunk: `max_chunk_elements / vocab`, at least one.
fn rows_per_chunk(model: &CausalLm, opts: LogProbOptions) -> i64 {
    (opts.max_chunk_elements / model.arch().vocab_size).max(1)
}

/// `(start, len)` of consecutive chunks of at most `rows` covering `0..total`.
fn chunks(total: i64, rows: i64) -> Vec<(i64, i64)> {
    (0..total).step_by(rows as usize).map(|start| (start, rows.min(total - start))).collect()
}

/// `log p(target)` and, with `entropy`, `H(p)` of one chunk's predictive distributions
/// `p = softmax(h Wᵀ)`: `log p = log_softmax(logits)` in f32 (from bf16 logits too: libtorch's
/// fused kernel reads them and writes f32, and its backward is one fused kernel as well — as the
/// decode step computes a sampled token's log-prob), `log p(t)` gathered at the target and
/// `H = −Σ p · log p`.
///
/// # Shapes
/// - `h`: `[rows, hidden]`; `targets`: `[rows, 1]` → (`[rows]`, `[rows]`)
fn chunk_logprobs(model: &CausalLm, h: &Tensor, targets: &Tensor, entropy: bool) -> Result<(Tensor, Option<Tensor>)> {
    let logp = model.logits_from_hidden(h)?.f_log_softmax(-1, Kind::Float)?; // [c, v]
    let lp = logp.f_gather(1, targets, false)?.f_squeeze_dim(1)?; // [c]
    if !entropy {
        return Ok((lp, None));
    }
    let ent = logp.f_exp()?.f_mul(&logp)?.f_sum_dim_intlist(-1, false, Kind::Float)?.f_neg()?; // [c]
    Ok((lp, Some(ent)))
}

/// The negative log-likelihood of the target tokens, `−Σ logprobs · mask`, summed in `kind`
/// (`Float` for losses, `Double` for perplexity over many batches). The one masked NLL of the
/// project: SFT, the RL warm-up, the ptx loss and perplexity all reduce through it.
///
/// # Shapes
/// `logprobs`, `mask`: `[batch, seq]` (the mask 1.0 on targets); returns a scalar of `kind`.
pub fn masked_nll_sum(logprobs: &Tensor, mask: &Tensor, kind: Kind) -> Result<Tensor> {
    Ok(logprobs.f_to_kind(kind)?.f_mul(mask)?.f_sum(kind)?.f_neg()?)
}

/// The mean NLL per target token (f32): [`masked_nll_sum`] over the number of targets.
///
/// # Shapes
/// `logprobs`, `mask`: `[batch, seq]` f32; returns a scalar.
pub fn masked_nll_mean(logprobs: &Tensor, mask: &Tensor) -> Result<Tensor> {
    Ok(masked_nll_sum(logprobs, mask, Kind::Float)?.f_div(&mask.f_sum(Kind::Float)?)?)
}
