//! Qwen2.5-VL against transformers on a tiny random checkpoint made at test time
//! (`fixtures/make_vl.py`): a left-padded batch of a prompt with one image, one with two and one
//! of text alone — the patches of our processor equal to transformers' processor's, the logits
//! within the families' tolerance, greedy tokens through the cache (3-D positions in the prompt,
//! each row's delta after it) equal; in each layout a checkpoint comes in (transformers 5's nested
//! config, the Hub's flat one, the tensors under `model.layers.*` + `visual.*` as both save them or
//! under transformers 5's module names `model.language_model.*` + `model.visual.*`); a save keeps
//! the names it loaded and reloads to the same logits bit for bit. Gradients through the tower equal
//! transformers' in plain and checkpointed backward passes.

use std::collections::HashMap;
use std::path::Path;

use rlhf_integration_tests::{grads_after as grads, logit_diff, python, token_loss};
use rlhf_models::multimodal::Slots;
use rlhf_models::{CausalLm, Images};
use rlhf_vision::{load_path, QwenVlProcessor};
use tch::{Device, Kind, Tensor};

/// The families' tolerance (transformers' own f32 logits are within 3e-7 of its f64 ones here).
const TOL: f64 = 1e-4;

/// The fixture, made once per test process.
fn fixture() -> &'static Path {
    rlhf_integration_tests::vl_fixture()
}

fn reference(dir: &Path) -> HashMap<String, Tensor> {
    Tensor::read_safetensors(dir.join("reference.safetensors")).unwrap().into_iter().collect()
}

/// Our processor's patches for each row's images, in order.
fn images(dir: &Path) -> Images {
    let rows: Vec<Vec<String>> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("rows.json")).unwrap()).unwrap();
    let processor = QwenVlProcessor::default();
    let (mut values, mut grids) = (Vec::new(), Vec::new());
    for name in rows.iter().flatten() {
        let p = processor.preprocess(&load_path(&dir.join("images").join(name)).unwrap(), name).unwrap();
        values.push(Tensor::from_slice(&p.values).view([p.len() as i64, p.dim as i64]));
        grids.push(p.grid.map(|g| g as i64));
    }
    Images::new(Tensor::cat(&values, 0), grids)
}

/// Greedy decoding through the cache: the prompt with its images and 3-D positions, then each
/// token at its plain position plus the row's delta.
fn greedy(m: &CausalLm, ids: &Tensor, mask: &Tensor, images: &Images, steps: i64) -> Tensor {
    let (b, width) = (ids.size()[0], ids.size()[1]);
    let mut cache = m.new_cache(b, width + steps).unwrap();
    let (pos, deltas) = m.image_positions(ids, mask, &images.grids, &Slots::prompt(width)).unwrap();
    let visual = m.visual(images, Slots::prompt(width)).unwrap();
    let h = m.hidden_states_with_images(ids, mask, &pos, &visual, Some(&mut cache)).unwrap();
    let mut next = m.logits_from_hidden(&h.select(1, width - 1)).unwrap().argmax(-1, false).unsqueeze(-1);
    let (mut mask, mut out) = (mask.shallow_clone(), vec![next.shallow_clone()]);
    for _ in 1..steps {
        mask = Tensor::cat(&[&mask, &Tensor::ones([b, 1], (Kind::Int64, Device::Cpu))], 1);
        let plain = mask.sum_dim_intlist(-1, true, Kind::Int64) - 1; // [b, 1]
        let pos = rlhf_models::multimodal::shifted_positions(&plain, &deltas).unwrap();
        let h = m.hidden_states(&next, &mask, &pos, Some(&mut cache)).unwrap();
        next = m.logits_from_hidden(&h.select(1, 0)).unwrap().argmax(-1, false).unsqueeze(-1);
        out.push(next.shallow_clone());
    }
    Tensor::cat(&out, 1)
}

fn tensor_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        Tensor::read_safetensors(dir.join("model.safetensors")).unwrap().into_iter().map(|(n, _)| n).collect();
    names.sort();
    names
}

#[test]
fn qwen2_5_vl_matches_transformers_with_images() {
    if python().is_none() {
        return;
    }
    let dir = fixture();
    let r = reference(dir);
    let imgs = images(dir);
    let grids: Vec<Vec<i64>> = Vec::try_from(&r["image_grid_thw"]).unwrap();
    assert_eq!(imgs.grids.iter().map(|g| g.to_vec()).collect::<Vec<_>>(), grids, "grids");
    let diff = (&imgs.pixel_values - &r["pixel_values"]).abs().max().double_value(&[]);
    assert_eq!(diff, 0.0, "processor patches differ from transformers'");
    let (ids, mask) = (&r["input_ids"], &r["attention_mask"]);
    for layout in ["model", "hub", "new-names"] {
        let src = dir.join(layout);
        let m = CausalLm::from_dir(&src, Device::Cpu, Kind::Float).unwrap();
        assert!(m.vision().is_some(), "{layout}: the tower is read");
        let logits = tch::no_grad(|| m.forward_with_images(ids, mask, &imgs)).unwrap();
        let diff = logit_diff(&logits, &r["logits"], mask);
        println!("{layout}: max |Δlogit| = {diff:.2e}");
        assert!(diff < TOL, "{layout}: logits differ by {diff}");
        let tokens = tch::no_grad(|| greedy(&m, ids, mask, &imgs, 8));
        assert_eq!(
            Vec::<Vec<i64>>::try_from(&tokens).unwrap(),
            Vec::<Vec<i64>>::try_from(&r["greedy"]).unwrap(),
            "{layout}: greedy tokens"
        );
        // Save → reload: the same names as loaded, the same logits bit for bit.
        let saved = dir.join(format!("{layout}-saved"));
        m.save(&saved).unwrap();
        assert_eq!(tensor_names(&saved), tensor_names(&src), "{layout}: saved tensor names");
        let again = CausalLm::from_dir(&saved, Device::Cpu, Kind::Float).unwrap();
        let logits2 = tch::no_grad(|| again.forward_with_images(ids, mask, &imgs)).unwrap();
        assert!(logits2.equal(&logits), "{layout}: the reloaded save computes other logits");
    }
}

/// Gradients through the language model, the image features' placement and the whole vision
/// tower (windows, the full-attention block, the merger) equal transformers', in a plain and a
/// checkpointed backward.
#[test]
fn qwen2_5_vl_gradients_match_transformers() {
    if python().is_none() {
        return;
    }
    let dir = fixture();
    let r = reference(dir);
    let imgs = images(dir);
    let (ids, mask, targets) = (&r["input_ids"], &r["attention_mask"], &r["targets"]);
    let m = CausalLm::from_dir(&dir.join("model"), Device::Cpu, Kind::Float).unwrap();
    assert!(m.set_vision_trainable(true) > 0);
    let names: Vec<String> = r
        .keys()
        .filter_map(|k| k.strip_prefix("grad."))
        .map(String::from)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    assert_eq!(names.len(), 7);
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
    for ((name, a), b) in names.iter().zip(&plain).zip(&checkpointed) {
        let want = &r[&format!("grad.{name}")];
        let largest = want.abs().max().double_value(&[]);
        let scale = largest.max(1.0);
        let (d_plain, d_ck) = ((a - want).abs().max().double_value(&[]), (b - want).abs().max().double_value(&[]));
        println!("{name}: max |grad| {largest:.2e}, |Δ| plain {d_plain:.2e}, checkpointed {d_ck:.2e}");
        assert!(d_plain < 1e-5 * scale && d_ck < 1e-5 * scale, "{name}: gradients differ ({d_plain}, {d_ck})");
    }
    // Frozen, the tower takes no gradient and the language model's are unchanged.
    m.set_vision_trainable(false);
    let frozen = grads(&m.vs, &names, || {
        token_loss(&m.forward_with_images(ids, mask, &imgs).unwrap(), targets, mask).backward()
    });
    for ((name, a), b) in names.iter().zip(&plain).zip(&frozen) {
        if name.contains("visual") {
            assert!(!b.defined() || b.abs().max().double_value(&[]) == 0.0, "{name}: a frozen tower took a gradient");
        } else {
            assert!(a.equal(b), "{name}: freezing the tower changed the language model's gradient");
        }
    }
}

/// The rollout engine's generation with images: the same greedy tokens as transformers' `generate`,
/// also with each prompt repeated (`prefill_group` 2: each run's images through the tower once).
#[test]
fn qwen2_5_vl_generates_with_images() {
    if python().is_none() {
        return;
    }
    let dir = fixture();
    let r = reference(dir);
    let imgs = images(dir);
    let (ids, mask) = (&r["input_ids"], &r["attention_mask"]);
    let m = CausalLm::from_dir(&dir.join("model"), Device::Cpu, Kind::Float).unwrap();
    let cfg = rlhf_generation::GenerateConfig::greedy(8, vec![], 0);
    let out = rlhf_generation::generate_with_images(&m, ids, mask, &imgs, &cfg).unwrap();
    let want = Vec::<Vec<i64>>::try_from(&r["greedy"]).unwrap();
    assert_eq!(Vec::<Vec<i64>>::try_from(&out.responses().unwrap()).unwrap(), want, "greedy tokens");
    // Each prompt twice, with its images: rows 0 and 1 hold image 0, rows 2 and 3 images 1 and 2.
    let rows = m.images_per_row(ids, &imgs).unwrap();
    assert_eq!(rows, vec![0..1, 1..3, 3..3]);
    let twice = imgs.select(&[0, 0, 1, 2, 1, 2]).unwrap();
    let cfg = rlhf_generation::GenerateConfig { prefill_group: 2, ..cfg };
    let (ids2, mask2) = (ids.repeat_interleave_self_int(2, 0, None), mask.repeat_interleave_self_int(2, 0, None));
    let out = rlhf_generation::generate_with_images(&m, &ids2, &mask2, &twice, &cfg).unwrap();
    let want2: Vec<Vec<i64>> = want.iter().flat_map(|r| [r.clone(), r.clone()]).collect();
    assert_eq!(Vec::<Vec<i64>>::try_from(&out.responses().unwrap()).unwrap(), want2, "grouped greedy tokens");
    // Sampled, the trainer's log-probs of the sampled tokens (the whole sequences with their
    // images, at multimodal positions) equal generation's own.
    let sample = rlhf_generation::GenerateConfig {
        sampling: rlhf_generation::Sampling::Sample { temperature: 1.0, top_k: None, top_p: None },
        logprobs: true,
        seed: Some(3),
        prefill_group: 1,
        ..cfg.clone()
    };
    let out = rlhf_generation::generate_with_images(&m, ids, mask, &imgs, &sample).unwrap();
    let opts = rlhf_generation::LogProbOptions::default();
    let lp = tch::no_grad(|| {
        rlhf_generation::token_logprobs_with_images(
            &m,
            &out.sequences,
            &out.attention_mask,
            rlhf_generation::ImageInputs::prompt(&imgs, out.prompt_len),
            out.prompt_len,
            opts,
        )
    })
    .unwrap();
    let live = out.response_mask.to_kind(Kind::Float);
    let diff = ((&lp.logprobs - out.logprobs.as_ref().unwrap()) * &live).abs().max().double_value(&[]);
    println!("sampled tokens: max |Δlogprob| trainer vs generation = {diff:.2e}");
    assert!(diff < 1e-5, "log-probs differ by {diff}");
    // Placeholders and images that do not match are one-line errors naming the row.
    let cfg = rlhf_generation::GenerateConfig { prefill_group: 1, ..cfg };
    let e = rlhf_generation::generate_with_images(&m, ids, mask, &imgs.select(&[0]).unwrap(), &cfg)
        .unwrap_err()
        .to_string();
    assert!(e.contains("row 1: more image placeholders than images") && !e.contains('\n'), "{e}");
}

/// Prompt rows with images — verl's `<image>` markers with relative paths, TRL's chat messages with
/// image parts and `{bytes, path}` structs, and verl's Parquet layout with the images' bytes —
/// tokenize to the ids transformers' `Qwen2_5_VLProcessor` makes from the same rows (its chat
/// template rendering the image parts, one `<|image_pad|>` per merged patch); bad rows are one-line
/// errors naming the prompt.
#[test]
fn prompt_rows_with_images_tokenize_as_transformers_processor() {
    use rlhf_trainer::config::DataConfig;
    use rlhf_trainer::data::{read_prompt_data, PromptDataset};
    use rlhf_trainer::prompt_images::PromptImages;
    if python().is_none() {
        return;
    }
    let dir = fixture();
    let model_dir = dir.join("model");
    let tok = rlhf_tokenizer::HfTokenizer::from_dir(&model_dir).unwrap();
    let arch = rlhf_models::ModelConfig::from_dir(&model_dir).unwrap().arch;
    let images = PromptImages::for_model(&model_dir, &arch, &tok).unwrap().expect("the model reads images");
    let want: Vec<Vec<u32>> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("prompt_ids.json")).unwrap()).unwrap();
    for file in ["prompts.jsonl", "prompts.parquet"] {
        let cfg = DataConfig {
            prompts: dir.join(file).display().to_string(),
            max_prompt_len: 512,
            apply_chat_template: true,
            ..DataConfig::default()
        };
        let raw = read_prompt_data(&cfg).unwrap();
        let ds = PromptDataset::new_with_images(raw, &tok, &cfg, 0, Some(&images)).unwrap();
        let ids: Vec<Vec<u32>> = ds.records.iter().map(|r| r.ids.clone()).collect();
        assert_eq!(ids, want, "{file}: prompt ids");
        let grids: Vec<Vec<[usize; 3]>> = ds.records.iter().map(|r| r.grids.clone()).collect();
        assert_eq!(grids, vec![vec![[1, 6, 8]], vec![[1, 4, 10], [1, 4, 4]], vec![]], "{file}: grids");
        // The rewards see the images' names: paths, or the row and index of bytes.
        let names = &ds.records[1].metadata["images"];
        let first = if file.ends_with(".jsonl") {
            dir.join("images/b.png").display().to_string()
        } else {
            "prompt 2 image 0".into()
        };
        assert_eq!(names[0], serde_json::Value::from(first), "{file}: image names");
        // Text prompts only: a row with images is refused by number.
        let raw = read_prompt_data(&cfg).unwrap();
        let e = PromptDataset::new(raw, &tok, &cfg, 0).unwrap_err().to_string();
        assert!(e.starts_with("prompt 1: has 1 image(s), which this run does not read"), "{e}");
    }
    // Bad rows: a missing file, a corrupt one, markers that do not match the images, a prompt too
    // long to keep its images.
    let bad = tempfile::tempdir().unwrap();
    std::fs::write(bad.path().join("corrupt.png"), b"\x89PNG\r\n\x1a\nnope").unwrap();
    let a = dir.join("images/a.png").display().to_string();
    for (row, max_len, needle) in [
        (serde_json::json!({"prompt": "<image>x", "images": ["missing.png"]}), 512, "missing.png"),
        (
            serde_json::json!({"prompt": "<image>x", "images": ["corrupt.png"]}),
            512,
            "corrupt.png: not a decodable image",
        ),
        (
            serde_json::json!({"prompt": "<image><image>x", "images": [a]}),
            512,
            "prompt 1: 2 <image> placeholder(s) for 1 image(s)",
        ),
        (
            serde_json::json!({"prompt": "<image>x", "images": [a]}),
            20,
            "prompt 1: 47 tokens with its images, more than data.max_prompt_len = 20",
        ),
        (serde_json::json!({"prompt": "x", "images": "a.png"}), 512, "line 1: images: expected a list of images"),
        (
            serde_json::json!({"messages": [{"role": "user", "content": [{"type": "image"}]}]}),
            512,
            "line 1: messages[0].content: an image part, and the row has no `images`",
        ),
    ] {
        let file = bad.path().join("p.jsonl");
        std::fs::write(&file, format!("{row}\n")).unwrap();
        let cfg = DataConfig {
            prompts: file.display().to_string(),
            max_prompt_len: max_len,
            apply_chat_template: true,
            ..DataConfig::default()
        };
        let e = read_prompt_data(&cfg)
            .and_then(|raw| PromptDataset::new_with_images(raw, &tok, &cfg, 0, Some(&images)))
            .unwrap_err()
            .to_string();
        assert!(e.contains(needle) && !e.contains('\n'), "{needle}: {e}");
    }
}

/// `rlhf generate` with an image: the prompt's `<image>` marker takes the `--image` file, and the
/// greedy continuation is transformers' `generate` on its processor's ids.
#[test]
fn cli_generates_with_an_image() {
    if python().is_none() {
        return;
    }
    let dir = fixture();
    let want: Vec<u32> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("prompt_greedy.json")).unwrap()).unwrap();
    let image = dir.join("images/a.png");
    let model = dir.join("model");
    let args = ["generate", "--model", model.to_str().unwrap(), "--chat", "--json", "--max-new-tokens", "6"];
    let out = rlhf_integration_tests::rlhf(
        &[&args[..], &["--prompt", "<image>What colour is it?", "--image", image.to_str().unwrap()]].concat(),
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let line: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ids: Vec<u32> = serde_json::from_value(line["response_ids"].clone()).unwrap();
    assert_eq!(ids, want, "response ids");
    // The prompt as transformers' processor makes it: the image's placeholders expanded.
    let prompts: Vec<Vec<u32>> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("prompt_ids.json")).unwrap()).unwrap();
    let prompt: Vec<u32> = serde_json::from_value(line["prompt_ids"].clone()).unwrap();
    assert_eq!(prompt, prompts[0], "prompt ids");
    // Markers and images must match.
    let out = rlhf_integration_tests::rlhf(
        &[&args[..], &["--prompt", "<image><image>x", "--image", image.to_str().unwrap()]].concat(),
    );
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && e.contains("--prompt 1: 2 <image> placeholder(s) for 1 image(s)"), "{e}");
}

/// `rlhf ppl` on lines with images: the features in place of the placeholders at the multimodal
/// positions, the placeholders not predicted — the mean NLL of the forward checked above over the
/// same ids; a missing image file or a model that reads no images is a one-line error.
#[test]
fn cli_perplexity_reads_images() {
    use rlhf_trainer::prompt_images::PromptImages;
    if python().is_none() {
        return;
    }
    let dir = fixture();
    let tmp = tempfile::tempdir().unwrap();
    let (model, image) = (dir.join("model"), dir.join("images/a.png"));
    let text = "<image>What colour is it? Red.";
    let write = |name: &str, image: &Path| {
        let path = tmp.path().join(name);
        let line = serde_json::json!({"text": text, "images": [image.display().to_string()]});
        std::fs::write(&path, format!("{line}\n")).unwrap();
        path
    };
    let data = write("ppl.jsonl", &image);
    let ppl = |data: &Path, model: &Path| {
        rlhf_integration_tests::rlhf(&[
            "ppl",
            "--model",
            model.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--json",
        ])
    };
    let out = ppl(&data, &model);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let got: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap()).unwrap();
    // The same line through the model's forward with its image.
    let m = CausalLm::from_dir(&model, Device::Cpu, Kind::Float).unwrap();
    let tok = rlhf_tokenizer::HfTokenizer::from_dir(&model).unwrap();
    let arch = rlhf_models::ModelConfig::from_dir(&model).unwrap().arch;
    let v = PromptImages::for_model(&model, &arch, &tok).unwrap().unwrap();
    let refs = vec![rlhf_vision::ImageRef::Path(image.clone())];
    let ids: Vec<i64> = v.expand(text, &tok, true, &refs, "line").unwrap().1.into_iter().map(i64::from).collect();
    let ids = Tensor::from_slice(&ids).view([1, -1]);
    let n = ids.size()[1];
    let mask = Tensor::ones([1, n], (Kind::Int64, Device::Cpu));
    let logits = tch::no_grad(|| m.forward_with_images(&ids, &mask, &v.patches(&refs).unwrap())).unwrap();
    let targets = ids.narrow(1, 1, n - 1);
    let logp = logits.narrow(1, 0, n - 1).log_softmax(-1, Kind::Double).gather(-1, &targets.unsqueeze(-1), false);
    let text_targets = targets.ne(m.vision().unwrap().config().image_token_id).to_kind(Kind::Double);
    let tokens = text_targets.sum(Kind::Double).double_value(&[]);
    let nll = -(logp.squeeze_dim(-1) * &text_targets).sum(Kind::Double).double_value(&[]) / tokens;
    assert_eq!(got["tokens"].as_f64(), Some(tokens), "{got}");
    assert!((got["nll"].as_f64().unwrap() - nll).abs() < 1e-6, "{got} vs nll {nll}");
    // Bad input: a missing image, a model that reads none.
    let out = ppl(&write("missing.jsonl", &tmp.path().join("nope.png")), &model);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && e.contains("nope.png") && e.trim().lines().count() == 1, "{e}");
    let out = ppl(&data, &rlhf_integration_tests::model_dir("llama"));
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && e.contains("lines hold images") && e.trim().lines().count() == 1, "{e}");
}
