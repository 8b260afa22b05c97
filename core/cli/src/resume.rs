//! Resuming from a checkpoint, shared by `rlhf train` and the supervised phases: where the
//! resumed run writes, and the refusal of a checkpoint written under another configuration.

use std::path::PathBuf;

use rlhf_trainer::config::aliases::{self, Alias};

/// Where a resumed run writes: `--run-dir` when given, else the run that holds the checkpoint
/// (`RUN/checkpoints/step-N`). A checkpoint moved elsewhere needs `--run-dir`, so a resume never
/// writes metrics, models and checkpoints into whatever directory happens to be its grandparent.
pub(crate) fn resumed_run_dir(ckpt: &std::path::Path, run_dir: Option<&std::path::Path>) -> anyhow::Result<PathBuf> {
    if let Some(dir) = run_dir {
        return Ok(dir.to_path_buf());
    }
    let parent = ckpt.parent().filter(|p| p.file_name().is_some_and(|n| n == "checkpoints"));
    match parent.and_then(|p| p.parent()) {
        Some(run) => Ok(if run.as_os_str().is_empty() { PathBuf::from(".") } else { run.to_path_buf() }),
        None => anyhow::bail!(
            "{}: not inside a run's checkpoints/ directory; pass --run-dir DIR to say where the resumed run writes",
            ckpt.display()
        ),
    }
}

/// Whether `key` (`a.b.c`) is one of `allowed`: equal, under a prefix ending in `.`, or
/// matching a pattern whose `*` stands for one key part (an array index).
fn may_differ(key: &str, allowed: &[&str]) -> bool {
    allowed.iter().any(|p| {
        if let Some(prefix) = p.strip_suffix('.') {
            return key == prefix || key.starts_with(p);
        }
        let (pk, kk): (Vec<&str>, Vec<&str>) = (p.split('.').collect(), key.split('.').collect());
        pk.len() == kk.len() && pk.iter().zip(&kk).all(|(a, b)| *a == "*" || a == b)
    })
}

/// Refuses to resume a checkpoint written under a different configuration, naming the keys;
/// keys matching `allowed` may differ (each change is logged). The checkpoint's keys are read
/// under their current names (`aliases`), so a checkpoint written before a rename resumes.
pub(crate) fn check_same_config<T: serde::Serialize>(
    dir: &std::path::Path,
    saved: &str,
    cfg: &T,
    allowed: &[&str],
    aliases: &[Alias],
) -> anyhow::Result<()> {
    let saved: toml::Value =
        toml::from_str(saved).map_err(|e| anyhow::anyhow!("{}: corrupt checkpoint config.toml: {e}", dir.display()))?;
    let now = toml::Value::try_from(cfg)?;
    let (mut a, mut b) = (Vec::new(), Vec::new());
    flatten(&saved, "", &mut a);
    let a: Vec<(String, String)> = a.into_iter().map(|(k, v)| (aliases::canonical(&k, aliases), v)).collect();
    flatten(&now, "", &mut b);
    let a: std::collections::BTreeMap<_, _> = a.into_iter().collect();
    let b: std::collections::BTreeMap<_, _> = b.into_iter().collect();
    let stage = |m: &std::collections::BTreeMap<String, String>| {
        m.get("distributed.zero_stage").cloned().unwrap_or_else(|| "0".into())
    };
    if stage(&a) != stage(&b) {
        tracing::info!(
            "resuming a ZeRO stage {} checkpoint at stage {}: the optimizer state is re-laid out",
            stage(&a),
            stage(&b)
        );
    }
    let mut diffs = Vec::new();
    for key in a.keys().chain(b.keys()).collect::<std::collections::BTreeSet<_>>() {
        let (x, y) = (a.get(key), b.get(key));
        if may_differ(key, allowed) {
            if x != y && !key.starts_with("run.run_dir") {
                let show = |v: Option<&String>| v.cloned().unwrap_or_else(|| "(unset)".into());
                tracing::info!("resume: {key} changed ({} in the checkpoint, {} now)", show(x), show(y));
            }
            continue;
        }
        if x != y {
            let show = |v: Option<&String>| v.cloned().unwrap_or_else(|| "(unset)".into());
            diffs.push(format!("{key} ({} there, {} here)", show(x), show(y)));
        }
    }
    if !diffs.is_empty() {
        let n = diffs.len();
        diffs.truncate(3);
        anyhow::bail!(
            "{}: checkpoint written by another config: {}{}",
            dir.display(),
            diffs.join(", "),
            if n > 3 { format!(" and {} more", n - 3) } else { String::new() }
        );
    }
    Ok(())
}

/// Every leaf of `v` as `(dotted key, value)`; an array of tables (`[[rewards]]`) by index
/// (`rewards.0.config.url`).
fn flatten(v: &toml::Value, prefix: &str, out: &mut Vec<(String, String)>) {
    let key = |k: &str| if prefix.is_empty() { k.to_string() } else { format!("{prefix}.{k}") };
    match v {
        toml::Value::Table(t) => {
            for (k, x) in t {
                flatten(x, &key(k), out);
            }
        }
        toml::Value::Array(items) if !items.is_empty() && items.iter().all(toml::Value::is_table) => {
            for (i, x) in items.iter().enumerate() {
                flatten(x, &key(&i.to_string()), out);
            }
        }
        other => out.push((prefix.to_string(), other.to_string())),
    }
}
