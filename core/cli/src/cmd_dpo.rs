//! `rlhf dpo`: Direct Preference Optimization (TRL's DPO, cDPO, IPO and SimPO losses) on
//! preference pairs.

use rlhf_trainer::dpo::{run_dpo, DpoConfig};

use crate::cmd_sft::{show, PhaseArgs};

/// `rlhf dpo`.
pub fn dpo(args: PhaseArgs) -> anyhow::Result<()> {
    if crate::launcher::launched(args.nproc)? {
        return Ok(());
    }
    let world = crate::common::world()?;
    let (cfg, resume) = args.load("dpo", DpoConfig::load, |c| c.run.run_dir.clone(), world.is_main())?;
    let s = run_dpo(cfg, &world, resume.as_ref())?;
    if !world.is_main() {
        return Ok(());
    }
    println!(
        "eval preference accuracy (implicit reward): before {}, after {} ({} eval pairs; {} train pairs, {} steps)",
        show(s.eval_accuracy_before),
        show(s.eval_accuracy_after),
        s.eval_pairs,
        s.train_pairs,
        s.steps
    );
    println!(
        "eval log-prob accuracy (policy alone): before {}, after {}",
        show(s.eval_logps_accuracy_before),
        show(s.eval_logps_accuracy_after)
    );
    println!("final model (Hugging Face format): {}", s.model_dir.display());
    println!("run dir: {}", s.run_dir.display());
    println!("metrics: {}", s.metrics_path.display());
    Ok(())
}
