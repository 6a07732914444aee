//! Turns plugin-manifest/manifest.toml (the one source of truth for the plugin's name, version
//! and options) into `$OUT_DIR/manifest.rs`, included by `src/manifest.rs`.

use std::{env, fmt::Write as _, fs, path::PathBuf};

#[derive(serde::Deserialize)]
struct Manifest {
    plugin: Plugin,
    option: Vec<Opt>,
}

#[derive(serde::Deserialize)]
struct Plugin {
    name: String,
    version: String,
}

#[derive(serde::Deserialize)]
struct Opt {
    name: String,
    env: String,
    kind: String,
    default: String,
    #[serde(default)]
    default_vram: Option<String>,
    doc: String,
}

fn main() {
    let dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let path = dir.join("../plugin-manifest/manifest.toml");
    println!("cargo:rerun-if-changed={}", path.display());
    let text = fs::read_to_string(&path).expect("read plugin-manifest/manifest.toml");
    let m: Manifest = toml::from_str(&text).expect("parse plugin-manifest/manifest.toml");
    let mut out = String::new();
    writeln!(out, "/// Backend name NIXL selects this plugin by.").unwrap();
    writeln!(out, "pub const PLUGIN_NAME: &str = {:?};", m.plugin.name).unwrap();
    writeln!(out, "/// Plugin version reported to NIXL.").unwrap();
    writeln!(out, "pub const PLUGIN_VERSION: &str = {:?};", m.plugin.version).unwrap();
    writeln!(out, "/// Every option of the plugin, in manifest order.").unwrap();
    writeln!(out, "pub static OPTIONS: &[OptionSpec] = &[").unwrap();
    for o in &m.option {
        assert!(o.name.starts_with("bounce_"), "option {} must start with bounce_", o.name);
        writeln!(
            out,
            "    OptionSpec {{ name: {:?}, env: {:?}, kind: {:?}, default: {:?}, default_vram: {:?}, doc: {:?} }},",
            o.name,
            format!("NIXL_BOUNCE_{}", o.env),
            o.kind,
            o.default,
            o.default_vram,
            o.doc
        )
        .unwrap();
    }
    writeln!(out, "];").unwrap();
    let dst = PathBuf::from(env::var("OUT_DIR").unwrap()).join("manifest.rs");
    fs::write(dst, out).unwrap();
}
