//! `cargo xtask plot RUN_DIR [--out DIR]`: PNG charts of a run's `metrics.jsonl`. Needs no
//! libtorch, so it does not run `setup`.

use std::path::Path;

use anyhow::Context;

pub(crate) fn run(run_dir: &Path, out: Option<&Path>) -> anyhow::Result<()> {
    if !run_dir.is_dir() {
        return Err(rlhf_plot::PlotError::RunDirMissing { path: run_dir.to_owned() }.into());
    }
    let metrics = rlhf_plot::read_metrics(&run_dir.join(rlhf_plot::METRICS_FILE))?;
    for warning in &metrics.warnings {
        eprintln!("warning: {warning}");
    }
    let out_dir = out.map_or_else(|| rlhf_plot::default_out_dir(run_dir), Path::to_owned);
    let written = rlhf_plot::plot_metrics(&metrics, &out_dir)
        .with_context(|| format!("plotting {}", run_dir.join(rlhf_plot::METRICS_FILE).display()))?;
    if written.is_empty() {
        eprintln!("warning: {} has none of the charted metrics; nothing written", run_dir.display());
    }
    for path in written {
        println!("{}", path.display());
    }
    Ok(())
}
