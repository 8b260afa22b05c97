//! `rlhf dpo`: the loss against an independent reference and the command end to end.
//!
//! - [`dpo_loss`] and its gradient w.r.t. the four log-prob inputs, on a fixed batch, equal TRL's
//!   formulas (`DPOTrainer.dpo_loss` for `sigmoid` with and without label smoothing and `ipo`,
//!   `CPOTrainer.cpo_loss` for `simpo`) written out in torch by `hf_check.py dpo-loss`, within 1e-5.
//! - `rlhf dpo` on the built-in pairs raises held-out preference accuracy, writes TRL's metric
//!   names, a `summary.json` and a model that loads (in transformers too, with the same logits).
//! - The reference modes agree: a frozen copy, precomputed log-probs, LoRA's adapters switched off.

use std::path::Path;
use std::process::Output;

use rlhf_integration_tests::{hf_check, metrics, python, read_json, rlhf};
use rlhf_models::CausalLm;
use rlhf_trainer::dpo::{dpo_loss, DpoLossParams, DpoLossType};
use tch::{Device, Kind, Tensor};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn ok(o: &Output) -> String {
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "rlhf failed:\n{}\n{err}", String::from_utf8_lossy(&o.stdout));
    String::from_utf8_lossy(&o.stdout).to_string()
}

fn floats(v: &serde_json::Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

fn max_diff(ours: &[f64], theirs: &[f64]) -> f64 {
    assert_eq!(ours.len(), theirs.len());
    ours.iter().zip(theirs).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max)
}

fn to_f64(t: &Tensor) -> Vec<f64> {
    Vec::<f64>::try_from(&t.to_kind(Kind::Double)).unwrap()
}

#[test]
fn dpo_losses_and_gradients_match_trl() {
    let Some(py) = python() else { return };
    // Summed response log-probs of a policy and a reference, and response lengths: margins of both
    // signs, a pair the policy already prefers strongly, unequal lengths.
    let chosen = [-5.25f32, -3.0, -12.5, -0.75, -20.0];
    let rejected = [-6.5f32, -2.25, -30.0, -1.5, -19.0];
    let ref_chosen = [-5.5f32, -3.5, -14.0, -1.0, -21.5];
    let ref_rejected = [-5.0f32, -2.5, -25.0, -1.25, -18.0];
    let chosen_lens = [2f32, 3.0, 8.0, 1.0, 11.0];
    let rejected_lens = [4f32, 1.0, 12.0, 2.0, 9.0];
    let inputs = serde_json::json!({
        "chosen_logps": chosen, "rejected_logps": rejected,
        "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected,
        "chosen_lens": chosen_lens, "rejected_lens": rejected_lens,
    })
    .to_string();
    let cases = [
        (DpoLossType::Sigmoid, "sigmoid", 0.1, 0.0, 0.5),
        (DpoLossType::Sigmoid, "sigmoid", 0.5, 0.1, 0.5),
        (DpoLossType::Ipo, "ipo", 0.1, 0.0, 0.5),
        (DpoLossType::Ipo, "ipo", 0.5, 0.0, 0.5),
        (DpoLossType::Simpo, "simpo", 2.0, 0.0, 1.0),
        (DpoLossType::Simpo, "simpo", 2.5, 0.15, 0.8),
    ];
    let names = ["chosen_logps", "rejected_logps", "ref_chosen_logps", "ref_rejected_logps"];
    for (loss_type, name, beta, eps, gamma) in cases {
        let p = DpoLossParams { loss_type, beta, label_smoothing: eps, simpo_gamma: gamma };
        let leaf = |v: &[f32]| Tensor::from_slice(v).set_requires_grad(true);
        let xs = [leaf(&chosen), leaf(&rejected), leaf(&ref_chosen), leaf(&ref_rejected)];
        let (lc, lr) = (Tensor::from_slice(&chosen_lens), Tensor::from_slice(&rejected_lens));
        let out = dpo_loss(&p, &xs[0], &xs[1], Some((&xs[2], &xs[3])), &lc, &lr).unwrap();
        let loss = out.losses.mean(Kind::Float);
        loss.backward();

        let args = [
            "dpo-loss".to_string(),
            "--loss-type".into(),
            name.into(),
            "--beta".into(),
            beta.to_string(),
            "--label-smoothing".into(),
            eps.to_string(),
            "--simpo-gamma".into(),
            gamma.to_string(),
            "--inputs".into(),
            inputs.clone(),
        ];
        let r = hf_check(&py, &args.iter().map(String::as_str).collect::<Vec<_>>());
        let mut worst_loss = (loss.double_value(&[]) - r["loss"].as_f64().unwrap()).abs();
        worst_loss = worst_loss.max(max_diff(&to_f64(&out.losses), &floats(&r["losses"])));
        let worst_reward = max_diff(&to_f64(&out.chosen_rewards), &floats(&r["chosen_rewards"]))
            .max(max_diff(&to_f64(&out.rejected_rewards), &floats(&r["rejected_rewards"])));
        let mut worst_grad = 0f64;
        for (x, n) in xs.iter().zip(names) {
            let g = x.grad();
            let ours = if g.defined() { to_f64(&g) } else { vec![0.0; chosen.len()] };
            worst_grad = worst_grad.max(max_diff(&ours, &floats(&r["grads"][n])));
        }
        println!(
            "{name} beta {beta} eps {eps} gamma {gamma}: loss {:.6} vs TRL {:.6}; max |Δ| loss {worst_loss:.2e}, \
             reward {worst_reward:.2e}, gradient {worst_grad:.2e}",
            loss.double_value(&[]),
            r["loss"].as_f64().unwrap()
        );
        assert!(worst_loss <= 1e-5 && worst_reward <= 1e-5 && worst_grad <= 1e-5, "{name}: {r}");
    }
}

#[test]
fn dpo_raises_held_out_preference_accuracy_and_writes_a_loadable_model() {
    let tmp = tempfile::tempdir().unwrap();
    let rd = tmp.path().join("dpo");
    let t0 = std::time::Instant::now();
    let out = ok(&rlhf(&["dpo", "--run-dir", s(&rd), "--no-progress", "--set", "train.epochs=1"]));
    let summary = read_json(&rd.join("summary.json"));
    let get = |k: &str| summary[k].as_f64().unwrap_or_else(|| panic!("{k} in {summary}"));
    let (before, after) = (get("eval_accuracy_before"), get("eval_accuracy_after"));
    let (lp_before, lp_after) = (get("eval_logps_accuracy_before"), get("eval_logps_accuracy_after"));
    println!(
        "rlhf dpo (1 epoch, {} steps, {:.1}s): eval accuracy {before:.3} -> {after:.3}, policy log-prob accuracy \
         {lp_before:.3} -> {lp_after:.3}",
        summary["steps"],
        t0.elapsed().as_secs_f64()
    );
    assert!(out.contains("eval preference accuracy"), "{out}");
    assert_eq!(before, 0.0, "policy == reference: every implicit reward is 0");
    assert!(after >= 0.6 && after > before, "{before} -> {after}");
    assert!(lp_after > lp_before + 0.1, "the policy itself prefers chosen: {lp_before} -> {lp_after}");
    assert!(get("loss_last") < get("loss_first"));

    let lines = metrics(&rd);
    let step1 = &lines[1];
    for key in [
        "loss",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    ] {
        assert!(step1[key].is_number(), "{key} missing from {step1}");
    }
    assert!((step1["loss"].as_f64().unwrap() - std::f64::consts::LN_2).abs() < 1e-6, "first DPO loss is ln 2");
    let last = lines.last().unwrap();
    for key in ["eval/accuracy", "eval/loss", "eval/rewards/margins", "eval/logps_accuracy"] {
        assert!(last[key].is_number(), "{key} missing from {last}");
    }

    let saved = rd.join("model");
    let model = CausalLm::from_dir(&saved, Device::Cpu, Kind::Float).unwrap();
    let x = Tensor::from_slice(&[6i64, 13, 7, 14, 10, 1]).view([1, -1]);
    let ours = tch::no_grad(|| model.forward(&x, &x.ones_like())).unwrap().squeeze_dim(0);
    let start = CausalLm::from_dir(&rd.join("builtin-model"), Device::Cpu, Kind::Float).unwrap();
    let orig = tch::no_grad(|| start.forward(&x, &x.ones_like())).unwrap().squeeze_dim(0);
    assert!((&ours - &orig).abs().max().double_value(&[]) > 1e-3, "training changed the weights");
    let Some(py) = python() else { return };
    let theirs = hf_check(&py, &["logits", "--model", s(&saved), "--ids", "6,13,7,14,10,1"]);
    let rows: Vec<Vec<f32>> = serde_json::from_value(theirs["logits"].clone()).unwrap();
    let theirs = Tensor::from_slice(&rows.concat()).view([rows.len() as i64, -1]);
    let diff = (&ours - &theirs).abs().max().double_value(&[]);
    println!("DPO checkpoint in transformers: max |Δlogit| = {diff:.2e}");
    assert!(diff <= 1e-4, "{diff}");
}

/// `train.padding_free` trains as the padded passes within float rounding (a frozen reference and
/// precomputed log-probs, both packed), on pairs whose rejected answers run from 1 to 12 words,
/// with each pair's prompt laid once (`train.share_prompts`, the default) and with the rows packed
/// whole — and the passes did run packed (the debug log's candidates: fewer packed rows than the
/// batch's), the shared prompts in rows wider than the batch's (a prompt and both its answers).
#[test]
fn padding_free_passes_train_as_padded_ones() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("pairs.jsonl");
    let lines: Vec<String> = (0..64)
        .map(|i| {
            let (a, b) = (i % 8, i / 8);
            let rambling = vec!["no"; 1 + i % 12].join(" ");
            serde_json::json!({"prompt": format!("{a} + {b} ="), "chosen": format!(" {}", a + b), "rejected": format!(" {rambling}")})
                .to_string()
        })
        .collect();
    std::fs::write(&data, lines.join("\n")).unwrap();
    let train = format!("data.train={:?}", s(&data));
    let run = |name: &str, sets: &[&str]| {
        let rd = tmp.path().join(name);
        let mut args = vec!["dpo", "--run-dir", s(&rd), "--no-progress", "--set", "train.steps=4", "--set", &train];
        for set in sets {
            args.extend(["--set", set]);
        }
        let out = std::process::Command::new(rlhf_integration_tests::rlhf_bin())
            .args(&args)
            .env("RUST_LOG", "rlhf_generation=debug")
            .output()
            .unwrap();
        ok(&out);
        let log = String::from_utf8_lossy(&out.stderr).to_string();
        // "log-prob pass of 8 rows × 9: packed Some(3 rows × 14), …": (batch width, packed width).
        let widths: Vec<(i64, i64)> = log
            .lines()
            .filter_map(|l| {
                let rest = &l[l.find("log-prob pass of")?..];
                let seq = rest.split(" × ").nth(1)?.split(':').next()?.parse().ok()?;
                let width = rest.split("packed Some(").nth(1)?.split(" × ").nth(1)?.split(')').next()?.parse().ok()?;
                Some((seq, width))
            })
            .collect();
        (metrics(&rd), widths)
    };
    for reference in ["model.reference=\"policy\"", "model.reference=\"precomputed\""] {
        let name = if reference.contains("policy") { "policy" } else { "precomputed" };
        let (a, _) = run(&format!("{name}-padded"), &[reference]);
        let whole = ["train.padding_free=true", "train.share_prompts=false"];
        for (how, sets) in [("shared", &whole[..1]), ("whole", &whole[..])] {
            let (b, widths) = run(&format!("{name}-{how}"), &[&[reference][..], sets].concat());
            assert!(!widths.is_empty(), "{reference}, {how}: no pass ran packed");
            let wider = widths.iter().any(|(seq, width)| width > seq);
            assert_eq!(wider, how == "shared", "{reference}, {how}: (batch, packed) widths {widths:?}");
            assert_eq!(a.len(), b.len());
            let mut compared = 0;
            for (x, y) in a.iter().zip(&b) {
                for key in ["loss", "rewards/margins", "logps/chosen", "logps/rejected", "eval/loss"] {
                    if let (Some(x), Some(y)) = (x[key].as_f64(), y[key].as_f64()) {
                        let tol = 1e-4 * x.abs().max(1.0);
                        assert!((x - y).abs() <= tol, "{reference}, {how}: {key}: padded {x}, packed {y}");
                        compared += 1;
                    }
                }
            }
            assert!(compared >= 12, "{reference}, {how}: {compared} figures compared");
        }
    }
}

/// Every reference mode gives the same training: a frozen copy and precomputed log-probs; with
/// LoRA, the policy with its adapters switched off and precomputed log-probs.
#[test]
fn reference_modes_train_alike() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |name: &str, reference: &str, rank: i64| {
        let rd = tmp.path().join(name);
        let (set, lora) = (format!("model.reference={reference:?}"), format!("model.lora.rank={rank}"));
        let o = rlhf(&[
            "dpo",
            "--run-dir",
            s(&rd),
            "--no-progress",
            "--set",
            &set,
            "--set",
            &lora,
            "--set",
            "train.steps=4",
        ]);
        ok(&o);
        (metrics(&rd), String::from_utf8_lossy(&o.stderr).to_string())
    };
    for (rank, what) in [(0, "frozen copy"), (4, "LoRA adapters off")] {
        let ((a, log), (b, _)) =
            (run(&format!("policy-{rank}"), "policy", rank), run(&format!("pre-{rank}"), "precomputed", rank));
        if rank > 0 {
            assert!(log.contains("reference the policy with LoRA adapters off"), "{log}");
        }
        assert_eq!(a.len(), b.len());
        let mut compared = 0;
        for (x, y) in a.iter().zip(&b).skip(1) {
            for key in ["loss", "rewards/margins", "eval/accuracy"] {
                if let (Some(x), Some(y)) = (x[key].as_f64(), y[key].as_f64()) {
                    assert!((x - y).abs() < 1e-4, "{key}: {what} {x}, precomputed {y}");
                    compared += 1;
                }
            }
        }
        assert!(compared >= 8, "{compared}");
        let margin = a.last().unwrap()["rewards/margins"].as_f64().unwrap();
        assert!(margin.abs() > 1e-6, "{what}: the policy moved away from the reference: margin {margin}");
    }
}
