//! Qwen3-VL (deep stack, interleaved multimodal RoPE, learned position grid), Qwen3-VL-MoE (its
//! stacked experts in both stored layouts) and Qwen3.5's
//! multimodal checkpoint (the same tower without the deep stack, over the hybrid Gated DeltaNet
//! language model) against transformers on tiny random checkpoints made at test time
//! (`fixtures/make_vl3.py`): a left-padded batch of a prompt with one image, one with two and one
//! of text alone — the patches of our processor (read from the checkpoint's
//! `preprocessor_config.json`: patches of 16, statistics 0.5) equal to transformers', the logits
//! within the families' tolerance, greedy tokens through the rollout engine's cache equal, a save
//! reloading to the same logits bit for bit, and gradients through the language model, the
//! deep-stack mergers and the whole tower equal to transformers' in plain and checkpointed
//! backward passes.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use rlhf_integration_tests::{grads_after as grads, logit_diff, python, token_loss};
use rlhf_models::multimodal::Slots;
use rlhf_models::{CausalLm, Images};
use rlhf_vision::{load_path, QwenVlProcessor};
use tch::{Device, Kind, Tensor};

/// The families' tolerance (transformers' own f32 logits are within 3e-7 of its f64 ones here).
const TOL: f64 = 1e-4;

fn reference(dir: &Path) -> HashMap<String, Tensor> {
    Tensor::read_safetensors(dir.join("reference.safetensors")).unwrap().into_iter().collect()
}

/// Our processor's patches for each row's images, in order.
fn images(dir: &Path, processor: &QwenVlProcessor) -> Images {
    let rows: Vec<Vec<String>> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("rows.json")).unwrap()).unwrap();
    let (mut values, mut grids) = (Vec::new(), Vec::new());
    for name in rows.iter().flatten() {
        let path = dir.parent().unwrap().join("images").join(name);
        let p = processor.preprocess(&load_path(&path).unwrap(), name).unwrap();
        values.push(Tensor::from_slice(&p.values).view([p.len() as i64, p.dim as i64]));
        grids.push(p.grid.map(|g| g as i64));
    }
    Images::new(Tensor::cat(&values, 0), grids)
}

fn tensor_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        Tensor::read_safetensors(dir.join("model.safetensors")).unwrap().into_iter().map(|(n, _)| n).collect();
    names.sort();
    names
}

/// Everything the module docs list, for one checkpoint of the fixture.
fn check(name: &str, deepstack: usize) {
    let dir = rlhf_integration_tests::vl3_fixture().join(name);
    let r = reference(&dir);
    let src = dir.join("model");
    let processor = QwenVlProcessor::from_file(&src.join("preprocessor_config.json")).unwrap();
    let imgs = images(&dir, &processor);
    let grids: Vec<Vec<i64>> = Vec::try_from(&r["image_grid_thw"]).unwrap();
    assert_eq!(imgs.grids.iter().map(|g| g.to_vec()).collect::<Vec<_>>(), grids, "{name}: grids");
    let diff = (&imgs.pixel_values - &r["pixel_values"]).abs().max().double_value(&[]);
    assert_eq!(diff, 0.0, "{name}: processor patches differ from transformers'");
    let (ids, mask, targets) = (&r["input_ids"], &r["attention_mask"], &r["targets"]);
    let m = CausalLm::from_dir(&src, Device::Cpu, Kind::Float).unwrap();
    let tower = m.vision().expect("the tower is read").config();
    assert_eq!((tower.patch_size, tower.deepstack_blocks.len()), (16, deepstack), "{name}");
    let logits = tch::no_grad(|| m.forward_with_images(ids, mask, &imgs)).unwrap();
    let d = logit_diff(&logits, &r["logits"], mask);
    println!("{name}: max |Δlogit| = {d:.2e}");
    assert!(d < TOL, "{name}: logits differ by {d}");
    // The tower's features computed once (as the trainer keeps a frozen tower's), then taken by
    // a pass instead of the tower: the same logits within f32 rounding (the images went through
    // the tower one batch at a time).
    let with = m.with_features(&imgs).unwrap();
    assert_eq!(with.features.as_ref().map(Vec::len), Some(imgs.grids.len()));
    let cached = tch::no_grad(|| m.forward_with_images(ids, mask, &with)).unwrap();
    let d = logit_diff(&cached, &logits, mask);
    assert!(d < 1e-5, "{name}: logits from kept features differ by {d}");
    let picked = with.select(&[2, 0]).unwrap();
    assert_eq!(picked.features.as_ref().unwrap()[1].features, with.features.as_ref().unwrap()[0].features);
    // A critic made from the checkpoint (its tower with it): its values with the images are its
    // head on the language model's hidden states with the images, and not those without them.
    let critic = rlhf_models::ScalarHeadModel::from_causal_lm_dir(&src, Device::Cpu, Kind::Float).unwrap();
    assert!(critic.vision().is_some() && m.same_vision(critic.vision()), "{name}: the critic's tower");
    let width = ids.size()[1];
    let (values, _) =
        tch::no_grad(|| critic.values_pass_with_images(ids, mask, &imgs, Slots::prompt(width), false)).unwrap();
    let (pos, _) = m.image_positions(ids, mask, &imgs.grids, &Slots::prompt(width)).unwrap();
    let h = tch::no_grad(|| {
        m.hidden_states_with_images(ids, mask, &pos, &m.visual(&imgs, Slots::prompt(width)).unwrap(), None)
    })
    .unwrap();
    let score = critic.vs.variables()["score.weight"].shallow_clone();
    let want = h.linear::<&Tensor>(&score, None).squeeze_dim(-1);
    let real = mask.to_kind(Kind::Bool);
    let d = (&values - &want).abs().masked_select(&real).max().double_value(&[]);
    assert!(d < 1e-6, "{name}: critic values with images differ from the head on the hidden states by {d}");
    let text_only = tch::no_grad(|| critic.values(ids, mask)).unwrap();
    let d = (&values - &text_only).abs().masked_select(&real).max().double_value(&[]);
    assert!(d > 1e-3, "{name}: the critic's values do not depend on the images ({d})");
    // Greedy tokens through the rollout engine (the prompt's images prefilled, each row's delta
    // after it).
    let cfg = rlhf_generation::GenerateConfig::greedy(8, vec![], 0);
    let out = rlhf_generation::generate_with_images(&m, ids, mask, &imgs, &cfg).unwrap();
    assert_eq!(
        Vec::<Vec<i64>>::try_from(&out.responses().unwrap()).unwrap(),
        Vec::<Vec<i64>>::try_from(&r["greedy"]).unwrap(),
        "{name}: greedy tokens"
    );
    // Save → reload: the same names, the same logits bit for bit.
    let saved = dir.join("saved");
    m.save(&saved).unwrap();
    assert_eq!(tensor_names(&saved), tensor_names(&src), "{name}: saved tensor names");
    let again = CausalLm::from_dir(&saved, Device::Cpu, Kind::Float).unwrap();
    let logits2 = tch::no_grad(|| again.forward_with_images(ids, mask, &imgs)).unwrap();
    assert!(logits2.equal(&logits), "{name}: the reloaded save computes other logits");
    // Gradients, the tower trained: a plain and a checkpointed backward.
    assert!(m.set_vision_trainable(true) > 0);
    let names: Vec<String> = r
        .keys()
        .filter_map(|k| k.strip_prefix("grad."))
        .map(String::from)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let plain = grads(&m.vs, &names, || {
        token_loss(&m.forward_with_images(ids, mask, &imgs).unwrap(), targets, mask).backward()
    });
    let checkpointed = grads(&m.vs, &names, || {
        let width = ids.size()[1];
        let (pos, _) = m.image_positions(ids, mask, &imgs.grids, &Slots::prompt(width)).unwrap();
        let visual = m.visual(&imgs, Slots::prompt(width)).unwrap();
        let ck = m.hidden_states_checkpointed_with_images(ids, mask, &pos, &visual).unwrap();
        token_loss(&m.logits_from_hidden(ck.hidden()).unwrap(), targets, mask).backward();
        m.backward_checkpointed(&ck).unwrap();
    });
    for ((n, a), b) in names.iter().zip(&plain).zip(&checkpointed) {
        let want = &r[&format!("grad.{n}")];
        let largest = want.abs().max().double_value(&[]);
        let scale = largest.max(1.0);
        let (dp, dc) = ((a - want).abs().max().double_value(&[]), (b - want).abs().max().double_value(&[]));
        println!("{name} {n}: max |grad| {largest:.2e}, |Δ| plain {dp:.2e}, checkpointed {dc:.2e}");
        assert!(largest > 0.0, "{name} {n}: the reference gradient is zero");
        assert!(dp < 1e-5 * scale && dc < 1e-5 * scale, "{name} {n}: gradients differ ({dp}, {dc})");
    }
}

#[test]
fn qwen3_vl_matches_transformers_with_images() {
    if python().is_none() {
        return;
    }
    check("qwen3_vl", 2);
}

/// Qwen3-VL-MoE as transformers 5 saves it, and with its experts stored the Hub's way round
/// (`[experts, hidden, 2 · inter]`, `[experts, inter, hidden]`): the same logits, and a save that
/// keeps the layout it loaded.
#[test]
fn qwen3_vl_moe_matches_transformers_with_images() {
    if python().is_none() {
        return;
    }
    check("qwen3_vl_moe", 2);
    let dir = rlhf_integration_tests::vl3_fixture().join("qwen3_vl_moe");
    let r = reference(&dir);
    let processor = QwenVlProcessor::from_file(&dir.join("model/preprocessor_config.json")).unwrap();
    let imgs = images(&dir, &processor);
    let (ids, mask) = (&r["input_ids"], &r["attention_mask"]);
    let hub = CausalLm::from_dir(&dir.join("hub"), Device::Cpu, Kind::Float).unwrap();
    let logits = tch::no_grad(|| hub.forward_with_images(ids, mask, &imgs)).unwrap();
    let d = logit_diff(&logits, &r["logits"], mask);
    assert!(d < TOL, "the Hub's layout: logits differ by {d}");
    let saved = dir.join("hub-saved");
    hub.save(&saved).unwrap();
    let shapes = |d: &Path| -> Vec<(String, Vec<i64>)> {
        let mut v: Vec<_> = Tensor::read_safetensors(d.join("model.safetensors"))
            .unwrap()
            .into_iter()
            .map(|(n, t)| (n, t.size()))
            .collect();
        v.sort();
        v
    };
    assert_eq!(shapes(&saved), shapes(&dir.join("hub")), "the save changed the experts' layout");
}

#[test]
fn qwen3_5_matches_transformers_with_images() {
    if python().is_none() {
        return;
    }
    check("qwen3_5", 0);
}

/// GRPO with images on both checkpoints, on make_vl.py's prompt rows (one image; two in chat
/// parts; text alone): every fresh pass sees its rows' images and deep-stack features (the
/// minibatches' log-probs are the old policy's: nothing clipped, `approx_kl` 0), the frozen tower
/// is saved as loaded, `model.freeze_vision = false` trains it (the deep-stack mergers included),
/// and Qwen3-VL at ZeRO stage 3 on 2 ranks samples and scores what one process does.
#[test]
fn grpo_trains_qwen3_vl_and_qwen3_5_on_prompts_with_images() {
    use rlhf_integration_tests::{metrics, rlhf, vl_fixture};
    if python().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let reward = dir.path().join("reward.py");
    std::fs::write(
        &reward,
        "def reward_func(completions, **kwargs):\n    return [float(len(str(c))) for c in completions]\n",
    )
    .unwrap();
    let prompts = vl_fixture().join("prompts.jsonl");
    let run = |name: &str, tag: &str, extra: &[&str]| -> Vec<serde_json::Value> {
        let model = rlhf_integration_tests::vl3_fixture().join(name).join("model");
        let config = dir.path().join(format!("{tag}.toml"));
        std::fs::write(
            &config,
            format!(
                "[run]\nseed = 7\ndevice = \"cpu\"\ndtype = \"f32\"\n[model]\nactor = {model:?}\n[data]\nprompts = \
                 {prompts:?}\nmax_prompt_len = 256\n[rollout]\nprompts_per_batch = 3\nsamples_per_prompt = 2\n\
                 max_new_tokens = 4\ntemperature = 1.0\n[train]\nsteps = 2\nppo_epochs = 1\nminibatch_size = 2\n\
                 gradient_accumulation_steps = 3\nlr = 1e-3\n[algorithm]\nname = \"grpo\"\n[algorithm.config]\n\
                 beta = 0.04\nepsilon = 1e-4\n[[rewards]]\nplugin = \"reward-python\"\nname = \"length\"\n\
                 [rewards.config]\nfile = {reward:?}\nworkers = 1\n",
                model = model.display().to_string(),
                prompts = prompts.display().to_string(),
                reward = reward.display().to_string(),
            ),
        )
        .unwrap();
        let out_dir = dir.path().join(tag);
        let args =
            ["train", "--config", config.to_str().unwrap(), "--run-dir", out_dir.to_str().unwrap(), "--no-progress"];
        let out = rlhf(&[&args[..], extra].concat());
        assert!(out.status.success(), "{tag}: {}", String::from_utf8_lossy(&out.stderr));
        let lines: Vec<serde_json::Value> = metrics(&out_dir).into_iter().filter(|l| l["step"] != 0).collect();
        assert_eq!(lines.len(), 2, "{tag}");
        for l in &lines {
            let clipped = l["clip_ratio/low_mean"].as_f64().unwrap() + l["clip_ratio/high_mean"].as_f64().unwrap();
            assert_eq!(clipped, 0.0, "{tag}: {l}");
            assert!(l["approx_kl"].as_f64().unwrap().abs() < 1e-9, "{tag}: {l}");
        }
        lines
    };
    let tower = |tag: &str| -> HashMap<String, Tensor> {
        let file = dir.path().join(tag).join("actor/model.safetensors");
        Tensor::read_safetensors(file).unwrap().into_iter().filter(|(n, _)| n.starts_with("model.visual.")).collect()
    };
    let loaded = |name: &str| -> HashMap<String, Tensor> {
        let file = rlhf_integration_tests::vl3_fixture().join(name).join("model/model.safetensors");
        Tensor::read_safetensors(file).unwrap().into_iter().filter(|(n, _)| n.starts_with("model.visual.")).collect()
    };
    let unchanged = |a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>, name: &str| {
        !a.is_empty() && a.len() == b.len() && a.iter().all(|(n, t)| b[n].equal(t) || !n.contains(name))
    };
    let one = run("qwen3_vl", "vl", &[]);
    assert!(unchanged(&tower("vl"), &loaded("qwen3_vl"), ""), "the frozen tower changed");
    run("qwen3_5", "q35", &[]);
    assert!(unchanged(&tower("q35"), &loaded("qwen3_5"), ""), "the frozen tower changed");
    run("qwen3_vl", "vl-trained", &["--set", "model.freeze_vision=false"]);
    let (trained, before) = (tower("vl-trained"), loaded("qwen3_vl"));
    for part in ["patch_embed", "pos_embed", "blocks.0.", "merger.", "deepstack_merger_list.1."] {
        assert!(!unchanged(&trained, &before, part), "{part} did not train");
    }
    let three = run("qwen3_vl", "vl-zero3", &["--nproc", "2", "--set", "distributed.zero_stage=3"]);
    assert_eq!(one[0]["reward"], three[0]["reward"]);
    let (a, c) = (one[0]["loss/total"].as_f64().unwrap(), three[0]["loss/total"].as_f64().unwrap());
    assert!((a - c).abs() <= 1e-5 * a.abs().max(1.0), "loss/total {a} on one process, {c} at ZeRO stage 3");
}
