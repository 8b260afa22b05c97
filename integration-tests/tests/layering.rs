//! House rules of the layout, checked on the source of every crate of the workspace: no import
//! circles between sibling modules of a crate, no source file over 600 lines, and in the trainer
//! the RL host and the supervised phases above the shared pieces, never using each other. Prints
//! each crate's module graph with `--nocapture`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The module path of a source file: `src/rl/score.rs` → `["rl", "score"]`, `src/config/mod.rs`
/// → `["config"]`, `src/lib.rs` → `[]`.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().to_string()).collect();
    if matches!(parts.last().map(String::as_str), Some("mod") | Some("lib")) {
        parts.pop();
    }
    parts
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Module paths named by `crate::a::b::...` and `super::a::...` in the non-test, non-comment code of `text`,
/// resolved against the known modules (the longest known prefix).
fn references(text: &str, here: &[String], modules: &BTreeSet<Vec<String>>) -> BTreeSet<Vec<String>> {
    let code = text.split("\n#[cfg(test)]").next().unwrap_or(text);
    // Code only: doc links and comments are no imports.
    let code: String = code.lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n");
    let code = code.as_str();
    let mut found = BTreeSet::new();
    for (prefix, base) in [("crate::", Vec::new()), ("super::", here[..here.len().saturating_sub(1)].to_vec())] {
        for (i, _) in code.match_indices(prefix) {
            if i > 0 && code[..i].ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let rest = &code[i + prefix.len()..];
            let path: Vec<String> = rest
                .split("::")
                .map(|seg| seg.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect::<String>())
                .take_while(|seg| !seg.is_empty())
                .collect();
            let mut full = base.clone();
            full.extend(path);
            while !full.is_empty() && !modules.contains(&full) {
                full.pop();
            }
            if !full.is_empty() {
                found.insert(full);
            }
        }
    }
    found
}

/// The sibling-module graph of the crate whose sources are in `src`, after checking file lengths
/// and that it has no circle.
fn sibling_graph(src: &Path) -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    files.sort();
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| module_of(src, f)).collect();
    // Edges between siblings: a reference from a.x.. to a.y.. is an edge a.x → a.y; a module using
    // its parent's items (or a parent re-exporting its children) is not a circle of siblings.
    let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let lines = text.lines().count();
        assert!(lines <= 600, "{}: {lines} lines (the house limit is ~600)", file.display());
        let here = module_of(src, file);
        for target in references(&text, &here, &modules) {
            let common = here.iter().zip(&target).take_while(|(a, b)| a == b).count();
            if common == here.len() || common == target.len() {
                continue;
            }
            edges.entry(here[..=common].to_vec()).or_default().insert(target[..=common].to_vec());
        }
    }
    for (from, to) in &edges {
        let to: Vec<String> = to.iter().map(|t| t.join("::")).collect();
        println!("{}: {} -> {}", src.display(), from.join("::"), to.join(", "));
    }
    // Depth-first search for a cycle.
    fn visit(
        node: &Vec<String>,
        edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        state: &mut BTreeMap<Vec<String>, u8>,
        stack: &mut Vec<Vec<String>>,
    ) {
        match state.get(node) {
            Some(2) => return,
            Some(1) => {
                let at = stack.iter().position(|n| n == node).unwrap();
                let cycle: Vec<String> = stack[at..].iter().chain([node]).map(|n| n.join("::")).collect();
                panic!("import circle: {}", cycle.join(" -> "));
            }
            _ => {}
        }
        state.insert(node.clone(), 1);
        stack.push(node.clone());
        for next in edges.get(node).into_iter().flatten() {
            visit(next, edges, state, stack);
        }
        stack.pop();
        state.insert(node.clone(), 2);
    }
    let mut state = BTreeMap::new();
    for node in edges.keys() {
        visit(node, &edges, &mut state, &mut Vec::new());
    }
    edges
}

/// `src` directories of the workspace's crates (core, plugins, xtask, integration-tests).
fn crate_sources() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf();
    let mut out = vec![root.join("xtask/src"), root.join("integration-tests/src")];
    for group in ["core", "plugins"] {
        for entry in std::fs::read_dir(root.join(group)).unwrap() {
            let src = entry.unwrap().path().join("src");
            if src.is_dir() {
                out.push(src);
            }
        }
    }
    out.sort();
    out
}

#[test]
fn no_import_circles_between_sibling_modules_and_no_long_files() {
    for src in crate_sources() {
        sibling_graph(&src);
    }
}

#[test]
fn the_rl_host_and_the_supervised_phases_sit_side_by_side() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().join("core/trainer/src");
    let edges = sibling_graph(&src);
    // The two hosts sit side by side above the shared pieces.
    let uses = |a: &str, b: &str| edges.get(&vec![a.to_string()]).is_some_and(|t| t.contains(&vec![b.to_string()]));
    assert!(!uses("rl", "supervised") && !uses("supervised", "rl"), "rl and supervised must not use each other");
    for shared in ["config", "optim", "checkpoint", "data", "plugins", "metrics", "builtin"] {
        assert!(!uses(shared, "rl") && !uses(shared, "supervised"), "{shared} must not use rl or supervised");
    }
}
