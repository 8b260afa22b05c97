//! `rlhf rm`: reward-model training (DeepSpeed-Chat phase 2).

use rlhf_trainer::rm::{run_rm, RmConfig};

use crate::cmd_sft::{show, PhaseArgs};

/// `rlhf rm`.
pub fn rm(args: PhaseArgs) -> anyhow::Result<()> {
    if crate::launcher::launched(args.nproc)? {
        return Ok(());
    }
    let world = crate::common::world()?;
    let (cfg, resume) = args.load("rm", RmConfig::load, |c| c.run.run_dir.clone(), world.is_main())?;
    let s = run_rm(cfg, &world, resume.as_ref())?;
    if !world.is_main() {
        return Ok(());
    }
    println!(
        "eval accuracy: before {}, after {} ({} eval pairs; {} train pairs, {} steps)",
        show(s.eval_accuracy_before),
        show(s.eval_accuracy_after),
        s.eval_pairs,
        s.train_pairs,
        s.steps
    );
    println!("eval scores: chosen {}, rejected {}", show(s.eval_chosen_score), show(s.eval_rejected_score));
    println!("reward model (*ForSequenceClassification): {}", s.model_dir.display());
    println!("run dir: {}", s.run_dir.display());
    println!("metrics: {}", s.metrics_path.display());
    Ok(())
}
