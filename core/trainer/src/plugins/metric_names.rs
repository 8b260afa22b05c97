//! How many metric names a plugin may introduce: each new name adds a key to every later row of
//! `metrics.jsonl` and a chart to W&B, so a plugin reporting ever-new names (an id in the name,
//! say) would grow each row without bound. The first [`MAX_PLUGIN_METRICS`] distinct names of a
//! plugin are kept; values of later new names are dropped, with one warning.

use std::collections::BTreeSet;

/// Distinct metric names one plugin may introduce over a run.
pub const MAX_PLUGIN_METRICS: usize = 256;

/// The metric names a plugin has introduced so far.
#[derive(Debug, Default)]
pub struct MetricNames {
    seen: BTreeSet<String>,
    warned: bool,
}

impl MetricNames {
    /// Whether `name` may be reported: seen before, or new while there is room (then remembered).
    /// Warns once, naming `plugin`, when the first name is refused.
    pub fn admit(&mut self, plugin: &str, name: &str) -> bool {
        if self.seen.contains(name) {
            return true;
        }
        if self.seen.len() < MAX_PLUGIN_METRICS {
            self.seen.insert(name.to_string());
            return true;
        }
        if !self.warned {
            self.warned = true;
            tracing::warn!(
                "plugin `{plugin}` reports more than {MAX_PLUGIN_METRICS} distinct metric names; values of further new \
                 names (first: `{name}`) are dropped"
            );
        }
        false
    }

    /// `metrics` without the values of names past the limit.
    pub fn filter(&mut self, plugin: &str, metrics: Vec<(String, f64)>) -> Vec<(String, f64)> {
        metrics.into_iter().filter(|(n, _)| self.admit(plugin, n)).collect()
    }

    /// The names admitted so far, in order.
    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.seen.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_first_names_and_drops_later_new_ones() {
        let mut n = MetricNames::default();
        let many: Vec<(String, f64)> = (0..300).map(|i| (format!("m{i:03}"), 1.0)).collect();
        assert_eq!(n.filter("p", many.clone()).len(), MAX_PLUGIN_METRICS);
        // Known names keep flowing; new ones stay out.
        assert_eq!(n.filter("p", many).len(), MAX_PLUGIN_METRICS);
        assert!(n.admit("p", "m000") && !n.admit("p", "new"));
    }
}
