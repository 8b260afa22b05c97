//! The log bridge, plugin side: a `tracing` subscriber installed in the plugin's own globals that
//! formats each event and hands it to the host's [`HostLogger`], so plugin authors just use
//! `tracing::info!` and the host shows it with the plugin's name as target.

use std::io::Write;
use std::sync::OnceLock;

use abi_stable::std_types::RStr;
use tracing_subscriber::fmt::MakeWriter;

use crate::abi::{HostLogger, LogLevel};

#[derive(Clone, Copy)]
struct Bridge {
    logger: HostLogger,
    name: &'static str,
}

static BRIDGE: OnceLock<Bridge> = OnceLock::new();

/// Forwards one formatted event.
pub struct BridgeWriter {
    level: LogLevel,
    buf: Vec<u8>,
}

impl Write for BridgeWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for BridgeWriter {
    fn drop(&mut self) {
        if let Some(b) = BRIDGE.get() {
            let text = String::from_utf8_lossy(&self.buf);
            let text = text.trim_end();
            if !text.is_empty() {
                (b.logger.log)(self.level, RStr::from_str(b.name), RStr::from_str(text));
            }
        }
    }
}

struct MakeBridge;

impl<'a> MakeWriter<'a> for MakeBridge {
    type Writer = BridgeWriter;
    fn make_writer(&'a self) -> Self::Writer {
        BridgeWriter { level: LogLevel::Info, buf: Vec::new() }
    }
    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> Self::Writer {
        let level = match *meta.level() {
            tracing::Level::ERROR => LogLevel::Error,
            tracing::Level::WARN => LogLevel::Warn,
            tracing::Level::INFO => LogLevel::Info,
            tracing::Level::DEBUG => LogLevel::Debug,
            tracing::Level::TRACE => LogLevel::Trace,
        };
        BridgeWriter { level, buf: Vec::new() }
    }
}

/// Installs the bridge once per plugin library; later calls are no-ops.
pub fn install(logger: HostLogger, name: &'static str) {
    if BRIDGE.set(Bridge { logger, name }).is_ok() {
        let subscriber = tracing_subscriber::fmt()
            .with_writer(MakeBridge)
            .without_time()
            .with_level(false)
            .with_target(false)
            .with_ansi(false)
            .with_max_level(tracing::Level::TRACE)
            .finish();
        let _ = tracing::subscriber::set_global_default(subscriber);
        // A panic inside the plugin is caught at the boundary and returned as a PluginError; its
        // message goes to the host's log (debug) instead of this library's own stderr hook.
        std::panic::set_hook(Box::new(|info| {
            tracing::debug!("panic: {info}");
        }));
    }
}
