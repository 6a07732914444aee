//! The README's option table is generated from plugin-manifest/manifest.toml; this keeps the
//! two from drifting apart (the manifest is the one source of truth).

use nixl_bounce::proto::manifest::OPTIONS;

#[test]
fn readme_documents_every_manifest_option_with_its_default_and_env() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let table = readme
        .split("<!-- options:begin")
        .nth(1)
        .and_then(|s| s.split("<!-- options:end -->").next())
        .expect("README has the options markers");
    let rows: Vec<&str> = table.lines().filter(|l| l.starts_with("| `")).collect();
    assert_eq!(rows.len(), OPTIONS.len(), "README rows vs manifest options");
    for (row, o) in rows.iter().zip(OPTIONS) {
        let default = if o.default.is_empty() { "(empty)" } else { o.default };
        assert!(row.contains(&format!("`{}`", o.name)), "{row}");
        assert!(row.contains(&format!("`{}`", o.env)), "{row}");
        assert!(row.contains(&format!("`{default}`")), "{row}");
        if let Some(v) = o.default_vram {
            assert!(row.contains(&format!("(VRAM: `{v}`)")), "{row}");
        }
        assert!(row.contains(o.doc), "{row}");
    }
}
