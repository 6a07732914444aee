//! Fuzzes allocate/free sequences against the arena's buddy allocator (see
//! `bounce_fuzz::buddy_ops::run_buddy`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    bounce_fuzz::buddy_ops::run_buddy(data);
});
