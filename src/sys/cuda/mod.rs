//! The only cudarc user: the CUDA driver, loaded at run time.
//!
//! Layers, bottom up: [`Gpu`] (is libcuda there, is there a device, the primary context),
//! [`alloc_vram`] (the one place VRAM is taken, cuMemAlloc), [`Kernels`] (the embedded PTX of
//! `kernels/`, loaded as a module), [`ExecPool`] (execution contexts: a high-priority stream,
//! an event and plan buffers each), and the typed launches [`gather`], [`scatter`] and
//! [`batched_copy`] (the driver's cuMemcpyBatchAsync, for comparison with the kernels); prepared
//! plans kept in VRAM ([`DevicePlan`], [`gather_planned`], [`scatter_planned`]); and region
//! plans, the peer's scatter plan checked and used on the GPU ([`scatter_region_plan`]); and
//! CUDA IPC exports and mappings of registrations for the same-host path ([`ipc_export`],
//! [`IpcMapping`]).
//!
//! Nothing here links against CUDA: cudarc resolves each driver symbol when first called, and
//! [`Gpu::open`] checks that libcuda can be loaded before the first call (cudarc's loader panics
//! when it cannot), so a machine without CUDA gets [`CudaError::Unavailable`].

mod batch;
mod device_plan;
mod driver;
mod error;
mod exec;
mod ipc;
mod launch;
mod memory;
mod module;
mod plan;
mod region_plan;

pub use batch::batched_copy;
pub use device_plan::{DevicePlan, PlanPool, gather_planned, scatter_planned};
pub use driver::{Gpu, current_device, device_count, device_of, gpu_for_test, restore_thread_context};
pub use error::CudaError;
pub use exec::{ExecContext, ExecPool, GpuTimer};
pub use ipc::{IpcExport, IpcMapping, ipc_export};
pub use launch::{CopyDir, PlanPlacement, gather, scatter, stage_plan};
pub use memory::{DeviceAlloc, PinnedHost, alloc_vram};
pub use module::{GATHER_KERNEL, Kernels, PLAN_CHECK_KERNEL, SCATTER_CHECKED_KERNEL, SCATTER_KERNEL, embedded_ptx};
pub use plan::{PlanShape, TILE, encode as encode_plan, plan_bytes};
pub use region_plan::{REGION_PLAN_MAX_DATA, region_plan_verdict, scatter_region_plan};
