//! The plugin's identity and option table, generated at build time from
//! `plugin-manifest/manifest.toml` (the one source of truth; see proto/build.rs).

/// One backend option as declared in the manifest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionSpec {
    /// Backend parameter name (the key in NIXL's backend param map).
    pub name: &'static str,
    /// Environment variable that overrides the parameter.
    pub env: &'static str,
    /// Value kind: `bool`, `bytes`, `u32`, `u64`, `path`, `gpus` or `enum:a|b`.
    pub kind: &'static str,
    /// Default value, in the same textual form a user would write.
    pub default: &'static str,
    /// Default when the arena is GPU memory, where it differs from [`OptionSpec::default`].
    pub default_vram: Option<&'static str>,
    /// One-line documentation.
    pub doc: &'static str,
}

include!(concat!(env!("OUT_DIR"), "/manifest.rs"));

impl OptionSpec {
    /// The default for an arena of memory `mem`.
    pub fn default_for(&self, mem: crate::MemKind) -> &'static str {
        match (mem, self.default_vram) {
            (crate::MemKind::Vram, Some(v)) => v,
            _ => self.default,
        }
    }
}

/// The option named `name`, if the manifest declares it.
pub fn option(name: &str) -> Option<&'static OptionSpec> {
    OPTIONS.iter().find(|o| o.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_prefixed() {
        for (i, a) in OPTIONS.iter().enumerate() {
            assert!(a.name.starts_with("bounce_"));
            assert!(a.env.starts_with("NIXL_BOUNCE_"));
            assert!(!a.doc.is_empty(), "{} has no doc", a.name);
            for b in &OPTIONS[i + 1..] {
                assert_ne!(a.name, b.name);
                assert_ne!(a.env, b.env);
            }
        }
        assert_eq!(PLUGIN_NAME, "BOUNCE");
        assert!(option("bounce_arena_size").is_some());
        assert!(option("num_workers").is_none());
    }
}
