//! Progress bars (indicatif) for the run: one bar over steps and one for the phase in flight
//! (rollout, scoring, optimisation). Hidden when stderr is not a terminal or with `--no-progress`;
//! log lines go through [`LogWriter`] so they print above the bars instead of through them.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

static BARS: OnceLock<MultiProgress> = OnceLock::new();
static ENABLED: AtomicBool = AtomicBool::new(true);

/// Turns the bars off (`--no-progress`); they are also off when stderr is not a terminal.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

fn enabled() -> bool {
    use std::io::IsTerminal;
    ENABLED.load(Ordering::Relaxed) && std::io::stderr().is_terminal()
}

fn bars() -> &'static MultiProgress {
    BARS.get_or_init(|| {
        if enabled() {
            MultiProgress::with_draw_target(ProgressDrawTarget::stderr())
        } else {
            MultiProgress::with_draw_target(ProgressDrawTarget::hidden())
        }
    })
}

/// The bars of one run.
pub struct RunProgress {
    steps: ProgressBar,
    phase: ProgressBar,
}

impl RunProgress {
    /// A step bar at `done` of `total`.
    pub fn new(total: u64, done: u64, unit: &str) -> Self {
        let style = ProgressStyle::with_template(&format!(
            "{{bar:30.cyan/blue}} {unit} {{pos}}/{{len}} [{{elapsed_precise}}<{{eta_precise}}] {{msg}}"
        ))
        .unwrap_or_else(|_| ProgressStyle::default_bar());
        let steps = bars().add(ProgressBar::new(total).with_style(style));
        steps.set_position(done);
        let phase_style = ProgressStyle::with_template("  {prefix:>9} {bar:30.green/white} {pos}/{len}")
            .unwrap_or_else(|_| ProgressStyle::default_bar());
        let phase = bars().add(ProgressBar::new(0).with_style(phase_style));
        RunProgress { steps, phase }
    }

    /// Starts a phase (`rollout`, `scoring`, `optimise`, `eval`) of `len` units.
    pub fn phase(&self, name: &'static str, len: u64) {
        self.phase.set_prefix(name);
        self.phase.set_length(len);
        self.phase.set_position(0);
    }

    /// Advances the current phase.
    pub fn advance(&self, n: u64) {
        self.phase.inc(n);
    }

    /// Marks a step done with a short summary.
    pub fn step_done(&self, msg: String) {
        self.steps.inc(1);
        self.steps.set_message(msg);
    }
}

impl Drop for RunProgress {
    fn drop(&mut self) {
        self.phase.finish_and_clear();
        self.steps.finish_and_clear();
        bars().remove(&self.phase);
        bars().remove(&self.steps);
    }
}

/// A stderr writer for log lines that suspends the bars while it prints.
pub struct LogWriter {
    buf: Vec<u8>,
}

impl Write for LogWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LogWriter {
    fn drop(&mut self) {
        if self.buf.is_empty() {
            return;
        }
        let buf = std::mem::take(&mut self.buf);
        bars().suspend(|| {
            let _ = std::io::stderr().write_all(&buf);
        });
    }
}

/// `tracing_subscriber` writer factory for [`LogWriter`].
pub fn log_writer() -> LogWriter {
    LogWriter { buf: Vec::new() }
}
