//! The NIXL version guard: BOUNCE loads only into the NIXL releases it was tested with.
//!
//! NIXL has changed its plugin ABI (engine vtable slots, init-param fields) without raising
//! `NIXL_PLUGIN_API_VERSION`, so an API-version check alone cannot stop BOUNCE from reading
//! the wrong fields of an untested NIXL. Engine creation therefore checks the NIXL release it
//! runs inside first; on an untested one it fails with one clear message (NIXL then reports
//! that the backend could not be created, and the host carries on), unless the user opts in
//! with `NIXL_BOUNCE_ALLOW_UNTESTED_NIXL=1`.
//!
//! How the version is found: libnixl.so carries no version string or symbol, but the PyPI
//! wheels (nixl-cu12, nixl-cu13) install it as `<site>/.nixl_cuXX.mesonpy.libs/libnixl.so`
//! with the wheel's `<site>/nixl_cuXX-<version>.dist-info/METADATA` beside it. The probe takes
//! the libnixl.so mapped into this process from `/proc/self/maps` (the very library whose
//! agent is creating us, not whatever another environment has installed) and reads the
//! `Version:` header of that METADATA. A NIXL without wheel metadata (a source build) has an
//! unknown version and is refused the same way, with the same override.

use std::ffi::CStr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// NIXL releases this build was tested with (exact versions).
pub(crate) const TESTED_NIXL_VERSIONS: &[&str] = &["1.5.1"];

/// [`TESTED_NIXL_VERSIONS`], comma-separated, for `nixl-bounce doctor` (a unit test keeps the
/// two equal).
pub(crate) const TESTED_NIXL_VERSIONS_C: &CStr = c"1.5.1";

/// Set to `1` (or `true`/`yes`) to load into an untested or unidentified NIXL anyway.
pub(crate) const ALLOW_UNTESTED_ENV: &str = "NIXL_BOUNCE_ALLOW_UNTESTED_NIXL";

/// FOR TESTS ONLY: pretend the NIXL in this process has this version, so the refusal can be
/// exercised end to end against the one NIXL the test machine has.
pub(crate) const TEST_FAKE_VERSION_ENV: &str = "NIXL_BOUNCE_TEST_FAKE_NIXL_VERSION";

/// What the probe found out about the NIXL in this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Detected {
    /// A version, and where it was read.
    Version {
        /// The release, e.g. `1.5.1`.
        version: String,
        /// The file it came from (or the test variable).
        from: String,
    },
    /// No version could be found; why.
    Unknown(String),
}

/// Why the NIXL in this process is not known to be safe for this build.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Untested {
    /// A known release that this build was not tested with.
    #[error(
        "NIXL {version} (read from {from}) is not a release this build was tested with ({tested}), \
         and NIXL changes its plugin ABI without changing the plugin API version"
    )]
    Release {
        /// The release found.
        version: String,
        /// Where it was read.
        from: String,
        /// The tested releases, comma-separated.
        tested: String,
    },
    /// The release could not be identified.
    #[error("the NIXL version could not be determined ({why}); this build was tested only with NIXL {tested}")]
    Unknown {
        /// What the probe found missing.
        why: String,
        /// The tested releases, comma-separated.
        tested: String,
    },
}

/// Engine creation's one-line refusal: why, and the two ways out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "refusing to load: {reason}; install a tested NIXL (pip install --no-deps nixl-cu12=={latest}, or nixl-cu13), \
     or set {ALLOW_UNTESTED_ENV}=1 to load anyway at your own risk"
)]
pub(crate) struct Refusal {
    /// Why.
    pub(crate) reason: Untested,
    /// The newest tested release.
    latest: String,
}

/// The guard's decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// A tested release: load.
    Tested,
    /// Not tested (or unknown), but the user opted in: load, and warn once.
    AllowedUntested(Untested),
    /// Refuse engine creation with this message.
    Refused(Refusal),
}

/// Decides what to do with `detected`, given the tested list and the user's opt-in.
pub(crate) fn decide(detected: &Detected, tested: &[&str], allow_untested: bool) -> Verdict {
    let tested_list = tested.join(", ");
    let reason = match detected {
        Detected::Version { version, .. } if tested.contains(&version.as_str()) => return Verdict::Tested,
        Detected::Version { version, from } => {
            Untested::Release { version: version.clone(), from: from.clone(), tested: tested_list }
        }
        Detected::Unknown(why) => Untested::Unknown { why: why.clone(), tested: tested_list },
    };
    if allow_untested {
        Verdict::AllowedUntested(reason)
    } else {
        Verdict::Refused(Refusal { reason, latest: tested.last().copied().unwrap_or_default().to_owned() })
    }
}

/// True for the opt-in values of [`ALLOW_UNTESTED_ENV`].
pub(crate) fn is_opt_in(value: Option<&str>) -> bool {
    matches!(value.map(|v| v.trim().to_ascii_lowercase()).as_deref(), Some("1" | "true" | "yes" | "on"))
}

/// The path of the first `libnixl.so` in a `/proc/<pid>/maps` text.
pub(crate) fn libnixl_in_maps(maps: &str) -> Option<PathBuf> {
    maps.lines()
        // Fields: address perms offset dev inode [path]; the path may contain spaces.
        .filter_map(|line| line.splitn(6, char::is_whitespace).nth(5).map(str::trim))
        .map(Path::new)
        .find(|p| p.file_name().is_some_and(|n| n == "libnixl.so"))
        .map(Path::to_path_buf)
}

/// A libnixl.so mapping the kernel marks `(deleted)`: NIXL was reinstalled or upgraded on
/// disk under this running process (review 56). Its version cannot be read any more (the
/// dist-info beside the path is the new install's), so the guard says that, not that no NIXL
/// is loaded.
pub(crate) fn replaced_libnixl_in_maps(maps: &str) -> Option<PathBuf> {
    maps.lines()
        .filter_map(|line| line.splitn(6, char::is_whitespace).nth(5).map(str::trim))
        .filter_map(|p| p.strip_suffix(" (deleted)"))
        .map(Path::new)
        .find(|p| p.file_name().is_some_and(|n| n == "libnixl.so"))
        .map(Path::to_path_buf)
}

/// For a wheel's `<site>/.nixl_cuXX.mesonpy.libs/libnixl.so`: the glob-free parts of its
/// metadata path, `(<site>, "nixl_cuXX")`.
pub(crate) fn wheel_of(libnixl: &Path) -> Option<(PathBuf, String)> {
    let libs = libnixl.parent()?;
    let package = libs.file_name()?.to_str()?.strip_prefix('.')?.strip_suffix(".mesonpy.libs")?;
    Some((libs.parent()?.to_path_buf(), package.to_owned()))
}

/// The `Version:` header of a wheel's METADATA text (headers end at the first blank line).
pub(crate) fn metadata_version(metadata: &str) -> Option<String> {
    metadata
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .find_map(|l| l.strip_prefix("Version:"))
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
}

/// Reads the version of the wheel whose libnixl.so is `libnixl`, from its dist-info beside it.
fn version_of_wheel(libnixl: &Path) -> Detected {
    let Some((site, package)) = wheel_of(libnixl) else {
        return Detected::Unknown(format!(
            "{} is not inside a NIXL wheel (no .nixl_cuXX.mesonpy.libs)",
            libnixl.display()
        ));
    };
    let prefix = format!("{package}-");
    let dist_info = std::fs::read_dir(&site).ok().into_iter().flatten().flatten().map(|e| e.path()).find(|p| {
        p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".dist-info"))
    });
    let Some(meta) = dist_info.map(|d| d.join("METADATA")) else {
        return Detected::Unknown(format!("no {package}-*.dist-info in {}", site.display()));
    };
    match std::fs::read_to_string(&meta).ok().as_deref().and_then(metadata_version) {
        Some(version) => Detected::Version { version, from: meta.display().to_string() },
        None => Detected::Unknown(format!("no Version in {}", meta.display())),
    }
}

/// Probes the NIXL this process runs (or the test override in `env`).
fn detect(env: &impl Fn(&str) -> Option<String>) -> Detected {
    if let Some(fake) = env(TEST_FAKE_VERSION_ENV).filter(|v| !v.is_empty()) {
        return Detected::Version { version: fake, from: TEST_FAKE_VERSION_ENV.to_owned() };
    }
    let maps = match std::fs::read_to_string("/proc/self/maps") {
        Ok(m) => m,
        Err(e) => return Detected::Unknown(format!("cannot read /proc/self/maps: {e}")),
    };
    match (libnixl_in_maps(&maps), replaced_libnixl_in_maps(&maps)) {
        (Some(lib), _) => version_of_wheel(&lib),
        (None, Some(lib)) => Detected::Unknown(format!(
            "the libnixl.so this process loaded ({}) was replaced or removed on disk since (NIXL reinstalled \
             under a running process), so its version cannot be read; restart the process",
            lib.display()
        )),
        (None, None) => Detected::Unknown("no libnixl.so is loaded in this process".to_owned()),
    }
}

/// The guard, run before every engine creation: `Err` carries the one-line refusal (the shim
/// prints it as `BOUNCE: <refusal>` and fails the engine's creation). The probe runs once per process (the NIXL a process has loaded does not change).
pub(crate) fn check(env: impl Fn(&str) -> Option<String>) -> Result<(), Refusal> {
    static DETECTED: OnceLock<Detected> = OnceLock::new();
    static WARNED: std::sync::Once = std::sync::Once::new();
    let detected = DETECTED.get_or_init(|| detect(&env));
    static FAKED: std::sync::Once = std::sync::Once::new();
    if let Detected::Version { version, from } = detected {
        if from == TEST_FAKE_VERSION_ENV {
            // It can make any NIXL pass as tested: never silently (review 57).
            FAKED.call_once(|| tracing::warn!("{TEST_FAKE_VERSION_ENV}={version}: the version guard takes that for NIXL's version (for the project's tests only)"));
        }
    }
    match decide(detected, TESTED_NIXL_VERSIONS, is_opt_in(env(ALLOW_UNTESTED_ENV).as_deref())) {
        Verdict::Tested => Ok(()),
        Verdict::AllowedUntested(why) => {
            WARNED.call_once(|| tracing::warn!("loading although {why}, because {ALLOW_UNTESTED_ENV} is set"));
            Ok(())
        }
        Verdict::Refused(why) => Err(why),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found(v: &str) -> Detected {
        Detected::Version { version: v.into(), from: "METADATA".into() }
    }

    #[test]
    fn tested_version_loads_and_others_are_refused_unless_allowed() {
        assert_eq!(decide(&found("1.5.1"), &["1.5.1"], false), Verdict::Tested);
        assert_eq!(decide(&found("1.5.1"), &["1.5.1"], true), Verdict::Tested);
        for v in ["1.5.0", "1.6.0", "1.5.1.post1", "1.5"] {
            let Verdict::Refused(r) = decide(&found(v), &["1.5.1"], false) else { panic!("{v} not refused") };
            assert!(matches!(r.reason, Untested::Release { ref version, .. } if version == v));
            assert!(matches!(decide(&found(v), &["1.5.1"], true), Verdict::AllowedUntested(_)));
        }
        let unknown = Detected::Unknown("source build".into());
        assert!(matches!(
            decide(&unknown, &["1.5.1"], false),
            Verdict::Refused(Refusal { reason: Untested::Unknown { .. }, .. })
        ));
        assert!(matches!(decide(&unknown, &["1.5.1"], true), Verdict::AllowedUntested(_)));
    }

    #[test]
    fn refusal_is_one_line_naming_version_tested_list_and_override() {
        let Verdict::Refused(r) = decide(&found("9.9.9"), &["1.5.0", "1.5.1"], false) else { panic!() };
        let msg = r.to_string();
        assert!(!msg.contains('\n'), "{msg}");
        for part in
            ["refusing to load: NIXL 9.9.9", "1.5.0, 1.5.1", "nixl-cu12==1.5.1", "NIXL_BOUNCE_ALLOW_UNTESTED_NIXL=1"]
        {
            assert!(msg.contains(part), "{part:?} missing from {msg}");
        }
        let Verdict::Refused(u) = decide(&Detected::Unknown("no wheel".into()), &["1.5.1"], false) else { panic!() };
        assert!(u.to_string().contains("could not be determined (no wheel)"));
    }

    #[test]
    fn opt_in_values() {
        for v in ["1", "true", "YES", " on "] {
            assert!(is_opt_in(Some(v)), "{v}");
        }
        for v in [None, Some(""), Some("0"), Some("false"), Some("no"), Some("2")] {
            assert!(!is_opt_in(v), "{v:?}");
        }
    }

    #[test]
    fn libnixl_is_found_in_maps_by_file_name_only() {
        let maps = "\
7f00-7f01 r-xp 00000000 08:01 11 /usr/lib/libnixl_common.so
7f01-7f02 r--p 00000000 00:00 0 [heap]
7f02-7f03 r-xp 00000000 08:01 12 /opt/my venv/site-packages/.nixl_cu12.mesonpy.libs/libnixl.so
7f03-7f04 r-xp 00000000 08:01 13 /other/libnixl.so
7f04-7f05 rw-p 00000000 00:00 0
";
        assert_eq!(
            libnixl_in_maps(maps),
            Some(PathBuf::from("/opt/my venv/site-packages/.nixl_cu12.mesonpy.libs/libnixl.so"))
        );
        assert_eq!(libnixl_in_maps("7f-80 r-xp 0 08:01 1 /usr/lib/libnixl_capi.so\n"), None);
        assert_eq!(replaced_libnixl_in_maps(maps), None);
    }

    #[test]
    fn a_libnixl_replaced_on_disk_is_told_apart_from_none() {
        let maps = "7f02-7f03 r-xp 00000000 08:01 12 /v/site-packages/.nixl_cu12.mesonpy.libs/libnixl.so (deleted)\n";
        assert_eq!(libnixl_in_maps(maps), None, "its version is not read from the new install's dist-info");
        assert_eq!(
            replaced_libnixl_in_maps(maps),
            Some(PathBuf::from("/v/site-packages/.nixl_cu12.mesonpy.libs/libnixl.so"))
        );
        assert_eq!(replaced_libnixl_in_maps("7f-80 r-xp 0 08:01 1 /x/libnixl_capi.so (deleted)\n"), None);
    }

    #[test]
    fn wheel_layout_gives_site_and_package() {
        let lib = Path::new("/v/lib/python3.11/site-packages/.nixl_cu13.mesonpy.libs/libnixl.so");
        assert_eq!(wheel_of(lib), Some((PathBuf::from("/v/lib/python3.11/site-packages"), "nixl_cu13".into())));
        assert_eq!(wheel_of(Path::new("/usr/local/nixl/lib/x86_64-linux-gnu/libnixl.so")), None);
    }

    #[test]
    fn metadata_version_reads_the_header_only() {
        let meta = "Metadata-Version: 2.1\nName: nixl-cu12\nVersion: 1.5.1\n\nVersion: 0.0.0 in the body\n";
        assert_eq!(metadata_version(meta), Some("1.5.1".into()));
        assert_eq!(metadata_version("Name: x\n\nVersion: 1.0\n"), None);
        assert_eq!(metadata_version("Version:   \n"), None);
    }

    #[test]
    fn wheel_version_is_read_from_dist_info_beside_the_libs() {
        let dir = std::env::temp_dir().join(format!("bnc-nixl-version-{}", std::process::id()));
        let libs = dir.join(".nixl_cu12.mesonpy.libs");
        let dist = dir.join("nixl_cu12-1.5.1.dist-info");
        std::fs::create_dir_all(&libs).unwrap();
        std::fs::create_dir_all(&dist).unwrap();
        std::fs::write(dist.join("METADATA"), "Name: nixl-cu12\nVersion: 1.5.1\n").unwrap();
        let got = version_of_wheel(&libs.join("libnixl.so"));
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(matches!(got, Detected::Version { ref version, .. } if version == "1.5.1"), "{got:?}");
        let missing = version_of_wheel(&dir.join(".nixl_cu13.mesonpy.libs/libnixl.so"));
        assert!(matches!(missing, Detected::Unknown(_)), "{missing:?}");
    }

    #[test]
    fn fake_version_variable_overrides_detection() {
        let env = |k: &str| (k == TEST_FAKE_VERSION_ENV).then(|| "0.0.1".to_owned());
        assert_eq!(detect(&env), Detected::Version { version: "0.0.1".into(), from: TEST_FAKE_VERSION_ENV.into() });
    }

    #[test]
    fn exported_list_matches_the_constant() {
        assert_eq!(TESTED_NIXL_VERSIONS_C.to_str().unwrap(), TESTED_NIXL_VERSIONS.join(","));
    }
}
