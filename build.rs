//! Compiles the C++ shim (NIXL's engine class over our own ABI declarations) into a static
//! library linked into the plugin, and the CUDA kernels to embedded PTX (kernels/build_ptx.rs).

#[path = "kernels/build_ptx.rs"]
mod kernels;

fn main() {
    kernels::build();
    for f in ["cpp/src/bounce_engine.cpp", "cpp/include/nixl_abi.h", "cpp/include/bounce_ffi.h"] {
        println!("cargo:rerun-if-changed={f}");
    }
    cc::Build::new()
        .cpp(true)
        .std("c++20")
        .file("cpp/src/bounce_engine.cpp")
        .include("cpp/include")
        .flag_if_supported("-fvisibility=hidden")
        .flag("-Wall")
        .flag("-Wextra")
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .compile("bounce_shim");
}
