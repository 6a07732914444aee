//! Build step for `kernels/`: compiles the CUDA C gather/scatter kernels to PTX with NVRTC and
//! writes `$OUT_DIR/gather_scatter.ptx`, which the crate embeds (`include_str!`), so the plugin
//! needs no CUDA toolkit to build and only the driver (libcuda) to run them.
//!
//! NVRTC comes from PyPI's `nvidia-cuda-nvrtc-cu12` wheel (it runs without a GPU), found through
//! `BOUNCE_NVRTC_LIB` (the path of `libnvrtc.so.12`, set by ci/setup), else the repo's `.venv`,
//! else the system loader. Without it the build still succeeds with an empty PTX file and a
//! cargo warning (the plugin then says at run time that it has no kernels), except under CI
//! (`CI` is 1, true or yes, any case), where a missing NVRTC or a kernel that does not compile
//! must fail the build.
//!
//! Why NVRTC 12.0 (ci/setup pins 12.0.140): PTX carries an ISA version, and a driver loads only
//! ISA versions it knows. NVRTC 12.0 writes ISA 8.0, which every CUDA 12.x driver and the CUDA
//! 13 drivers load; a newer NVRTC writes a newer ISA that older 12.x drivers refuse.
//! Why `compute_80`: the kernels use plain loads and stores only, nothing of Hopper's (no TMA,
//! no clusters), so Ampere-level PTX loses nothing on an H100/H200 (the driver JIT-compiles it
//! for sm_90 at module load) and also runs on A100s.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::path::{Path, PathBuf};

/// The kernel sources, in build order.
const SOURCES: &[&str] = &["kernels/gather_scatter.cu"];
/// Virtual architecture the PTX targets (see the module docs).
const ARCH: &str = "--gpu-architecture=compute_80";

type Prog = *mut c_void;
type CreateFn = unsafe extern "C" fn(
    *mut Prog,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> c_int;
type CompileFn = unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> c_int;
type SizeFn = unsafe extern "C" fn(Prog, *mut usize) -> c_int;
type GetFn = unsafe extern "C" fn(Prog, *mut c_char) -> c_int;
type DestroyFn = unsafe extern "C" fn(*mut Prog) -> c_int;
type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;

include!("../ci/on_ci.rs");

/// Compiles every kernel source; called once from build.rs.
pub(crate) fn build() {
    println!("cargo:rerun-if-env-changed=BOUNCE_NVRTC_LIB");
    println!("cargo:rerun-if-env-changed=CI");
    for s in SOURCES {
        println!("cargo:rerun-if-changed={s}");
    }
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    // Under CI the kernels must be built.
    let ci = on_ci();
    for src in SOURCES {
        let stem = Path::new(src).file_stem().and_then(|s| s.to_str()).expect("kernel file name");
        let dest = out.join(format!("{stem}.ptx"));
        let ptx = match compile(src) {
            Ok(ptx) => ptx,
            Err(e) if ci => panic!("kernels: {src} did not compile to PTX under CI: {e}"),
            Err(e) => {
                println!(
                    "cargo:warning=kernels: built WITHOUT GPU kernels ({src}: {e}); run ci/setup or set BOUNCE_NVRTC_LIB"
                );
                String::new()
            }
        };
        std::fs::write(&dest, ptx).expect("writing the PTX into OUT_DIR");
    }
}

/// Where libnvrtc is: `BOUNCE_NVRTC_LIB`, the repo's venv, or the loader's search path.
fn nvrtc_candidates() -> Vec<PathBuf> {
    if let Some(p) = std::env::var_os("BOUNCE_NVRTC_LIB") {
        return vec![PathBuf::from(p)];
    }
    let mut v = Vec::new();
    let root = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    if let Ok(libs) = std::fs::read_dir(root.join(".venv/lib")) {
        for py in libs.flatten() {
            let lib = py.path().join("site-packages/nvidia/cuda_nvrtc/lib/libnvrtc.so.12");
            // Rerun when the wheel appears later (a missing path keeps the script stale).
            println!("cargo:rerun-if-changed={}", lib.display());
            if lib.exists() {
                v.push(lib);
            }
        }
    }
    v.push(PathBuf::from("libnvrtc.so.12"));
    v
}

/// Loads NVRTC; keeps its builtins library loaded beside it (NVRTC dlopens it by soname, which
/// the loader would not find in a wheel's folder that is not on its path).
fn load_nvrtc() -> Result<(libloading::Library, Option<libloading::Library>), String> {
    let mut errs = Vec::new();
    for cand in nvrtc_candidates() {
        let builtins = cand.parent().filter(|d| !d.as_os_str().is_empty()).and_then(|d| {
            let b = std::fs::read_dir(d)
                .ok()?
                .flatten()
                .find(|e| e.file_name().to_string_lossy().starts_with("libnvrtc-builtins.so"))?;
            // SAFETY: loading NVRTC's builtins runs only its (trusted, vendor) initialisers.
            unsafe { libloading::Library::new(b.path()) }.ok()
        });
        // SAFETY: as above, for NVRTC itself.
        match unsafe { libloading::Library::new(&cand) } {
            Ok(lib) => return Ok((lib, builtins)),
            Err(e) => errs.push(format!("{}: {e}", cand.display())),
        }
    }
    Err(format!("NVRTC not found ({})", errs.join("; ")))
}

/// Compiles one source file to PTX text.
fn compile(src: &str) -> Result<String, String> {
    let code = std::fs::read_to_string(src).map_err(|e| format!("reading {src}: {e}"))?;
    let (lib, _builtins) = load_nvrtc()?;
    // SAFETY: each symbol is NVRTC's public C API, with the signature its documentation gives.
    let (create, compile, log_size, log, ptx_size, ptx, destroy, version) = unsafe {
        let sym = |n: &[u8]| -> Result<*const c_void, String> {
            lib.get::<*const c_void>(n)
                .map(|s| *s)
                .map_err(|e| format!("NVRTC symbol {}: {e}", String::from_utf8_lossy(n)))
        };
        (
            std::mem::transmute::<*const c_void, CreateFn>(sym(b"nvrtcCreateProgram")?),
            std::mem::transmute::<*const c_void, CompileFn>(sym(b"nvrtcCompileProgram")?),
            std::mem::transmute::<*const c_void, SizeFn>(sym(b"nvrtcGetProgramLogSize")?),
            std::mem::transmute::<*const c_void, GetFn>(sym(b"nvrtcGetProgramLog")?),
            std::mem::transmute::<*const c_void, SizeFn>(sym(b"nvrtcGetPTXSize")?),
            std::mem::transmute::<*const c_void, GetFn>(sym(b"nvrtcGetPTX")?),
            std::mem::transmute::<*const c_void, DestroyFn>(sym(b"nvrtcDestroyProgram")?),
            std::mem::transmute::<*const c_void, VersionFn>(sym(b"nvrtcVersion")?),
        )
    };
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers.
    unsafe { version(&mut major, &mut minor) };
    let c_code = CString::new(code).map_err(|_| format!("{src} holds a NUL byte"))?;
    let c_name = CString::new(src).expect("path without NUL");
    let opts: Vec<CString> = [ARCH, "--std=c++17", "-lineinfo", "-default-device"]
        .iter()
        .map(|o| CString::new(*o).expect("option"))
        .collect();
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    let mut prog: Prog = std::ptr::null_mut();
    // SAFETY: valid C strings that outlive the calls; no headers (0, null, null); `prog` is
    // destroyed below on every path after creation succeeded.
    unsafe {
        let rc = create(&mut prog, c_code.as_ptr(), c_name.as_ptr(), 0, std::ptr::null(), std::ptr::null());
        if rc != 0 {
            return Err(format!("nvrtcCreateProgram failed ({rc})"));
        }
        let rc = compile(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr());
        let mut n = 0usize;
        log_size(prog, &mut n);
        let mut buf = vec![0u8; n.max(1)];
        log(prog, buf.as_mut_ptr().cast());
        let log_text = CStr::from_bytes_until_nul(&buf).map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
        if rc != 0 {
            destroy(&mut prog);
            return Err(format!("NVRTC {major}.{minor} could not compile {src} (error {rc}):\n{log_text}"));
        }
        for line in log_text.lines().filter(|l| !l.trim().is_empty()) {
            println!("cargo:warning=kernels: {src}: {line}");
        }
        let mut n = 0usize;
        ptx_size(prog, &mut n);
        let mut buf = vec![0u8; n.max(1)];
        ptx(prog, buf.as_mut_ptr().cast());
        destroy(&mut prog);
        let text = CStr::from_bytes_until_nul(&buf)
            .map_err(|_| "PTX without its NUL".to_string())?
            .to_string_lossy()
            .into_owned();
        if text.is_empty() {
            return Err("NVRTC returned empty PTX".into());
        }
        Ok(format!("// Built by NVRTC {major}.{minor} from {src}\n{text}"))
    }
}
