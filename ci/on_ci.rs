// The one CI rule of the Rust checks, included (`include!`) where it is needed: the build
// script (kernels/build_ptx.rs), the integration tests (tests/nixl_sys_agents.rs,
// tests/cuda_kernels.rs) and the unit tests (src/shell/cma.rs). ci/test and
// tests/python/conftest.py spell the same rule for the shell and for pytest.

/// True under CI (the variable CI is 1, true or yes, any case), where a check that cannot run
/// is a failure.
fn on_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes"))
}
