//! The newer families against transformers on tiny random checkpoints made at test time
//! (`fixtures/make_families.py`): Qwen3, Qwen3-MoE (both `norm_topk_prob` values, a dense layer
//! among sparse ones), Gemma 2 and 3, OLMo 2 and 3, Phi-3, Mistral and Qwen2 with sliding windows,
//! and Qwen3.5 (Gated DeltaNet; also a row longer than two chunks of its delta rule). Every window
//! is shorter than the sequences: logits of a left-padded batch and of a packed row,
//! greedy tokens through the KV cache past the window, scalar-head scores, save → transformers
//! reload → the same logits with the same tensor names, LoRA training on every family, and a key
//! the loader does not implement refused for every family.

mod family_common;

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use family_common::{load, masked_max_abs_diff, models, reference, tol_for, TOL};
use rlhf_integration_tests::{family_models, hf_check, python, FAMILIES};
use rlhf_models::{CausalLm, ExpertSteps, LoraConfig, ModelConfig, ScalarHeadModel};
use rlhf_tokenizer::HfTokenizer;
use tch::nn::OptimizerConfig;
use tch::{Device, Kind, Tensor};

#[test]
fn logits_of_padded_and_packed_batches_match_transformers() {
    let Some(root) = models() else { return };
    for name in FAMILIES {
        let dir = root.join(name);
        let model = load(&dir);
        let r = reference(&dir);
        let logits = tch::no_grad(|| model.forward(&r["input_ids"], &r["attention_mask"])).unwrap();
        let diff = masked_max_abs_diff(&logits, &r["logits"], &r["attention_mask"]);
        let tol = tol_for(name, &dir, "");
        println!("{name}: padded max |Δlogit| = {diff:.2e}");
        assert!(diff < tol, "{name}: padded batch logits differ by {diff}");
        // Both prompts packed in one row, segment ids 1 and 2: each must equal its prompt alone.
        let ids = &r["packed_ids"];
        let (a, b) = (r["packed_logits_0"].size()[0], r["packed_logits_1"].size()[0]);
        let segs = Tensor::cat(
            &[Tensor::ones([1, a], (Kind::Int64, Device::Cpu)), Tensor::full([1, b], 2, (Kind::Int64, Device::Cpu))],
            1,
        );
        let packed = tch::no_grad(|| model.forward(ids, &segs)).unwrap().squeeze_dim(0);
        let want = Tensor::cat(&[&r["packed_logits_0"], &r["packed_logits_1"]], 0);
        let diff = (&packed - &want).abs().max().double_value(&[]);
        println!("{name}: packed max |Δlogit| = {diff:.2e}");
        assert!(diff < tol, "{name}: packed row logits differ by {diff}");
        // Linear attention: a row past two chunks of the delta rule.
        if let Some(long) = r.get("long_ids") {
            let logits = tch::no_grad(|| model.forward(long, &long.ones_like())).unwrap().squeeze_dim(0);
            let diff = (&logits - &r["long_logits"]).abs().max().double_value(&[]);
            let tol = tol_for(name, &dir, "long_f32_error");
            println!("{name}: {} tokens max |Δlogit| = {diff:.2e} (tolerance {tol:.1e})", long.size()[1]);
            assert!(diff < tol, "{name}: long row logits differ by {diff}");
        }
    }
}

#[test]
fn greedy_tokens_through_the_kv_cache_match_transformers() {
    let Some(root) = models() else { return };
    for name in FAMILIES {
        let dir = root.join(name);
        let tok = HfTokenizer::from_dir(&dir).unwrap();
        let mut model = load(&dir);
        rlhf_integration_tests::assert_greedy_matches(name, &model, &tok, &reference(&dir));
        // A mixture of experts decoding as on CUDA, over its stacked weights (capture-safe).
        let arch = model.arch();
        if arch.moe.is_some() || arch.gemma4.as_ref().is_some_and(|g| g.moe.is_some()) {
            for steps in [ExpertSteps::AllExperts, ExpertSteps::Gathered] {
                model.set_expert_steps(Some(steps));
                let how = format!("{name} ({steps:?} steps)");
                rlhf_integration_tests::assert_greedy_matches(&how, &model, &tok, &reference(&dir));
            }
        }
    }
}

#[test]
fn scalar_head_scores_match_transformers() {
    let Some(root) = models() else { return };
    for name in FAMILIES {
        let dir = root.join(format!("{name}-rm"));
        if !dir.is_dir() {
            continue; // no classifier in transformers (Qwen3.5-MoE)
        }
        let model = ScalarHeadModel::from_dir(&dir, Device::Cpu, Kind::Float).unwrap();
        let r = reference(&dir);
        let scores = tch::no_grad(|| model.scores(&r["input_ids"], &r["attention_mask"])).unwrap();
        let diff = (&scores - &r["scores"]).abs().max().double_value(&[]);
        println!("{name}-rm: max |Δscore| = {diff:.2e}");
        assert!(diff < TOL, "{name}-rm: scores differ by {diff}");
        // Saved as transformers writes the family's classifier.
        let out = tempfile::tempdir().unwrap();
        model.save(out.path()).unwrap();
        let saved = ModelConfig::from_dir(out.path()).unwrap();
        let want = saved.arch.sequence_classification_architecture();
        assert_eq!(saved.hf.architectures.as_deref(), Some(&[want.to_string()][..]), "{name}-rm");
        // The reward-model scorer lays a prompt's samples with the prompt once, padding-free:
        // the scores of the right-padded batch. (Not of each text alone: LongRoPE and dynamic
        // NTK rotary read the batch's longest position, in transformers too.)
        let ids = Vec::<Vec<i64>>::try_from(&r["input_ids"]).unwrap();
        let mask = Vec::<Vec<i64>>::try_from(&r["attention_mask"]).unwrap();
        let real =
            |k: usize| -> Vec<i64> { ids[k].iter().zip(&mask[k]).filter(|(_, &m)| m == 1).map(|(&t, _)| t).collect() };
        let prompt = real(0);
        let scorer = rlhf_reward::RewardModelScorer::from_dir(&dir, Device::Cpu, Kind::Float, 8, 1024).unwrap();
        // Short answers (packed beside one copy of the prompt where the model attends by the mask
        // alone) and long ones (each on top of the prompt's keys and values).
        let long: Vec<i64> = (30..60).collect();
        for tails in [vec![&[5, 6][..], &[7, 8, 9, 10], &[5, 6, 11], &[12]], vec![&long[..], &long[3..], &long[..20]]] {
            let mut texts: Vec<Vec<i64>> =
                tails.iter().map(|tail| prompt.iter().chain(tail.iter()).copied().collect()).collect();
            texts.push(real(1));
            let got = scorer.score_ids(&texts).unwrap();
            let padded = rlhf_generation::right_pad(&texts, 0, Device::Cpu).unwrap();
            let want = tch::no_grad(|| model.scores(&padded.input_ids, &padded.attention_mask)).unwrap();
            let want = Vec::<f64>::try_from(&want.to_kind(Kind::Double)).unwrap();
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() < TOL, "{name}-rm: scorer {got:?} against the padded batch's {want:?}");
            }
        }
    }
}

/// The checkpoint tensors of `dir` by name.
fn tensors(dir: &Path) -> std::collections::BTreeMap<String, Tensor> {
    let mut out = std::collections::BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors") && !p.ends_with("reference.safetensors") {
            out.extend(Tensor::read_safetensors(&p).unwrap());
        }
    }
    out
}

fn tensor_names(dir: &Path) -> BTreeSet<String> {
    tensors(dir).into_keys().collect()
}

#[test]
fn saved_checkpoints_reload_in_transformers_with_the_same_names_and_logits() {
    let Some(python) = python() else { return };
    let root = family_models(&python);
    let keep = tempfile::tempdir().unwrap();
    let ids: Vec<i64> = vec![5, 17, 42, 9, 101, 7, 3, 64, 12, 250, 33, 8];
    let mut ours = Vec::new();
    let mut dirs = Vec::new();
    for name in FAMILIES {
        let model = load(&root.join(name));
        let out = keep.path().join(name);
        model.save(&out).unwrap();
        assert_eq!(tensor_names(&out), tensor_names(&root.join(name)), "{name}: saved tensor names");
        // q/k/v and gate/up share one buffer each in memory; each saves its own rows, unchanged.
        let (saved, source) = (tensors(&out), tensors(&root.join(name)));
        for (n, t) in &source {
            assert!(saved[n].equal(t), "{name}: {n} saved differs from the checkpoint");
        }
        let x = Tensor::from_slice(&ids).view([1, -1]);
        ours.push(tch::no_grad(|| model.forward(&x, &x.ones_like())).unwrap().squeeze_dim(0));
        dirs.push(out.display().to_string());
    }
    let ids_arg = ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
    let theirs = hf_check(&python, &["logits-many", "--models", &dirs.join(","), "--ids", &ids_arg]);
    for ((name, dir), ours) in FAMILIES.iter().zip(&dirs).zip(&ours) {
        let rows: Vec<Vec<f32>> = serde_json::from_value(theirs[dir.as_str()].clone()).unwrap();
        let flat: Vec<f32> = rows.concat();
        let theirs = Tensor::from_slice(&flat).view([rows.len() as i64, -1]);
        let diff = (ours - &theirs).abs().max().double_value(&[]);
        let tol = tol_for(name, &root.join(name), "save_f32_error");
        println!("{name}: saved → transformers max |Δlogit| = {diff:.2e} (tolerance {tol:.1e})");
        assert!(diff < tol, "{name}: transformers reads our save differently ({diff})");
    }
}

/// A few AdamW steps on LoRA adapters of every linear layer lower the loss of a fixed batch, and
/// the merged save computes what the adapted model computes.
#[test]
fn lora_trains_on_every_family() {
    let Some(root) = models() else { return };
    let ids = Tensor::from_slice(&[5i64, 17, 42, 9, 101, 7, 3, 64, 12, 250, 33, 8]).view([2, 6]);
    let mask = ids.ones_like();
    for name in FAMILIES {
        let mut m = load(&root.join(name));
        // Stacked experts are adapted as PEFT's `target_parameters` adapts them.
        let target_parameters = if STACKED_EXPERTS.contains(name) {
            vec!["experts.gate_up_proj".into(), "experts.down_proj".into()]
        } else {
            vec![]
        };
        let cfg = LoraConfig {
            rank: 4,
            alpha: 8.0,
            dropout: 0.0,
            target_modules: vec!["all-linear".into()],
            target_parameters,
        };
        assert!(m.apply_lora(&cfg).unwrap() > 0, "{name}: no layer adapted");
        let training: Vec<String> =
            m.vs.variables().into_iter().filter(|(_, t)| t.requires_grad()).map(|(n, _)| n).collect();
        assert!(training.iter().all(|n| n.contains(".lora_")), "{name}: only adapters train: {training:?}");
        let mut opt = tch::nn::Adam::default().build(&m.vs, 1e-2).unwrap();
        let loss_of = |m: &CausalLm| {
            let logits = m.forward(&ids, &mask).unwrap();
            let v = logits.size()[2];
            logits.narrow(1, 0, 5).reshape([-1, v]).cross_entropy_for_logits(&ids.narrow(1, 1, 5).reshape([-1]))
        };
        let first = loss_of(&m).double_value(&[]);
        for _ in 0..5 {
            opt.backward_step(&loss_of(&m));
        }
        let last = tch::no_grad(|| loss_of(&m)).double_value(&[]);
        println!("{name}: LoRA loss {first:.4} -> {last:.4}");
        assert!(last < first, "{name}: LoRA training did not lower the loss ({first} -> {last})");
        let adapted = tch::no_grad(|| m.forward(&ids, &mask)).unwrap();
        let out = tempfile::tempdir().unwrap();
        m.save(out.path()).unwrap();
        let merged = tch::no_grad(|| load(out.path()).forward(&ids, &mask)).unwrap();
        let diff = (&adapted - &merged).abs().max().double_value(&[]);
        let scale = adapted.abs().max().double_value(&[]);
        println!("{name}: merged save max |Δlogit| = {diff:.2e} at max |logit| {scale:.1}");
        // Merging rounds each adapted weight once (W + s·BA in f32); the peaky random weights
        // amplify that through the layers, and the LoRA init is random per run: measured up to
        // 6.8e-5 of the largest logit (Gemma 4's MoE, once in several runs; 1.7e-5 for Qwen3.5),
        // so 2e-4 of it. A wrong merge is off by the adapters' whole effect, of order 1 here.
        let tol = 2e-4 * scale.max(2.0);
        assert!(diff < tol, "{name}: merged save differs from the adapted model by {diff} (tolerance {tol:.1e})");
        if STACKED_EXPERTS.contains(name) {
            stacked_adapters_load_in_peft(&m, name, &root.join(name), &ids, &adapted);
        }
    }
}

/// The families whose checkpoints stack their experts (`experts.gate_up_proj`, `experts.down_proj`).
const STACKED_EXPERTS: &[&str] = &["qwen3_5_moe-vl", "gpt_oss", "gemma4-moe"];

/// A LoRA adapter with stacked expert updates, saved in PEFT's layout, loads in PEFT on top of
/// the base checkpoint and computes what the adapted model computed (the first row of `ids`).
fn stacked_adapters_load_in_peft(m: &CausalLm, name: &str, base: &Path, ids: &Tensor, adapted: &Tensor) {
    let Some(python) = python() else { return };
    assert!(
        m.vs.variables().keys().any(|n| n.ends_with("experts.gate_up_proj.lora_B.weight")),
        "{name}: the stacked experts have no adapter"
    );
    let dir = tempfile::tempdir().unwrap();
    m.save_lora_adapter(dir.path()).unwrap();
    let row: Vec<i64> = Vec::try_from(ids.get(0)).unwrap();
    let ids_arg = row.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
    let out = hf_check(
        &python,
        &[
            "peft-logits",
            "--model",
            &base.display().to_string(),
            "--adapter",
            &dir.path().display().to_string(),
            "--ids",
            &ids_arg,
        ],
    );
    let rows: Vec<Vec<f32>> = serde_json::from_value(out["logits"].clone()).unwrap();
    let theirs = Tensor::from_slice(&rows.concat()).view([rows.len() as i64, -1]);
    let diff = (&adapted.get(0) - &theirs).abs().max().double_value(&[]);
    println!("{name}: adapter in PEFT max |Δlogit| = {diff:.2e}");
    assert!(diff < 5e-5 * adapted.abs().max().double_value(&[]).max(2.0), "{name}: PEFT computes {diff} away");
}

/// A key that would change the computation and that no family implements (OLMo's `clip_qkv`) is
/// refused with the file and the key, for every family.
#[test]
fn unimplemented_config_keys_are_refused_for_every_family() {
    let Some(root) = models() else { return };
    for name in FAMILIES {
        let dir = tempfile::tempdir().unwrap();
        let mut config = rlhf_integration_tests::read_json(&root.join(name).join("config.json"));
        config["clip_qkv"] = serde_json::json!(8.0);
        std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
        let e = ModelConfig::from_dir(dir.path()).unwrap_err().to_string();
        assert!(e.contains("config.json: clip_qkv: not a key this loader implements"), "{name}: {e}");
        assert_eq!(e.lines().count(), 1, "{name}: {e}");
    }
}

/// gpt-oss's released checkpoints store their experts in MXFP4: loaded, every expert weight is
/// transformers' dequantisation bit for bit, the model computes what transformers computes with
/// those weights, and a save writes them unquantised (no `quantization_config`) for transformers.
#[test]
fn gpt_oss_mxfp4_experts_dequantize_bit_exactly() {
    let Some(python) = python() else { return };
    let dir = family_models(&python).join("gpt_oss-mxfp4");
    let model = load(&dir);
    let r: HashMap<String, Tensor> =
        Tensor::read_safetensors(dir.join("mxfp4_reference.safetensors")).unwrap().into_iter().collect();
    let vars = model.vs.variables();
    let mut checked = 0;
    for (name, want) in r.iter().filter(|(n, _)| n.starts_with("deq.")) {
        let got = &vars[&name["deq.".len()..]];
        assert!(got.equal(want), "{name}: dequantised weights differ");
        checked += 1;
    }
    assert_eq!(checked, 6, "gate_up_proj and down_proj of 3 layers");
    let logits = tch::no_grad(|| model.forward(&r["input_ids"], &r["attention_mask"])).unwrap();
    let diff = masked_max_abs_diff(&logits, &r["logits"], &r["attention_mask"]);
    println!("gpt_oss-mxfp4: max |Δlogit| = {diff:.2e}");
    assert!(diff < TOL, "gpt_oss-mxfp4: logits differ by {diff}");
    let out = tempfile::tempdir().unwrap();
    model.save(out.path()).unwrap();
    let config = rlhf_integration_tests::read_json(&out.path().join("config.json"));
    assert!(config.get("quantization_config").is_none(), "{config}");
    let names = tensor_names(out.path());
    assert!(names.contains("model.layers.0.mlp.experts.gate_up_proj"));
    assert!(!names.iter().any(|n| n.ends_with("_blocks") || n.ends_with("_scales")));
    let theirs =
        hf_check(&python, &["logits-many", "--models", &out.path().display().to_string(), "--ids", "5,17,42,9"]);
    assert!(theirs.get(out.path().display().to_string().as_str()).is_some());
}

/// A copy of fixture `name` whose config sets `output_router_logits: true` (in `text_config`
/// where the checkpoint nests the language model's keys), without its references.
fn with_router_aux_loss(root: &Path, name: &str) -> tempfile::TempDir {
    let out = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(root.join(name)).unwrap() {
        let e = e.unwrap();
        if !e.file_name().to_string_lossy().starts_with("reference") {
            std::fs::copy(e.path(), out.path().join(e.file_name())).unwrap();
        }
    }
    let path = out.path().join("config.json");
    let mut config = rlhf_integration_tests::read_json(&path);
    let text = match config.get_mut("text_config") {
        Some(t) => t,
        None => &mut config,
    };
    text["output_router_logits"] = serde_json::json!(true);
    std::fs::write(&path, serde_json::to_string_pretty(&config).unwrap()).unwrap();
    out
}

/// Zeroes every gradient, runs `f` (which backpropagates), and returns the gradients of the
/// variables whose names end with each suffix.
fn grads_after(model: &CausalLm, suffixes: &[&str], f: impl FnOnce()) -> Vec<Tensor> {
    for (_, t) in model.vs.variables() {
        let mut g = t.grad();
        if g.defined() {
            let _ = g.zero_();
        }
    }
    f();
    let vars = model.vs.variables();
    suffixes
        .iter()
        .map(|s| {
            let (_, t) = vars.iter().find(|(n, _)| n.ends_with(s)).unwrap_or_else(|| panic!("no variable *{s}"));
            t.grad().copy()
        })
        .collect()
}

/// The mixture-of-experts load-balancing loss (`output_router_logits: true`) of a left-padded
/// batch is transformers' `aux_loss`, with its gradients (a router, the embeddings), from a plain
/// pass and from a checkpointed one; a pass computing a shared prompt once gives the loss and the
/// gradients of the whole rows.
#[test]
fn moe_load_balancing_loss_matches_transformers() {
    let Some(root) = models() else { return };
    for name in ["qwen3_moe", "qwen3_moe-step", "qwen3_5_moe-vl", "gpt_oss", "qwen3_next"] {
        let r = reference(&root.join(name));
        let dir = with_router_aux_loss(root, name);
        let model = load(dir.path());
        assert!(model.router_aux_loss_coef().is_some_and(|c| c > 0.0), "{name}");
        let (ids, mask) = (&r["input_ids"], &r["attention_mask"]);
        let pos = rlhf_models::position_ids_from_mask(mask).unwrap();
        let layer = r["aux_router_layer"].int64_value(&[0]);
        let router = if name == "gpt_oss" { "mlp.router.weight" } else { "mlp.gate.weight" };
        let suffixes = [format!("layers.{layer}.{router}"), "embed_tokens.weight".to_string()];
        let suffixes: Vec<&str> = suffixes.iter().map(String::as_str).collect();
        let want = [&r["aux_grad_router"], &r["aux_grad_embed"]];
        let check = |how: &str, aux: f64, grads: Vec<Tensor>| {
            let want_aux = r["aux_loss"].double_value(&[0]);
            println!("{name} ({how}): aux {aux:.6} vs transformers {want_aux:.6}");
            assert!((aux - want_aux).abs() < 1e-5 * want_aux.abs().max(1.0), "{name} ({how}): aux {aux} vs {want_aux}");
            for ((s, got), want) in suffixes.iter().zip(&grads).zip(want) {
                let scale = want.abs().max().double_value(&[]);
                let diff = (got - want).abs().max().double_value(&[]);
                assert!(
                    scale > 0.0 && diff < 1e-4 * scale,
                    "{name} ({how}): ∂aux/∂{s} differs by {diff} (max {scale})"
                );
            }
        };
        let mut aux = 0.0;
        let grads = grads_after(&model, &suffixes, || {
            let (_, a) = model.hidden_states_with_aux(ids, mask, &pos).unwrap();
            let a = a.expect("aux loss");
            aux = a.double_value(&[]);
            a.backward();
        });
        check("plain", aux, grads);
        let grads = grads_after(&model, &suffixes, || {
            let ck = model.hidden_states_checkpointed(ids, mask, &pos).unwrap();
            let a = ck.aux_loss().expect("aux loss");
            aux = a.double_value(&[]);
            a.backward();
            model.backward_checkpointed(&ck).unwrap();
        });
        check("checkpointed", aux, grads);
    }

    // Two prompts each held by two rows: the prompt computed once counts for both rows.
    let dir = with_router_aux_loss(root, "qwen3_moe");
    let model = load(dir.path());
    let ids = Tensor::from_slice(&[
        5i64, 17, 42, 9, 101, 7, 3, 64, 12, 250, //
        5, 17, 42, 9, 101, 7, 8, 33, 0, 0, //
        0, 0, 77, 21, 60, 14, 90, 91, 92, 93, //
        0, 0, 77, 21, 60, 14, 4, 0, 0, 0,
    ])
    .view([4, 10]);
    let mask = ids.ne(0).to_kind(Kind::Int64);
    let p = 6;
    let pos = rlhf_models::position_ids_from_mask(&mask).unwrap();
    let prefix = rlhf_models::SharedPrefixes::find(&ids, &mask, p).unwrap();
    assert!(prefix.any_shared());
    let suffixes = ["layers.2.mlp.gate.weight", "embed_tokens.weight"];
    let run = |f: &dyn Fn() -> f64| {
        let mut aux = 0.0;
        let grads = grads_after(&model, &suffixes, || aux = f());
        (aux, grads)
    };
    let (aux, grads) = run(&|| {
        let a = model.hidden_states_with_aux(&ids, &mask, &pos).unwrap().1.unwrap();
        a.backward();
        a.double_value(&[])
    });
    let shared = run(&|| {
        let a = model.hidden_states_after_prefix_with_aux(&ids, &mask, &prefix).unwrap().1.unwrap();
        a.backward();
        a.double_value(&[])
    });
    let shared_ck = run(&|| {
        let ck = model.hidden_states_checkpointed_after_prefix(&ids, &mask, &prefix).unwrap();
        let a = ck.aux_loss().unwrap();
        a.backward();
        model.backward_checkpointed(&ck).unwrap();
        a.double_value(&[])
    });
    for (how, (a, g)) in [("shared prompts", shared), ("shared prompts, checkpointed", shared_ck)] {
        assert!((a - aux).abs() < 1e-6, "{how}: aux {a} vs {aux}");
        for ((s, got), want) in suffixes.iter().zip(&g).zip(&grads) {
            let diff = (got - want).abs().max().double_value(&[]);
            assert!(diff < 1e-5, "{how}: ∂aux/∂{s} differs by {diff}");
        }
    }
}
