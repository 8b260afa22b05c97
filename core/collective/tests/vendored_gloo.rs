//! The vendored gloo headers are byte-identical to the pinned upstream commit: every file listed
//! in `vendor/gloo/MANIFEST.sha256` (made from gloo 3135b0b, the commit PyTorch 2.11 pins) still
//! has its recorded hash, and no header sits there unlisted.

use std::path::Path;
use std::process::Command;

#[test]
fn vendored_gloo_headers_match_their_manifest() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("vendor/gloo");
    let out = Command::new("sha256sum")
        .args(["--check", "--strict", "MANIFEST.sha256"])
        .current_dir(&dir)
        .output()
        .expect("sha256sum");
    assert!(
        out.status.success(),
        "vendor/gloo drifted from MANIFEST.sha256 (refresh from the pinned commit, see vendor/gloo/README.md):\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let manifest = std::fs::read_to_string(dir.join("MANIFEST.sha256")).unwrap();
    let listed: Vec<&str> = manifest.lines().filter_map(|l| l.split_whitespace().nth(1)).collect();
    let mut stack = vec![dir.clone()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "h") {
                let rel = p.strip_prefix(&dir).unwrap().to_string_lossy().into_owned();
                assert!(listed.contains(&rel.as_str()), "{rel}: vendored but not in MANIFEST.sha256");
            }
        }
    }
}
