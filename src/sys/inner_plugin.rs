//! Finding and loading NIXL's own UCX plugin, which BOUNCE delegates to.
//!
//! The UCX plugin finds its bundled UCX libraries through an `$ORIGIN`-relative RPATH, so it must
//! be loaded from where NIXL installed it; by default that is the directory BOUNCE itself sits in
//! (NIXL's plugin directory).

use std::ffi::{CStr, c_char, c_void};
use std::path::{Path, PathBuf};

/// Why the inner plugin could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum LoadError {
    /// No UCX plugin where we looked.
    #[error(
        "NIXL's UCX plugin was not found at {path}; install BOUNCE into NIXL's own plugin folder \
         (`nixl-bounce install`), or set the backend param bounce_ucx_plugin / NIXL_BOUNCE_UCX_PLUGIN \
         to NIXL's own libplugin_UCX.so (a copy elsewhere cannot find the libraries it needs)"
    )]
    Missing {
        /// Where we looked.
        path: PathBuf,
    },
    /// dlopen or symbol lookup failed.
    #[error("could not load the UCX plugin {path}: {source}")]
    Load {
        /// The plugin file.
        path: PathBuf,
        /// The loader's error.
        source: libloading::Error,
    },
    /// The inner plugin speaks another plugin API version.
    #[error("the UCX plugin {path} has plugin API version {got}, BOUNCE supports {want}")]
    Version {
        /// The plugin file.
        path: PathBuf,
        /// Its API version.
        got: i32,
        /// Ours.
        want: i32,
    },
    /// The configured inner plugin is BOUNCE itself (would recurse forever).
    #[error("the configured inner plugin {path} is BOUNCE itself, not UCX")]
    IsBounce {
        /// The plugin file.
        path: PathBuf,
    },
}

/// The plugin API version BOUNCE implements and requires of the inner plugin.
pub(crate) const PLUGIN_API_VERSION: i32 = 1;

/// The loaded UCX plugin: the library (kept mapped) and its plugin descriptor.
pub(crate) struct InnerPlugin {
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
    /// [`LoadError::Missing`], [`LoadError::Load`], [`LoadError::Version`],
    /// [`LoadError::IsBounce`].
    pub(crate) fn load(path: &Path) -> Result<Self, LoadError> {
        if !path.is_file() {
            return Err(LoadError::Missing { path: path.to_owned() });
        }
        let (lib, descriptor) =
            open_plugin(path).map_err(|source| LoadError::Load { path: path.to_owned(), source })?;
        let plugin = Self { path: path.to_owned(), descriptor, _lib: lib };
        // SAFETY: the descriptor is the non-null pointer nixl_plugin_init returned, and the
        // library that holds it stays mapped while `plugin` lives.
        let version = unsafe { plugin_api_version(plugin.descriptor) };
        if version != PLUGIN_API_VERSION {
            return Err(LoadError::Version { path: path.to_owned(), got: version, want: PLUGIN_API_VERSION });
        }
        // SAFETY: as above, and the version was checked to be 1 just now.
        if unsafe { plugin_name(plugin.descriptor) }.as_deref() == Some(bounce_proto::manifest::PLUGIN_NAME) {
            return Err(LoadError::IsBounce { path: path.to_owned() });
        }
        Ok(plugin)
    }

    /// The plugin descriptor (`nixlBackendPlugin*`) for the C++ shim.
    pub(crate) fn descriptor(&self) -> *const c_void {
        self.descriptor
    }

    /// The file it was loaded from.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

// ---- reading another plugin's descriptor (nixlBackendPlugin, API version 1) ----

/// The first fields of NIXL's plugin descriptor, as far as we read them.
#[repr(C)]
struct PluginHead {
    api_version: i32,
    create_engine: *const c_void,
    destroy_engine: *const c_void,
    get_plugin_name: Option<unsafe extern "C" fn() -> *const c_char>,
}

/// Opens a NIXL plugin library as NIXL does and calls its `nixl_plugin_init`.
fn open_plugin(path: &Path) -> Result<(libloading::Library, *const c_void), libloading::Error> {
    use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
    // RTLD_NODELETE like NIXL: UCX registers atexit/TLS state that must outlive dlclose.
    const RTLD_NODELETE: i32 = 0x1000;
    // SAFETY: loading a library runs its initializers. The path is NIXL's own UCX plugin (or
    // what the user configured in its place), which NIXL would load the same way.
    let lib = unsafe { Library::open(Some(path), RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE) }?;
    // SAFETY: every NIXL plugin exports `nixl_plugin_init` with this C signature.
    let init = unsafe { lib.get::<unsafe extern "C" fn() -> *const c_void>(b"nixl_plugin_init\0") }?;
    // SAFETY: the symbol has the signature above and takes no arguments.
    let descriptor = unsafe { init() };
    if descriptor.is_null() {
        return Err(libloading::Error::DlSymUnknown);
    }
    Ok((libloading::Library::from(lib), descriptor))
}

/// The descriptor's API version.
///
/// # Safety
/// - `descriptor` is a non-null pointer returned by a NIXL plugin's `nixl_plugin_init`, and
///   the library holding it is still mapped (every plugin API version starts with the int
///   `api_version`).
unsafe fn plugin_api_version(descriptor: *const c_void) -> i32 {
    // SAFETY: the caller guarantees a live descriptor, whose first field is the int version.
    unsafe { (*descriptor.cast::<PluginHead>()).api_version }
}

/// The descriptor's plugin name.
///
/// # Safety
/// - As for [`plugin_api_version`], and the descriptor's API version is 1 (checked by the
///   caller), so the head has the [`PluginHead`] layout.
/// - Its `get_plugin_name`, when set, returns null or a NUL-terminated string that stays valid
///   for the call (NIXL plugins return static strings).
unsafe fn plugin_name(descriptor: *const c_void) -> Option<String> {
    // SAFETY: version-1 head layout per the caller's contract.
    let f = unsafe { (*descriptor.cast::<PluginHead>()).get_plugin_name }?;
    // SAFETY: a version-1 plugin's name function takes no arguments.
    let p = unsafe { f() };
    // SAFETY: non-null and NUL-terminated per the contract.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// Where to load UCX from: the configured path, else `libplugin_UCX.so` beside BOUNCE.
pub(crate) fn locate_ucx_plugin(configured: Option<&str>, self_path: Option<&Path>) -> PathBuf {
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
        assert!(matches!(err, LoadError::Missing { .. }));
        assert!(err.to_string().contains("NIXL_BOUNCE_UCX_PLUGIN"));
    }

    #[test]
    fn a_file_that_is_not_a_plugin_fails_to_load() {
        let dir = std::env::temp_dir().join(format!("bnc-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("libplugin_UCX.so");
        std::fs::write(&p, b"not an ELF file").unwrap();
        let err = InnerPlugin::load(&p).err().unwrap();
        assert!(matches!(err, LoadError::Load { .. }), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
