//! Fuzzes operation sequences against the whole endpoint (see `bounce_fuzz::run`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    bounce_fuzz::run(data);
});
