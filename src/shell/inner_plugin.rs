//! Finding and loading NIXL's own UCX plugin, which BOUNCE delegates to.
//!
//! The UCX plugin finds its bundled UCX libraries through an `$ORIGIN`-relative RPATH, so it must
//! be loaded from where NIXL installed it; by default that is the directory BOUNCE itself sits in
//! (NIXL's plugin directory).

use std::ffi::c_void;
use std::path::{Path, PathBuf};

use crate::shell::{Error, Result};

/// The plugin API version BOUNCE implements and requires of the inner plugin.
pub const PLUGIN_API_VERSION: i32 = 1;

/// The loaded UCX plugin: the library (kept mapped) and its plugin descriptor.
pub struct InnerPlugin {
    path: PathBuf,
    descriptor: *const c_void,
    _lib: libloading::Library,
}

// SAFETY: the descriptor points at immutable static data inside the loaded library, which stays
// mapped for as long as `_lib` lives (and NIXL loads with RTLD_NODELETE anyway). Reading it from
// any thread is fine.
unsafe impl Send for InnerPlugin {}
// SAFETY: as above; nothing here is mutated after construction.
unsafe impl Sync for InnerPlugin {}

impl InnerPlugin {
    /// Loads the plugin at `path`, checks its API version and that it is not BOUNCE itself.
    ///
    /// # Errors
    /// [`Error::InnerPluginMissing`], [`Error::InnerPluginLoad`], [`Error::InnerPluginVersion`],
    /// [`Error::InnerPluginIsBounce`].
    pub fn load(path: &Path) -> Result<Self> {
        if !path.is_file() {
            return Err(Error::InnerPluginMissing { path: path.to_owned() });
        }
        let load_err = |e: libloading::Error| Error::InnerPluginLoad { path: path.to_owned(), reason: e.to_string() };
        let (lib, descriptor) = crate::ffi::abi::open_plugin(path).map_err(load_err)?;
        let plugin = Self { path: path.to_owned(), descriptor, _lib: lib };
        let version = crate::ffi::abi::plugin_api_version(plugin.descriptor);
        if version != PLUGIN_API_VERSION {
            return Err(Error::InnerPluginVersion { path: path.to_owned(), got: version, want: PLUGIN_API_VERSION });
        }
        if crate::ffi::abi::plugin_name(plugin.descriptor).as_deref() == Some(bounce_proto::manifest::PLUGIN_NAME) {
            return Err(Error::InnerPluginIsBounce { path: path.to_owned() });
        }
        Ok(plugin)
    }

    /// The plugin descriptor (`nixlBackendPlugin*`) for the C++ shim.
    pub fn descriptor(&self) -> *const c_void {
        self.descriptor
    }

    /// The file it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Where to load UCX from: the configured path, else `libplugin_UCX.so` beside BOUNCE.
pub fn locate_ucx_plugin(configured: Option<&str>, self_path: Option<&Path>) -> PathBuf {
    if let Some(p) = configured {
        return PathBuf::from(p);
    }
    let dir = self_path.and_then(Path::parent).unwrap_or(Path::new("."));
    dir.join("libplugin_UCX.so")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configured_path_wins_else_sibling_of_bounce() {
        let me = Path::new("/opt/nixl/plugins/libplugin_BOUNCE.so");
        assert_eq!(locate_ucx_plugin(Some("/x/libplugin_UCX.so"), Some(me)), PathBuf::from("/x/libplugin_UCX.so"));
        assert_eq!(locate_ucx_plugin(None, Some(me)), PathBuf::from("/opt/nixl/plugins/libplugin_UCX.so"));
    }

    #[test]
    fn missing_plugin_is_a_clear_error() {
        let err = InnerPlugin::load(Path::new("/nonexistent/libplugin_UCX.so")).err().unwrap();
        assert!(matches!(err, Error::InnerPluginMissing { .. }));
        assert!(err.to_string().contains("NIXL_BOUNCE_UCX_PLUGIN"));
    }

    #[test]
    fn a_file_that_is_not_a_plugin_fails_to_load() {
        let dir = std::env::temp_dir().join(format!("bnc-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("libplugin_UCX.so");
        std::fs::write(&p, b"not an ELF file").unwrap();
        let err = InnerPlugin::load(&p).err().unwrap();
        assert!(matches!(err, Error::InnerPluginLoad { .. }), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
