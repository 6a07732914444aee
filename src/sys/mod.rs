//! What the shell calls out to, below the safe shell: today the CUDA driver ([`cuda`]).
//!
//! Public only so that integration tests (tests/cuda_kernels.rs) can drive the kernels on a GPU;
//! it is not part of the plugin's API and is hidden from the docs.

pub mod cuda;
