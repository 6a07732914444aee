//! The layers of `src/` point one way: `ffi` (what NIXL calls into) -> `shell` -> `sys` (what
//! we call out to). This test reads every source file of a layer and fails on a path that
//! reaches upward: the shell naming `crate::ffi`, or `sys` naming `crate::shell` or
//! `crate::ffi`. Set `LAYERING_ROOT` to check another checkout (for instance an older commit
//! exported with `git archive`).

use std::path::{Path, PathBuf};

/// Each layer and the layers above it, which it must never name.
const RULES: &[(&str, &[&str])] = &[("shell", &["ffi"]), ("sys", &["shell", "ffi"])];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Every `crate::<above>` path in the layer's files, as `file:line: text`.
fn upward_paths(src: &Path, layer: &str, above: &[&str]) -> Vec<String> {
    let mut files = Vec::new();
    rust_files(&src.join(layer), &mut files);
    let mut found = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap_or_default();
        for (i, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            if above.iter().any(|a| code.contains(&format!("crate::{a}"))) {
                found.push(format!("{}:{}: {}", f.display(), i + 1, line.trim()));
            }
        }
    }
    found
}

#[test]
fn no_layer_imports_a_layer_above_it() {
    let root =
        std::env::var_os("LAYERING_ROOT").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from);
    let src = root.join("src");
    for (layer, _) in RULES {
        assert!(src.join(layer).is_dir(), "{} has no src/{layer}/ folder", root.display());
    }
    let violations: Vec<String> = RULES.iter().flat_map(|(layer, above)| upward_paths(&src, layer, above)).collect();
    assert!(violations.is_empty(), "upward imports:\n{}", violations.join("\n"));
}
