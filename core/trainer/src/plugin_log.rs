//! The log bridge, host side: a plugin's events arrive as (level, plugin name, text) and are
//! re-emitted as `tracing` events whose **target is the plugin's name**, so `RUST_LOG=grpo=debug`
//! filters one plugin like any module. tracing targets are `'static` and fixed per callsite, so one
//! callsite per (plugin, level) is built on first use and leaked (a handful per run).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use tracing::callsite::{Callsite, Identifier};
use tracing::field::FieldSet;
use tracing::metadata::Kind;
use tracing::subscriber::Interest;
use tracing::{Level, Metadata};

struct PluginCallsite {
    meta: OnceLock<Metadata<'static>>,
}

impl Callsite for PluginCallsite {
    fn set_interest(&self, _: Interest) {}

    fn metadata(&self) -> &Metadata<'_> {
        self.meta.get().expect("metadata is set before the callsite is registered")
    }
}

fn callsite(plugin: &str, level: Level) -> &'static PluginCallsite {
    static SITES: OnceLock<Mutex<HashMap<(String, Level), &'static PluginCallsite>>> = OnceLock::new();
    let sites = SITES.get_or_init(Default::default);
    let mut sites = sites.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(cs) = sites.get(&(plugin.to_string(), level)) {
        return cs;
    }
    let cs: &'static PluginCallsite = Box::leak(Box::new(PluginCallsite { meta: OnceLock::new() }));
    let target: &'static str = Box::leak(plugin.to_string().into_boxed_str());
    let fields = FieldSet::new(&["message"], Identifier(cs));
    let _ = cs.meta.set(Metadata::new("plugin event", target, level, None, None, None, fields, Kind::EVENT));
    tracing::callsite::register(cs);
    sites.insert((plugin.to_string(), level), cs);
    cs
}

/// Emits `message` at `level` with target `plugin`.
pub fn emit(plugin: &str, level: Level, message: &str) {
    let cs = callsite(plugin, level);
    let meta = cs.metadata();
    let enabled = tracing::dispatcher::get_default(|d| d.enabled(meta));
    if !enabled {
        return;
    }
    let Some(field) = meta.fields().field("message") else { return };
    let display = tracing::field::display(message);
    let values = [(&field, Some(&display as &dyn tracing::field::Value))];
    tracing::Event::dispatch(meta, &meta.fields().value_set(&values));
}
