//! End-to-end: synthetic `metrics.jsonl` files in, PNG files out, checked by decoding them.

use std::{
    fmt::Write as _,
    fs,
    path::{Path, PathBuf},
};

use rlhf_plot::{default_out_dir, plot_metrics, plot_run, read_metrics, PlotError, CHART_SIZE};

const PNG_SIGNATURE: &[u8] = b"\x89PNG\r\n\x1a\n";

/// `n` records with every kind of metric the charts use, in the trainer's format.
fn synthetic_metrics(n: u64) -> String {
    let mut text = String::new();
    for step in 1..=n {
        let t = step as f64 / n as f64;
        let wobble = (step as f64 * 0.7).sin() * 0.05;
        let reward = 0.1 + 0.7 * t + wobble;
        // `loss/value` is 0.0 at step 3: null, NaN and absent values must all be skipped.
        let value_loss = if step == 3 { "NaN".to_owned() } else { format!("{}", 2.0 - t) };
        let kl = if step == 4 { "null".to_owned() } else { format!("{}", 0.5 * t) };
        writeln!(
            text,
            "{{\"step\":{step},\"timestamp\":{ts},\"reward\":{reward},\"reward_std\":0.2,\
             \"rewards/accuracy/mean\":{reward},\"rewards/format/mean\":{fmt},\"kl\":{kl},\
             \"approx_kl\":{akl},\"entropy\":{ent},\"clip_ratio\":{clip},\"loss/policy\":{lp},\
             \"loss/value\":{value_loss},\"loss/total\":{lt},\"completions/mean_length\":{ml},\
             \"completions/max_length\":{xl},\"tokens_per_s\":{tps},\"step_time\":0.5,\
             \"time/generate\":0.3,\"time/score\":0.05,\"time/train\":0.15,\"lr\":0.0005,\
             \"mem/peak_rss_gb\":{mt},\"mem/peak_rss_gb/generate\":2.5,\"mem/peak_rss_gb/train\":{mt}}}",
            ts = 1_700_000_000.0 + step as f64 * 0.5,
            mt = 3.0 + 0.1 * t,
            fmt = 0.5 + wobble,
            akl = 0.01 + wobble.abs() * 0.1,
            ent = 1.5 - t,
            clip = wobble.abs(),
            lp = -0.01 + wobble * 0.1,
            lt = 1.0 - 0.5 * t,
            ml = 20.0 + 10.0 * t,
            xl = 64.0,
            tps = 4000.0 + 1000.0 * t + wobble * 1000.0,
        )
        .unwrap();
    }
    text
}

fn run_dir_with(metrics: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("metrics.jsonl"), metrics).unwrap();
    dir
}

/// Checks that `path` is a PNG of [`CHART_SIZE`], not blank, with text (the title) drawn.
fn check_png(path: &Path) {
    let bytes = fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(bytes.starts_with(PNG_SIGNATURE), "{} is not a PNG", path.display());
    let image = image::load_from_memory_with_format(&bytes, image::ImageFormat::Png).unwrap().to_rgb8();
    assert_eq!(image.dimensions(), CHART_SIZE, "{}", path.display());
    let background = image.get_pixel(0, 0).0;
    assert_eq!(background, [255, 255, 255], "{}", path.display());
    let drawn = image.pixels().filter(|p| p.0 != background).count();
    let total = (CHART_SIZE.0 * CHART_SIZE.1) as usize;
    assert!(drawn > total / 50, "{}: only {drawn} of {total} pixels drawn", path.display());
    // The title, centred at the top: dark glyph pixels there mean the embedded font rendered.
    let title_ink = (0..40)
        .flat_map(|y| (300..700).map(move |x| (x, y)))
        .filter(|&(x, y)| image.get_pixel(x, y).0.iter().all(|&c| c < 100))
        .count();
    assert!(title_ink > 50, "{}: no title text ({title_ink} dark pixels)", path.display());
}

fn names(paths: &[PathBuf]) -> Vec<String> {
    paths.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect()
}

#[test]
fn plots_every_chart_of_a_run_with_a_truncated_last_line() {
    let mut text = synthetic_metrics(120);
    text.push_str("{\"step\":121,\"reward\":0.8,\"kl\":0.4"); // crashed mid-write
    let run = run_dir_with(&text);

    let written = plot_run(run.path(), &default_out_dir(run.path())).unwrap();
    assert_eq!(names(&written), ["reward.png", "kl.png", "loss.png", "lengths.png", "throughput.png", "memory.png"]);
    for path in &written {
        assert_eq!(path.parent().unwrap(), run.path().join("plots"));
        check_png(path);
    }

    let metrics = read_metrics(&run.path().join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.steps.len(), 120);
    assert_eq!(metrics.warnings.len(), 1, "{:?}", metrics.warnings);
    assert!(metrics.warnings[0].contains(":121: skipped truncated last line"), "{}", metrics.warnings[0]);
    assert_eq!(metrics.get("loss/value").unwrap().len(), 119);
    assert_eq!(metrics.get("kl").unwrap().len(), 119);
}

#[test]
fn few_points_and_missing_metrics() {
    // One record with a reward only: just reward.png, a single dot.
    let run = run_dir_with("{\"step\":1,\"reward\":0.25}\n");
    let out = run.path().join("deep/er/out");
    let written = plot_run(run.path(), &out).unwrap();
    assert_eq!(written, [out.join("reward.png")]);
    check_png(&written[0]);

    // A short run without timings or lengths.
    let run = run_dir_with(
        "{\"step\":1,\"kl\":0.1,\"loss/policy\":0.5}\n{\"step\":2,\"kl\":0.2,\"loss/policy\":0.4}\n\
         {\"step\":3,\"entropy\":1.0,\"loss/policy\":0.3}\n",
    );
    let written = plot_run(run.path(), &default_out_dir(run.path())).unwrap();
    assert_eq!(names(&written), ["kl.png", "loss.png"]);
    written.iter().for_each(|p| check_png(p));

    // A supervised run (SFT or RM): its loss, the held-out figures, its throughput.
    let run = run_dir_with(
        "{\"step\":0,\"eval/loss\":2.0,\"eval/ppl\":7.4}\n{\"step\":1,\"loss\":1.9,\"tokens_per_s\":900}\n\
         {\"step\":2,\"loss\":1.5,\"tokens_per_s\":950,\"eval/loss\":1.4,\"eval/ppl\":4.1}\n",
    );
    let written = plot_run(run.path(), &default_out_dir(run.path())).unwrap();
    assert_eq!(names(&written), ["loss.png", "eval.png", "throughput.png"]);
    written.iter().for_each(|p| check_png(p));

    // Nothing to chart: no files, and no empty plots directory either.
    let run = run_dir_with("{\"step\":1,\"lr\":0.1}\n{\"step\":2,\"lr\":0.1}\n");
    assert_eq!(plot_run(run.path(), &default_out_dir(run.path())).unwrap(), Vec::<PathBuf>::new());
    assert!(!run.path().join("plots").exists());
}

#[test]
fn rewriting_plots_replaces_them() {
    let run = run_dir_with(&synthetic_metrics(10));
    let first = plot_run(run.path(), &default_out_dir(run.path())).unwrap();
    fs::write(run.path().join("metrics.jsonl"), synthetic_metrics(60)).unwrap();
    let second = plot_run(run.path(), &default_out_dir(run.path())).unwrap();
    assert_eq!(first, second);
    second.iter().for_each(|p| check_png(p));
}

#[test]
fn errors_are_one_line_and_name_the_path() {
    let tmp = tempfile::tempdir().unwrap();
    let one_line = |err: &PlotError, needle: &Path| {
        let msg = err.to_string();
        assert!(!msg.contains('\n'), "{msg}");
        assert!(msg.contains(&needle.display().to_string()), "{msg} does not name {}", needle.display());
        msg
    };

    let missing = tmp.path().join("no-such-run");
    let err = plot_run(&missing, &missing.join("plots")).unwrap_err();
    assert!(matches!(err, PlotError::RunDirMissing { .. }), "{err}");
    one_line(&err, &missing);

    let empty_run = tmp.path().join("empty-run");
    fs::create_dir(&empty_run).unwrap();
    let err = plot_run(&empty_run, &empty_run.join("plots")).unwrap_err();
    assert!(matches!(err, PlotError::NoMetrics { .. }), "{err}");
    assert!(one_line(&err, &empty_run.join("metrics.jsonl")).starts_with("no metrics file"));

    // A directory where the file should be: reading it fails.
    let odd_run = tmp.path().join("odd-run");
    fs::create_dir_all(odd_run.join("metrics.jsonl")).unwrap();
    let err = plot_run(&odd_run, &odd_run.join("plots")).unwrap_err();
    assert!(matches!(err, PlotError::Read { .. }), "{err}");
    assert!(one_line(&err, &odd_run.join("metrics.jsonl")).starts_with("cannot read"));

    for text in ["", "garbage\n{\"reward\":1}\n", "{\"step\":1,\"rew"] {
        let run = run_dir_with(text);
        let err = plot_run(run.path(), &default_out_dir(run.path())).unwrap_err();
        assert!(matches!(err, PlotError::NoValidLines { .. }), "{text:?}: {err}");
        one_line(&err, &run.path().join("metrics.jsonl"));
    }

    // The output directory cannot be created: a file is in the way.
    let run = run_dir_with(&synthetic_metrics(3));
    let blocked = run.path().join("plots");
    fs::write(&blocked, "").unwrap();
    let metrics = read_metrics(&run.path().join("metrics.jsonl")).unwrap();
    let err = plot_metrics(&metrics, &blocked).unwrap_err();
    assert!(matches!(err, PlotError::CreateOutDir { .. }), "{err}");
    one_line(&err, &blocked);
}
