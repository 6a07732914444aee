//! The CUDA gather/scatter kernels and the batched-memcpy path against a CPU reference.
//!
//! Without a GPU (a developer machine, CI) every GPU test prints "skipped: no GPU (reason)" and
//! returns; the checks of the embedded PTX need no GPU and run everywhere (under CI, `CI` set
//! to 1, true or yes in any case, a build without kernels fails them). On a GPU: random piece
//! sizes (1 B .. 1 MiB) and alignments, poisoned destinations with guard bytes between pieces
//! (every byte outside the pieces must stay poison; each case runs under two poisons, so a byte
//! the copy forgot cannot pass by equalling the poison), long pieces split across many warps, strided runs, both plan
//! placements, prepared plans in VRAM and the batched memcpy. Region plans (the peer's scatter
//! plan behind the data, checked on the GPU): a valid random plan scatters byte-exact; every
//! forged plan is refused with not one destination byte changed; random forgeries get the
//! verdict of an independent CPU implementation of the rules. `bandwidth_report` (ignored by
//! default) prints the kernels' bandwidth against one device-to-device copy of the same bytes.

use std::sync::Arc;

use nixl_bounce::proto::CopyRun;
use nixl_bounce::sys::cuda::{
    CopyDir, CudaError, DeviceAlloc, DevicePlan, ExecContext, GATHER_KERNEL, Gpu, GpuTimer, Kernels, PLAN_CHECK_KERNEL,
    PlanPlacement, PlanPool, SCATTER_CHECKED_KERNEL, SCATTER_KERNEL, alloc_vram, batched_copy, current_device,
    embedded_ptx, encode_plan, gather, gather_planned, gpu_for_test, plan_bytes, region_plan_verdict,
    restore_thread_context, scatter, scatter_planned, scatter_region_plan, stage_plan,
};

/// SplitMix64: a seeded generator, so a failure names a reproducible case.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// The GPU and its kernels, or `None` after printing why the test is skipped (a failure instead
/// under `BOUNCE_REQUIRE_GPU=1`, which ci/gpu-kernels sets on the GPU machine).
fn gpu_or_skip(test: &str) -> Option<(Arc<Gpu>, Kernels)> {
    let gpu = gpu_for_test(test)?;
    // A GPU without kernels is a build defect, not a reason to skip.
    let k = Kernels::load(&gpu).expect("loading the embedded PTX on the GPU");
    Some((gpu, k))
}

include!("../ci/on_ci.rs");

#[test]
fn embedded_ptx_names_every_kernel_and_loads_on_cuda_12_and_13_drivers() {
    let Some(ptx) = embedded_ptx() else {
        assert!(!on_ci(), "CI is set but the plugin was built without kernels (NVRTC not found)");
        println!("skipped: built without kernels (NVRTC not found at build time)");
        return;
    };
    for k in [GATHER_KERNEL, SCATTER_KERNEL, PLAN_CHECK_KERNEL, SCATTER_CHECKED_KERNEL] {
        assert!(ptx.contains(&format!(".visible .entry {k}(")), "PTX lacks entry {k}");
    }
    // ISA 8.0 (NVRTC 12.0) loads on every CUDA 12.x and 13.x driver; a newer NVRTC would
    // silently raise it and break older 12.x drivers.
    let version = ptx.lines().find_map(|l| l.strip_prefix(".version ")).expect(".version line");
    let (major, minor) = version.trim().split_once('.').expect("major.minor");
    let v = (major.parse::<u32>().unwrap(), minor.parse::<u32>().unwrap());
    assert!(v <= (8, 0), "PTX ISA {version} is newer than CUDA 12.0 drivers load");
    assert!(ptx.lines().any(|l| l.trim() == ".target sm_80"), "PTX must target compute_80");
}

#[test]
fn opening_a_gpu_never_panics() {
    // On a machine without libcuda or without a device this is the `Unavailable` path: it must
    // be a typed error, not cudarc's loader panic.
    match Gpu::open(0) {
        Ok(gpu) => assert!(gpu.sm_count() > 0),
        Err(CudaError::Unavailable(why)) => println!("no GPU here: {why}"),
        Err(e) => panic!("unexpected error kind: {e}"),
    }
    assert!(matches!(Gpu::open(-1), Err(CudaError::Unavailable(_))));
}

/// One random test case: runs over a source and a destination buffer.
struct Case {
    runs: Vec<CopyRun>,
    /// Bytes of the user buffer.
    user_len: usize,
    /// Bytes of the region buffer.
    region_len: usize,
}

/// The length of a random piece: log-uniform over 1 B .. 1 MiB, half the time rounded to a
/// multiple of 16 so the vector path is exercised with whole vectors too.
/// A thread BOUNCE binds a GPU's context on gets back what it had when the call returns (the
/// FFI edge restores after every entry point): here a thread with no context, bound twice, has
/// none again after one restore, and a restore with nothing bound changes nothing.
#[test]
fn a_bound_context_is_put_back_to_what_the_thread_had() {
    let Some((gpu, _k)) = gpu_or_skip("a_bound_context_is_put_back_to_what_the_thread_had") else { return };
    std::thread::spawn(move || {
        assert_eq!(current_device().unwrap(), None, "a new thread has no context");
        gpu.bind().unwrap();
        gpu.bind().unwrap();
        assert_eq!(current_device().unwrap(), Some(gpu.ordinal()));
        restore_thread_context();
        assert_eq!(current_device().unwrap(), None, "the thread had no context before the binds");
        restore_thread_context();
        assert_eq!(current_device().unwrap(), None);
    })
    .join()
    .unwrap();
}

fn piece_len(rng: &mut Rng, max_log2: u64) -> u64 {
    let base = 1u64 << rng.below(max_log2 + 1);
    let jitter_log2 = rng.below(max_log2 + 1).min(12);
    let l = base + rng.below(1 << jitter_log2);
    let l = l.clamp(1, 1 << 20);
    if rng.below(2) == 0 { (l + 15) & !15 } else { l }
}

/// Builds runs whose "user" side lives in a buffer of `user_len` and whose region side in
/// `region_len`. The WRITTEN side (`region` for gather, `user` for scatter) gets pieces at
/// increasing, non-overlapping offsets with random gaps (the guard bytes); the READ side gets
/// random offsets. Alignments are random, equal modulo 16 half the time.
fn random_case(rng: &mut Rng, dir: CopyDir, n_runs: usize, max_log2: u64, read_len: u64, write_len: u64) -> Case {
    let mut cursor = 0u64;
    let mut runs = Vec::new();
    for _ in 0..n_runs {
        let len = piece_len(rng, max_log2);
        let count = if rng.below(4) == 0 { 1 + rng.below(16) as u32 } else { 1 };
        let gap = rng.below(48);
        let wstride = len + gap + rng.below(2) * 16;
        let rstride = if rng.below(3) == 0 { rng.below(len + 1) } else { len + rng.below(64) };
        let need_w = wstride * u64::from(count - 1) + len;
        let need_r = rstride * u64::from(count - 1) + len;
        let mut w = cursor + gap;
        if w + need_w > write_len || need_r > read_len {
            break;
        }
        let mut r = rng.below(read_len - need_r + 1);
        if rng.below(2) == 0 {
            // Same alignment modulo 16 on both sides: the vector path (with head/tail bytes).
            let mis = (w % 16 + 16 - r % 16) % 16;
            w += mis;
            if w + need_w > write_len {
                break;
            }
            if rng.below(2) == 0 {
                // Both fully 16-byte aligned.
                let a = (16 - w % 16) % 16;
                if w + a + need_w <= write_len && r >= r % 16 {
                    w += a;
                    r -= r % 16;
                }
            }
        }
        cursor = w + need_w;
        runs.push(match dir {
            CopyDir::Gather => {
                CopyRun { region_off: w, addr: r, len, count, region_stride: wstride, addr_stride: rstride }
            }
            CopyDir::Scatter => {
                CopyRun { region_off: r, addr: w, len, count, region_stride: rstride, addr_stride: wstride }
            }
        });
    }
    let (user_len, region_len) = match dir {
        CopyDir::Gather => (read_len as usize, write_len as usize),
        CopyDir::Scatter => (write_len as usize, read_len as usize),
    };
    Case { runs, user_len, region_len }
}

/// The path a case runs through.
#[derive(Debug, Clone, Copy)]
enum Path {
    Kernel(PlanPlacement),
    /// A [`DevicePlan`] uploaded once, launched with `gather_planned` / `scatter_planned`.
    Prepared,
    Batched,
}

/// Runs `case` through `path` on the GPU and checks the whole destination buffer against the
/// CPU reference, under two different poisons.
fn run_and_check(gpu: &Arc<Gpu>, k: &Kernels, ctx: &mut ExecContext, dir: CopyDir, path: Path, case: &Case, seed: u64) {
    let mut rng = Rng(seed ^ 0x5EED);
    let user = alloc_vram(gpu, case.user_len).unwrap();
    let region = alloc_vram(gpu, case.region_len).unwrap();
    let (src, dst): (&DeviceAlloc, &DeviceAlloc) = match dir {
        CopyDir::Gather => (&user, &region),
        CopyDir::Scatter => (&region, &user),
    };
    let src_bytes = rng.bytes(src.len());
    src.write(0, &src_bytes).unwrap();
    // The runs carry absolute user addresses; region offsets stay relative to `region`.
    let runs: Vec<CopyRun> = case.runs.iter().map(|r| CopyRun { addr: r.addr + user.ptr(), ..*r }).collect();
    let prepared = matches!(path, Path::Prepared).then(|| DevicePlan::upload(gpu, &runs).unwrap());
    for poison in [0xA5u8, 0x5A] {
        let mut want = vec![poison; dst.len()];
        for r in &case.runs {
            for (roff, uoff, len) in r.copies() {
                let (s, d) = match dir {
                    CopyDir::Gather => (uoff, roff),
                    CopyDir::Scatter => (roff, uoff),
                };
                want[d as usize..(d + len) as usize].copy_from_slice(&src_bytes[s as usize..(s + len) as usize]);
            }
        }
        dst.fill(poison).unwrap();
        // SAFETY: every piece lies inside `user` and `region` (built so by random_case with
        // these lengths), destinations do not overlap, both allocations outlive the
        // synchronize below, and the context is idle (synchronized after each use).
        let launched = unsafe {
            match (path, dir) {
                (Path::Kernel(p), CopyDir::Gather) => gather(ctx, k, &runs, region.ptr(), p),
                (Path::Kernel(p), CopyDir::Scatter) => scatter(ctx, k, &runs, region.ptr(), p),
                (Path::Prepared, CopyDir::Gather) => gather_planned(ctx, k, prepared.as_ref().unwrap(), region.ptr()),
                (Path::Prepared, CopyDir::Scatter) => scatter_planned(ctx, k, prepared.as_ref().unwrap(), region.ptr()),
                (Path::Batched, d) => batched_copy(ctx, d, &runs, region.ptr()),
            }
        };
        launched.unwrap();
        ctx.record().unwrap();
        ctx.synchronize().unwrap();
        assert!(ctx.is_done().unwrap(), "event must be complete after the stream synchronized");
        let mut got = vec![0u8; dst.len()];
        dst.read(0, &mut got).unwrap();
        if got != want {
            let first = got.iter().zip(&want).position(|(a, b)| a != b).unwrap();
            panic!(
                "{dir:?} via {path:?} (seed {seed}, poison {poison:#x}, {} runs): first wrong byte at {first}: got {:#x} want {:#x}",
                case.runs.len(),
                got[first],
                want[first]
            );
        }
    }
}

fn random_cases(test: &str, dir: CopyDir, path: Path) {
    let Some((gpu, k)) = gpu_or_skip(test) else { return };
    if matches!(path, Path::Batched) && !gpu.has_batched_copy() {
        println!("{test}: skipped: the driver ({}) has no cuMemcpyBatchAsync", gpu.driver_version());
        return;
    }
    let mut ctx = ExecContext::new(&gpu, 16).unwrap(); // small: exercises the plan growth
    let (user_len, region_len) = (24 << 20, 24 << 20);
    for seed in 0..24u64 {
        let mut rng = Rng(seed);
        // Small pieces in many runs, or big ones in few.
        let (n_runs, max_log2) = if seed % 3 == 0 { (12, 20) } else { (300, 12) };
        let (read_len, write_len) = match dir {
            CopyDir::Gather => (user_len as u64, region_len as u64),
            CopyDir::Scatter => (region_len as u64, user_len as u64),
        };
        let case = random_case(&mut rng, dir, n_runs, max_log2, read_len, write_len);
        assert!(!case.runs.is_empty());
        run_and_check(&gpu, &k, &mut ctx, dir, path, &case, seed);
    }
    println!("{test}: 24 random cases x 2 poisons byte-exact");
}

#[test]
fn gather_random_sizes_and_alignments_device_plan() {
    random_cases(
        "gather_random_sizes_and_alignments_device_plan",
        CopyDir::Gather,
        Path::Kernel(PlanPlacement::Device),
    );
}

#[test]
fn scatter_random_sizes_and_alignments_device_plan() {
    random_cases(
        "scatter_random_sizes_and_alignments_device_plan",
        CopyDir::Scatter,
        Path::Kernel(PlanPlacement::Device),
    );
}

#[test]
fn gather_random_sizes_and_alignments_host_plan() {
    random_cases("gather_random_sizes_and_alignments_host_plan", CopyDir::Gather, Path::Kernel(PlanPlacement::Host));
}

#[test]
fn scatter_random_sizes_and_alignments_host_plan() {
    random_cases("scatter_random_sizes_and_alignments_host_plan", CopyDir::Scatter, Path::Kernel(PlanPlacement::Host));
}

#[test]
fn gather_random_sizes_and_alignments_prepared_plan() {
    random_cases("gather_random_sizes_and_alignments_prepared_plan", CopyDir::Gather, Path::Prepared);
}

#[test]
fn scatter_random_sizes_and_alignments_prepared_plan() {
    random_cases("scatter_random_sizes_and_alignments_prepared_plan", CopyDir::Scatter, Path::Prepared);
}

#[test]
fn gather_random_sizes_and_alignments_batched_memcpy() {
    random_cases("gather_random_sizes_and_alignments_batched_memcpy", CopyDir::Gather, Path::Batched);
}

#[test]
fn scatter_random_sizes_and_alignments_batched_memcpy() {
    random_cases("scatter_random_sizes_and_alignments_batched_memcpy", CopyDir::Scatter, Path::Batched);
}

/// Long pieces (many tiles each, split across warps and blocks) with odd lengths and
/// misaligned ends, next to a run of tiny pieces and a run with no bytes.
#[test]
fn long_runs_split_across_blocks() {
    let Some((gpu, k)) = gpu_or_skip("long_runs_split_across_blocks") else { return };
    let mut ctx = ExecContext::new(&gpu, 4).unwrap();
    let case = Case {
        runs: vec![
            CopyRun { region_off: 3, addr: 19, len: (8 << 20) + 5, count: 1, region_stride: 0, addr_stride: 0 },
            CopyRun {
                region_off: (8 << 20) + 64,
                addr: 1 << 20,
                len: 1,
                count: 1000,
                region_stride: 3,
                addr_stride: 7,
            },
            CopyRun { region_off: 9 << 20, addr: 0, len: 0, count: 5, region_stride: 0, addr_stride: 0 },
            CopyRun {
                region_off: (9 << 20) + 16,
                addr: 64,
                len: (3 << 20) + 4096,
                count: 2,
                region_stride: (3 << 20) + 8192,
                addr_stride: 1 << 20,
            },
        ],
        user_len: 20 << 20,
        region_len: 20 << 20,
    };
    for dir in [CopyDir::Gather, CopyDir::Scatter] {
        let case = match dir {
            CopyDir::Gather => Case { runs: case.runs.clone(), ..case },
            // Swap sides so the written side stays non-overlapping.
            CopyDir::Scatter => Case {
                runs: case
                    .runs
                    .iter()
                    .map(|r| CopyRun {
                        region_off: r.addr,
                        addr: r.region_off,
                        region_stride: r.addr_stride,
                        addr_stride: r.region_stride,
                        ..*r
                    })
                    .collect(),
                ..case
            },
        };
        run_and_check(&gpu, &k, &mut ctx, dir, Path::Kernel(PlanPlacement::Device), &case, 7);
    }
    println!("long_runs_split_across_blocks: ok");
}

/// The bench's shapes as single strided runs (how the core describes regularly spaced
/// descriptors): 16384 x 4 KiB, 4096 x 16 KiB, 1024 x 64 KiB, both directions, every path.
#[test]
fn strided_runs_of_the_benchmark_shapes() {
    let Some((gpu, k)) = gpu_or_skip("strided_runs_of_the_benchmark_shapes") else { return };
    let mut ctx = ExecContext::new(&gpu, 1).unwrap();
    for (count, len) in [(16384u32, 4096u64), (4096, 16384), (1024, 65536)] {
        for dir in [CopyDir::Gather, CopyDir::Scatter] {
            // User pieces every other slot (scattered), the region packed.
            let run = CopyRun { region_off: 0, addr: 0, len, count, region_stride: len, addr_stride: 2 * len };
            let case = Case { runs: vec![run], user_len: 128 << 20, region_len: 64 << 20 };
            let mut paths =
                vec![Path::Kernel(PlanPlacement::Device), Path::Kernel(PlanPlacement::Host), Path::Prepared];
            if gpu.has_batched_copy() {
                paths.push(Path::Batched);
            }
            for p in paths {
                run_and_check(&gpu, &k, &mut ctx, dir, p, &case, u64::from(count));
            }
        }
    }
    println!("strided_runs_of_the_benchmark_shapes: ok");
}

/// Median of `n` timings of `f` (each one job between two events on `ctx`'s stream, waited for).
fn median_ms(ctx: &mut ExecContext, timer: &GpuTimer, n: usize, mut f: impl FnMut(&mut ExecContext)) -> f64 {
    f(ctx); // warm-up
    ctx.synchronize().unwrap();
    let mut v: Vec<f64> = (0..n)
        .map(|_| {
            timer.start(ctx).unwrap();
            f(ctx);
            f64::from(timer.stop_ms(ctx).unwrap())
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v[n / 2]
}

/// Kernel bandwidth against one device-to-device copy of the same 64 MiB (run on the GPU with
/// `--ignored --nocapture`). Each figure is the median device time of one job (for the device
/// plan: its host-to-device plan copy plus the kernel), so ratio = t(copy) / t(job).
#[test]
#[ignore = "benchmark: run on a GPU with --ignored --nocapture"]
fn bandwidth_report() {
    let Some((gpu, k)) = gpu_or_skip("bandwidth_report") else { return };
    let mut ctx = ExecContext::new(&gpu, 16384).unwrap();
    let timer = GpuTimer::new(&gpu).unwrap();
    let total: usize = 64 << 20;
    let user = alloc_vram(&gpu, 2 * total).unwrap();
    let region = alloc_vram(&gpu, total).unwrap();
    let other = alloc_vram(&gpu, total).unwrap();
    user.fill(1).unwrap();
    region.fill(2).unwrap();
    // Every address below lies inside `user`/`region`/`other`, which outlive the timings; each
    // job is waited for before the next one rewrites the plan.
    let t_ref = median_ms(&mut ctx, &timer, 21, |c| {
        // SAFETY: see above; `other` and `region` are distinct allocations of `total` bytes.
        unsafe { c.copy_d2d(other.ptr(), region.ptr(), total).unwrap() }
    });
    let gbs = |ms: f64| total as f64 / (ms * 1e-3) / 1e9;
    println!(
        "GPU {} (SMs {}), driver {}: one 64 MiB cuMemcpyDtoDAsync: {t_ref:.4} ms = {:.0} GB/s payload",
        gpu.ordinal(),
        gpu.sm_count(),
        gpu.driver_version(),
        gbs(t_ref)
    );
    println!("{:<8} {:<12} {:<9} {:<16} {:>9} {:>8} {:>7}", "dir", "shape", "layout", "path", "ms", "GB/s", "ratio");
    let mut rng = Rng(42);
    for (count, len) in [(16384u64, 4096u64), (4096, 16384), (1024, 65536)] {
        // Strided: one run (regularly spaced user pieces, every other slot). Shuffled: one run
        // per piece, the user slots in random order (no two pieces adjacent in the plan).
        let mut slots: Vec<u64> = (0..count).collect();
        for i in (1..slots.len()).rev() {
            slots.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let layouts: [(&str, Vec<CopyRun>); 2] = [
            (
                "strided",
                vec![CopyRun {
                    region_off: 0,
                    addr: user.ptr(),
                    len,
                    count: count as u32,
                    region_stride: len,
                    addr_stride: 2 * len,
                }],
            ),
            (
                "shuffled",
                slots
                    .iter()
                    .enumerate()
                    .map(|(i, &s)| CopyRun {
                        region_off: i as u64 * len,
                        addr: user.ptr() + 2 * s * len,
                        len,
                        count: 1,
                        region_stride: 0,
                        addr_stride: 0,
                    })
                    .collect(),
            ),
        ];
        for (layout, runs) in &layouts {
            let prepared = DevicePlan::upload(&gpu, runs).unwrap();
            // The plan upload alone (the part of "kernel dev-plan" that is not the kernel).
            let mut plan_bytes = 0;
            let up = median_ms(&mut ctx, &timer, 21, |c| {
                // SAFETY: the context is idle (each timing waits for its stream).
                plan_bytes = unsafe { stage_plan(c, runs, PlanPlacement::Device) }.unwrap().0.bytes;
            });
            println!(
                "{:<8} {:<12} {:<9} {:<16} {:>9.4}   ({plan_bytes} plan bytes host->device)",
                "plan",
                format!("{count}x{}KiB", len / 1024),
                layout,
                "upload only",
                up
            );
            for dir in [CopyDir::Gather, CopyDir::Scatter] {
                let mut paths: Vec<(&str, Path, usize)> = vec![
                    ("kernel dev-plan", Path::Kernel(PlanPlacement::Device), 21),
                    ("kernel host-plan", Path::Kernel(PlanPlacement::Host), 21),
                    ("kernel prepared", Path::Prepared, 21),
                ];
                if gpu.has_batched_copy() {
                    paths.push(("batched memcpy", Path::Batched, 5));
                }
                for (name, path, n) in paths {
                    let ms = median_ms(&mut ctx, &timer, n, |c| {
                        // SAFETY: see above.
                        unsafe {
                            match (path, dir) {
                                (Path::Kernel(p), CopyDir::Gather) => gather(c, &k, runs, region.ptr(), p),
                                (Path::Kernel(p), CopyDir::Scatter) => scatter(c, &k, runs, region.ptr(), p),
                                (Path::Prepared, CopyDir::Gather) => gather_planned(c, &k, &prepared, region.ptr()),
                                (Path::Prepared, CopyDir::Scatter) => scatter_planned(c, &k, &prepared, region.ptr()),
                                (Path::Batched, d) => batched_copy(c, d, runs, region.ptr()),
                            }
                            .unwrap()
                        }
                    });
                    println!(
                        "{:<8} {:<12} {:<9} {:<16} {:>9.4} {:>8.0} {:>7.3}",
                        format!("{dir:?}"),
                        format!("{count}x{}KiB", len / 1024),
                        layout,
                        name,
                        ms,
                        gbs(ms),
                        t_ref / ms
                    );
                }
            }
            // The same scatter from a region plan behind the data: snapshot, check, checked
            // scatter and verdict, with the plan placed the initiator's way (a device copy).
            let with_plan = alloc_vram(&gpu, total + prepared.len()).unwrap();
            // SAFETY: both ranges lie inside their allocations; waited for below.
            unsafe { ctx.copy_d2d(with_plan.ptr() + total as u64, prepared.ptr(), prepared.len()).unwrap() };
            ctx.synchronize().unwrap();
            let (starts, reach) = ([user.ptr()], [user.ptr() + 2 * total as u64]);
            let ms = median_ms(&mut ctx, &timer, 21, |c| {
                // SAFETY: the region and the allowed range (all of `user`) outlive the timings;
                // the context is idle (each timing waits for its stream).
                unsafe {
                    scatter_region_plan(c, &k, with_plan.ptr(), total as u64, prepared.shape().nruns, &starts, &reach)
                        .unwrap()
                }
            });
            assert!(region_plan_verdict(&ctx), "the benchmark's region plan must pass its check");
            println!(
                "{:<8} {:<12} {:<9} {:<16} {:>9.4} {:>8.0} {:>7.3}",
                "Scatter",
                format!("{count}x{}KiB", len / 1024),
                layout,
                "region plan",
                ms,
                gbs(ms),
                t_ref / ms
            );
        }
    }
}

// ---- Region plans: the peer's scatter plan behind the data, checked on the GPU ----

/// Region data bytes in the region plan tests (the limit P; a multiple of 8).
const RP_DATA: u64 = 4 << 20;
/// Bytes of the user (destination) buffer.
const RP_USER: u64 = 8 << 20;
/// Pieces are placed in user bytes [RP_MARGIN, RP_MARGIN + RP_WRITE): a forged run pointing
/// just outside them still points into the buffer, where a missed refusal shows.
const RP_MARGIN: u64 = 4096;
/// No more than RP_DATA: the pieces are disjoint there, so a plan's work sum stays <= P.
const RP_WRITE: u64 = RP_DATA;

/// The byte offsets of a run's fields in an encoded plan (plan.rs, kernels/gather_scatter.cu).
const F_REGION_OFF: usize = 0;
const F_ADDR: usize = 8;
const F_LEN: usize = 16;
const F_REGION_STRIDE: usize = 24;
const F_ADDR_STRIDE: usize = 32;
const F_COUNT: usize = 40;
const F_TILES_PER_PIECE: usize = 44;
/// Which fields are 32-bit.
const SMALL_FIELDS: [usize; 2] = [F_COUNT, F_TILES_PER_PIECE];

fn get64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}
fn set64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}
fn get32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}
fn set32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
/// Offset of field `f` of run `r`.
fn field(r: usize, f: usize) -> usize {
    48 * r + f
}
/// Offset of `first_tile[i]` in a plan of `n` runs.
fn first_tile(n: usize, i: usize) -> usize {
    48 * n + 8 * i
}

/// The encoded plan of `runs` (the existing encoder: the format is identical).
fn encoded(runs: &[CopyRun]) -> Vec<u8> {
    let mut b = vec![0u8; plan_bytes(runs.len())];
    encode_plan(runs, &mut b).unwrap();
    b
}

/// Rewrites `first_tile` to agree with the runs' count * tiles_per_piece, so that a forged
/// field elsewhere is the only broken rule.
fn fix_first_tile(b: &mut [u8], n: usize) {
    let mut t = 0u64;
    for r in 0..n {
        set64(b, first_tile(n, r), t);
        let tiles = u64::from(get32(b, field(r, F_COUNT))) * u64::from(get32(b, field(r, F_TILES_PER_PIECE)));
        t = t.wrapping_add(tiles);
    }
    set64(b, first_tile(n, n), t);
}

/// The rules of a region plan, written independently of the kernel (128-bit arithmetic
/// instead of overflow checks): which ones `plan` (n runs) breaks against the limit `p` and
/// the allowed ranges, by name, sorted. The rules on a run's extents are judged only for runs
/// of at least one piece.
fn cpu_broken_rules(plan: &[u8], n: usize, p: u64, starts: &[u64], reach: &[u64]) -> Vec<&'static str> {
    let wide = u128::from;
    let mut broken = Vec::new();
    if get64(plan, first_tile(n, 0)) != 0 {
        broken.push("first_tile");
    }
    let mut sum: u128 = 0;
    for r in 0..n {
        let [off, addr, len, rs, s] =
            [F_REGION_OFF, F_ADDR, F_LEN, F_REGION_STRIDE, F_ADDR_STRIDE].map(|f| wide(get64(plan, field(r, f))));
        let [count, tpp] = SMALL_FIELDS.map(|f| wide(u64::from(get32(plan, field(r, f)))));
        if count == 0 {
            broken.push("count");
        }
        if len == 0 {
            broken.push("len");
        }
        if tpp != len.div_ceil(4096) {
            broken.push("tiles_per_piece");
        }
        if count > 0 {
            if off + (count - 1) * rs + len > wide(p) {
                broken.push("region");
            }
            let end = addr + (count - 1) * s + len;
            let i = starts.partition_point(|&st| wide(st) <= addr);
            if end > wide(u64::MAX) || i == 0 || wide(reach[i - 1]) < end {
                broken.push("user");
            }
        }
        if count * len > wide(p) {
            broken.push("work");
        }
        sum += count * len;
        if wide(get64(plan, first_tile(n, r + 1))) != wide(get64(plan, first_tile(n, r))) + count * tpp {
            broken.push("first_tile");
        }
    }
    if sum > wide(p) {
        broken.push("sum");
    }
    broken.sort_unstable();
    broken.dedup();
    broken
}

/// The verdict the GPU must give: no rule broken.
fn cpu_accepts(plan: &[u8], n: usize, p: u64, starts: &[u64], reach: &[u64]) -> bool {
    cpu_broken_rules(plan, n, p, starts, reach).is_empty()
}

/// Each run's user extent [addr, end), sorted; and the allowed ranges that are exactly those
/// extents, as the core's ProvenRanges shapes them (starts ascending, reach a running maximum).
fn tight_ranges(runs: &[CopyRun]) -> (Vec<(u64, u64)>, Vec<u64>, Vec<u64>) {
    let mut ext: Vec<(u64, u64)> =
        runs.iter().map(|r| (r.addr, r.addr + u64::from(r.count - 1) * r.addr_stride + r.len)).collect();
    ext.sort_unstable();
    let starts = ext.iter().map(|e| e.0).collect();
    let mut far = 0;
    let reach = ext
        .iter()
        .map(|e| {
            far = far.max(e.1);
            far
        })
        .collect();
    (ext, starts, reach)
}

/// A random valid scatter of region data into user pieces at absolute addresses from
/// `user_base`: pieces disjoint and inside [RP_MARGIN, RP_MARGIN + RP_WRITE) of the user buffer.
fn random_region_runs(rng: &mut Rng, user_base: u64, n_runs: usize, max_log2: u64) -> Vec<CopyRun> {
    let case = random_case(rng, CopyDir::Scatter, n_runs, max_log2, RP_DATA, RP_WRITE);
    assert!(!case.runs.is_empty());
    let runs: Vec<CopyRun> = case.runs.iter().map(|r| CopyRun { addr: user_base + RP_MARGIN + r.addr, ..*r }).collect();
    let (_, starts, reach) = tight_ranges(&runs);
    let broken = cpu_broken_rules(&encoded(&runs), runs.len(), RP_DATA, &starts, &reach);
    assert!(broken.is_empty(), "the generator made an invalid plan (breaks {broken:?})");
    runs
}

/// The GPU side of the region plan tests: a user buffer, a region of RP_DATA random bytes
/// with room for a plan behind them, and a context.
struct RegionBench {
    gpu: Arc<Gpu>,
    k: Kernels,
    ctx: ExecContext,
    user: DeviceAlloc,
    region: DeviceAlloc,
    data: Vec<u8>,
}

impl RegionBench {
    fn new(gpu: Arc<Gpu>, k: Kernels, max_runs: usize) -> Self {
        let ctx = ExecContext::new(&gpu, 4).unwrap(); // small: the snapshot grows its buffers
        assert!(!region_plan_verdict(&ctx), "no verdict before any region plan launch");
        let user = alloc_vram(&gpu, RP_USER as usize).unwrap();
        let region = alloc_vram(&gpu, RP_DATA as usize + plan_bytes(max_runs)).unwrap();
        let data = Rng(0xDA7A).bytes(RP_DATA as usize);
        region.write(0, &data).unwrap();
        Self { gpu, k, ctx, user, region, data }
    }

    /// The user buffer after scattering the data by `runs` over `poison` (CPU reference).
    fn expected(&self, runs: &[CopyRun], poison: u8) -> Vec<u8> {
        let mut want = vec![poison; RP_USER as usize];
        for r in runs {
            for (roff, addr, len) in r.copies() {
                let (s, d, len) = (roff as usize, (addr - self.user.ptr()) as usize, len as usize);
                want[d..d + len].copy_from_slice(&self.data[s..s + len]);
            }
        }
        want
    }

    /// Writes `plan` behind the data (a host-to-device copy, as the peer's RDMA lands).
    fn place(&self, plan: &[u8]) {
        self.region.write(RP_DATA as usize, plan).unwrap();
    }

    /// Copies a prepared plan behind the data the initiator's way (one device-to-device copy).
    fn place_prepared(&mut self, plan: &DevicePlan) {
        // SAFETY: the plan's bytes and [RP_DATA, + plan.len()) of the region (sized for
        // max_runs runs; callers stay below) are valid and disjoint; waited for below.
        unsafe { self.ctx.copy_d2d(self.region.ptr() + RP_DATA, plan.ptr(), plan.len()).unwrap() };
        self.ctx.synchronize().unwrap();
    }

    /// Poisons the user buffer, runs the region plan of `nruns` runs behind the data against
    /// the allowed ranges, waits, and returns the verdict and the user buffer.
    fn scatter(&mut self, nruns: u32, starts: &[u64], reach: &[u64], poison: u8) -> (bool, Vec<u8>) {
        self.user.fill(poison).unwrap();
        // SAFETY: the region holds the data and room for the plan (sized in `new`; callers
        // pass nruns <= max_runs); every allowed range lies inside `user`, which is disjoint
        // from the region; both outlive the synchronize below; the context is idle (it is
        // synchronized after every use).
        unsafe { scatter_region_plan(&mut self.ctx, &self.k, self.region.ptr(), RP_DATA, nruns, starts, reach) }
            .unwrap();
        self.ctx.record().unwrap();
        self.ctx.synchronize().unwrap();
        assert!(self.ctx.is_done().unwrap());
        let mut got = vec![0u8; RP_USER as usize];
        self.user.read(0, &mut got).unwrap();
        (region_plan_verdict(&self.ctx), got)
    }

    /// `plan` must pass and scatter exactly what `runs` say (under two poisons).
    fn assert_accepted(&mut self, what: &str, runs: &[CopyRun], plan: &[u8], starts: &[u64], reach: &[u64]) {
        self.place(plan);
        for poison in [0xA5u8, 0x5A] {
            let (ok, got) = self.scatter(runs.len() as u32, starts, reach, poison);
            assert!(ok, "{what}: a valid plan was refused");
            assert_first_difference(what, &got, &self.expected(runs, poison));
        }
    }

    /// `plan` (n runs) must be refused with not one user byte changed.
    fn assert_refused(&mut self, what: &str, plan: &[u8], n: usize, starts: &[u64], reach: &[u64]) {
        assert!(!cpu_accepts(plan, n, RP_DATA, starts, reach), "{what}: the forgery is not one (test defect)");
        self.place(plan);
        let (ok, got) = self.scatter(n as u32, starts, reach, 0xC3);
        assert!(!ok, "{what}: a forged plan was accepted");
        assert_first_difference(what, &got, &vec![0xC3; RP_USER as usize]);
    }
}

fn assert_first_difference(what: &str, got: &[u8], want: &[u8]) {
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!("{what}: user byte {i} is {:#x}, want {:#x}", got[i], want[i]);
    }
}

/// The random valid plan of seed `seed`: a few long pieces, or many short ones (at most 400
/// runs, the region's room).
fn valid_test_runs(seed: u64, user_base: u64) -> Vec<CopyRun> {
    let mut rng = Rng(seed);
    let (n_runs, max_log2) = if seed % 4 == 0 { (12, 20) } else { (300, 12) };
    random_region_runs(&mut rng, user_base, n_runs, max_log2)
}

#[test]
fn region_plan_random_valid_plans_scatter_byte_exact() {
    let Some((gpu, k)) = gpu_or_skip("region_plan_random_valid_plans_scatter_byte_exact") else { return };
    let mut b = RegionBench::new(gpu, k, 400);
    for seed in 0..16u64 {
        let runs = valid_test_runs(seed, b.user.ptr());
        let (_, starts, reach) = tight_ranges(&runs);
        let plan = encoded(&runs);
        if seed % 2 == 0 {
            b.assert_accepted(&format!("seed {seed}"), &runs, &plan, &starts, &reach);
        } else {
            // The initiator's way: a prepared plan copied behind the data on the device. It
            // must be the encoder's bytes exactly, and scatter as they do.
            let prepared = DevicePlan::upload(&b.gpu, &runs).unwrap();
            assert_eq!(prepared.len(), plan.len());
            b.place_prepared(&prepared);
            let mut placed = vec![0u8; plan.len()];
            b.region.read(RP_DATA as usize, &mut placed).unwrap();
            assert!(placed == plan, "seed {seed}: the prepared plan's bytes differ from the encoder's");
            for poison in [0xA5u8, 0x5A] {
                let (ok, got) = b.scatter(runs.len() as u32, &starts, &reach, poison);
                assert!(ok, "seed {seed}: a valid prepared plan was refused");
                assert_first_difference(&format!("seed {seed} (prepared)"), &got, &b.expected(&runs, poison));
            }
        }
    }
    println!("region_plan_random_valid_plans_scatter_byte_exact: 16 plans x 2 poisons byte-exact");
}

/// One plan of the forgery list: its bytes and allowed ranges, and what must happen.
struct Forged {
    what: &'static str,
    plan: Vec<u8>,
    n: usize,
    starts: Vec<u64>,
    reach: Vec<u64>,
    expect: Expect,
}

/// What a plan of the forgery list must do.
enum Expect {
    /// Pass, and scatter exactly as these runs say.
    Scatters(Vec<CopyRun>),
    /// Be refused: it breaks exactly these rules (names of [`cpu_broken_rules`]).
    Breaks(&'static [&'static str]),
}

/// Hand-made forgeries of a random valid plan over user memory at `user_base`, each breaking
/// one rule, next to the valid plans at the edges they step over.
fn forged_plans(user_base: u64) -> Vec<Forged> {
    use Expect::{Breaks, Scatters};
    let mut rng = Rng(99);
    let runs = random_region_runs(&mut rng, user_base, 40, 14);
    let n = runs.len();
    assert!(n >= 3, "the base plan needs a few runs");
    let (_, starts, reach) = tight_ranges(&runs);
    let plan = encoded(&runs);
    let mut out = Vec::new();
    let mut push = |what, plan: Vec<u8>, n, starts: &[u64], reach: &[u64], expect| {
        out.push(Forged { what, plan, n, starts: starts.to_vec(), reach: reach.to_vec(), expect });
    };
    let with = |f: &dyn Fn(&mut Vec<CopyRun>)| {
        let mut r = runs.clone();
        f(&mut r);
        let p = encoded(&r);
        (r, p)
    };
    // The untouched plan passes: each refusal below is its forgery's doing.
    push("base", plan.clone(), n, &starts, &reach, Scatters(runs.clone()));

    // The user side: one byte past / before an allowed range (the last run has no range after
    // it, the first none before it), one byte longer, no range at all.
    push("last run one byte past its range", with(&|r| r[n - 1].addr += 1).1, n, &starts, &reach, Breaks(&["user"]));
    push("first run one byte before its range", with(&|r| r[0].addr -= 1).1, n, &starts, &reach, Breaks(&["user"]));
    push("last run one byte longer", with(&|r| r[n - 1].len += 1).1, n, &starts, &reach, Breaks(&["user"]));
    push("no allowed range at all", plan.clone(), n, &[], &[], Breaks(&["user"]));

    // The region side: ending exactly at P passes, one byte further is refused.
    let extent = |r: &CopyRun| u64::from(r.count - 1) * r.region_stride + r.len;
    let (edge, p) = with(&|r| r[1].region_off = RP_DATA - extent(&r[1]));
    push("run reading up to P exactly", p, n, &starts, &reach, Scatters(edge));
    let p = with(&|r| r[1].region_off = RP_DATA - extent(&r[1]) + 1).1;
    push("run reading one byte past P", p, n, &starts, &reach, Breaks(&["region"]));

    // Empty runs.
    push("a run of zero pieces", with(&|r| r[2].count = 0).1, n, &starts, &reach, Breaks(&["count"]));
    push("a run of empty pieces", with(&|r| r[2].len = 0).1, n, &starts, &reach, Breaks(&["len"]));

    // tiles_per_piece off by one either way, and zero (the scatter would divide by it), with
    // first_tile made consistent again so that only this rule breaks.
    let longest = (0..n).max_by_key(|&r| runs[r].len).unwrap();
    let tpp = get32(&plan, field(longest, F_TILES_PER_PIECE));
    for (what, v) in [("tiles_per_piece + 1", tpp + 1), ("tiles_per_piece - 1", tpp - 1), ("tiles_per_piece 0", 0)] {
        let mut p = plan.clone();
        set32(&mut p, field(longest, F_TILES_PER_PIECE), v);
        fix_first_tile(&mut p, n);
        push(what, p, n, &starts, &reach, Breaks(&["tiles_per_piece"]));
    }

    // first_tile inconsistent: the total one more or one less (the scatter would walk past the
    // last run, or skip a tile), one middle entry off, everything shifted (the differences
    // right, first_tile[0] != 0).
    for (what, at, delta) in
        [("first_tile total + 1", n, 1u64), ("first_tile total - 1", n, u64::MAX), ("first_tile[1] + 1", 1, 1)]
    {
        let mut p = plan.clone();
        let v = get64(&p, first_tile(n, at)).wrapping_add(delta);
        set64(&mut p, first_tile(n, at), v);
        push(what, p, n, &starts, &reach, Breaks(&["first_tile"]));
    }
    let mut p = plan.clone();
    for i in 0..=n {
        let v = get64(&p, first_tile(n, i)) + 1;
        set64(&mut p, first_tile(n, i), v);
    }
    push("first_tile shifted by one", p, n, &starts, &reach, Breaks(&["first_tile"]));

    // Strides whose products or sums wrap around 2^64 to land back in range (a check with
    // wrapping arithmetic would pass every one of these); the other side's stride 0, so that
    // its pieces stay where the run's first piece was.
    let p = with(&|r| {
        r[1].count = 2;
        r[1].region_stride = 0u64.wrapping_sub(r[1].len) + 8;
        r[1].addr_stride = 0;
    });
    push("region stride wrapping past 2^64", p.1, n, &starts, &reach, Breaks(&["region"]));
    let p = with(&|r| {
        r[1].count = 3;
        r[1].region_stride = 1 << 63;
        r[1].addr_stride = 0;
    });
    push("region stride times count wrapping to 0", p.1, n, &starts, &reach, Breaks(&["region"]));
    let p = with(&|r| {
        r[1].count = 2;
        r[1].addr_stride = 0u64.wrapping_sub(r[1].len);
        r[1].region_stride = 0;
    });
    push("user stride wrapping past 2^64", p.1, n, &starts, &reach, Breaks(&["user"]));
    let p = with(&|r| {
        r[1].count = 3;
        r[1].addr_stride = 1 << 63;
        r[1].region_stride = 0;
    });
    push("user stride times count wrapping to 0", p.1, n, &starts, &reach, Breaks(&["user"]));

    // The work bound: the sum over runs of count * len <= P. 8-byte pieces all read from
    // region byte 0 and written to one place: no other rule stops a huge count.
    let dst = user_base + RP_MARGIN;
    let piece =
        |addr: u64, count: u32| CopyRun { region_off: 0, addr, len: 8, count, region_stride: 0, addr_stride: 0 };
    let (starts, reach) = ([dst, dst + 64], [dst + 8, dst + 72]);
    let per_p = (RP_DATA / 8) as u32;
    let one = vec![piece(dst, per_p)];
    push("one run, count * len == P", encoded(&one), 1, &starts, &reach, Scatters(one));
    let one = [piece(dst, per_p + 1)];
    push("one run, count * len == P + 8", encoded(&one), 1, &starts, &reach, Breaks(&["sum", "work"]));
    // Two runs each within P, together over it: only the sum catches them.
    let two = vec![piece(dst, per_p / 2), piece(dst + 64, per_p / 2)];
    push("two runs, sum == P", encoded(&two), 2, &starts, &reach, Scatters(two));
    let two = [piece(dst, per_p / 2 + 1), piece(dst + 64, per_p / 2 + 1)];
    push("two runs, sum == P + 16", encoded(&two), 2, &starts, &reach, Breaks(&["sum"]));
    out
}

/// Runs everywhere (no GPU): each hand-made forgery breaks exactly the rule it is named for, as
/// written on the CPU, and each edge plan keeps them all, so the GPU tests test what they say.
#[test]
fn region_plan_forgeries_break_one_rule_each_and_edges_keep_them() {
    let list = forged_plans(0x7f00_0000_0000);
    for f in &list {
        let broken = cpu_broken_rules(&f.plan, f.n, RP_DATA, &f.starts, &f.reach);
        match f.expect {
            Expect::Scatters(_) => assert!(broken.is_empty(), "{}: breaks {broken:?}", f.what),
            Expect::Breaks(rules) => assert_eq!(broken, rules, "{}", f.what),
        }
    }
    assert!(list.iter().filter(|f| matches!(f.expect, Expect::Breaks(_))).count() >= 20, "the list shrank");
    // The GPU test's valid plans are valid (random_region_runs checks each it makes).
    for seed in 0..16 {
        assert!(valid_test_runs(seed, 0x7f00_0000_0000).len() <= 400);
    }
}

#[test]
fn region_plan_forgeries_are_refused_and_write_nothing() {
    let Some((gpu, k)) = gpu_or_skip("region_plan_forgeries_are_refused_and_write_nothing") else { return };
    let mut b = RegionBench::new(gpu, k, 64);
    let list = forged_plans(b.user.ptr());
    for f in &list {
        match &f.expect {
            Expect::Scatters(runs) => b.assert_accepted(f.what, runs, &f.plan, &f.starts, &f.reach),
            Expect::Breaks(_) => b.assert_refused(f.what, &f.plan, f.n, &f.starts, &f.reach),
        }
    }
    // Arguments that name no plan are refused before anything is queued, and the verdict of
    // an earlier pass does not survive them.
    let base = &list[0];
    let Expect::Scatters(runs) = &base.expect else { panic!("the list starts with its valid base") };
    b.assert_accepted("base again", runs, &base.plan, &base.starts, &base.reach);
    // SAFETY: as in RegionBench::scatter; nothing is queued for zero runs.
    let r = unsafe { scatter_region_plan(&mut b.ctx, &b.k, b.region.ptr(), RP_DATA, 0, &base.starts, &base.reach) };
    assert!(matches!(r, Err(CudaError::Plan(_))), "zero runs: {r:?}");
    assert!(!region_plan_verdict(&b.ctx), "a refused call must not leave the last pass standing");
    println!("region_plan_forgeries_are_refused_and_write_nothing: {} plans ok", list.len());
}

/// One random forgery of the valid plan `base` (n runs, m allowed ranges): one field of one
/// run, or one first_tile entry, set to a neighbour of its value or an extreme, first_tile made
/// consistent again half the time; and how many of the ranges to keep (now and then one fewer).
/// Returns the plan, the ranges to keep, and what was done.
fn random_forgery(rng: &mut Rng, base: &[u8], n: usize, m: usize) -> (Vec<u8>, usize, String) {
    let mut p = base.to_vec();
    let r = rng.below(n as u64) as usize;
    // A field of run r (kinds 0..=6), or an entry of first_tile (kind 7).
    let kind = rng.below(8) as usize;
    let pick = rng.below(6) as usize;
    let fields = [F_REGION_OFF, F_ADDR, F_LEN, F_REGION_STRIDE, F_ADDR_STRIDE, F_COUNT, F_TILES_PER_PIECE];
    let at = if kind == 7 { first_tile(n, rng.below(n as u64 + 1) as usize) } else { field(r, fields[kind]) };
    if kind == 5 || kind == 6 {
        let v = get32(&p, at);
        set32(&mut p, at, [v.wrapping_add(1), v.wrapping_sub(1), 0, u32::MAX, 1 << 31, rng.next() as u32][pick]);
    } else {
        let v = get64(&p, at);
        set64(&mut p, at, [v.wrapping_add(1), v.wrapping_sub(1), 0, u64::MAX, 1 << 63, rng.next()][pick]);
    }
    if kind != 7 && rng.below(2) == 0 {
        fix_first_tile(&mut p, n);
    }
    let keep = if m > 0 && rng.below(8) == 0 { m - 1 } else { m };
    (p, keep, format!("run {r}, byte {at} (kind {kind}, pick {pick}), {keep} of {m} ranges"))
}

/// Random single-field forgeries of random valid plans: the GPU's verdict equals the CPU
/// rules', a refused plan writes nothing, and an accepted one writes only allowed bytes.
#[test]
fn region_plan_random_forgeries_agree_with_the_cpu_rules() {
    let Some((gpu, k)) = gpu_or_skip("region_plan_random_forgeries_agree_with_the_cpu_rules") else { return };
    let mut b = RegionBench::new(gpu, k, 64);
    let mut rng = Rng(7);
    let (mut accepted, mut refused) = (0, 0);
    for round in 0..10u64 {
        let (n_runs, max_log2) = (1 + rng.below(48) as usize, 1 + rng.below(16));
        let runs = random_region_runs(&mut rng, b.user.ptr(), n_runs, max_log2);
        let n = runs.len();
        let (ext, starts, reach) = tight_ranges(&runs);
        let mut allowed = vec![false; RP_USER as usize];
        for &(s, e) in &ext {
            allowed[(s - b.user.ptr()) as usize..(e - b.user.ptr()) as usize].fill(true);
        }
        let base = encoded(&runs);
        for case in 0..24u64 {
            let (p, m, what) = random_forgery(&mut rng, &base, n, starts.len());
            let (starts, reach) = (&starts[..m], &reach[..m]);
            let what = format!("round {round} case {case}: {what}");
            let want = cpu_accepts(&p, n, RP_DATA, starts, reach);
            b.place(&p);
            let (ok, got) = b.scatter(n as u32, starts, reach, 0x3C);
            assert_eq!(ok, want, "{what}: GPU verdict {ok}, CPU rules {want}");
            if ok {
                accepted += 1;
                if let Some(i) = (0..got.len()).find(|&i| !allowed[i] && got[i] != 0x3C) {
                    panic!("{what}: an accepted plan wrote user byte {i}, outside every allowed range");
                }
            } else {
                refused += 1;
                assert!(got.iter().all(|&x| x == 0x3C), "{what}: a refused plan wrote");
            }
        }
    }
    // Both outcomes occur, or the comparison proved little.
    assert!(accepted > 0 && refused > 0, "accepted {accepted}, refused {refused}");
    println!("region_plan_random_forgeries_agree_with_the_cpu_rules: {accepted} accepted, {refused} refused");
}

/// Runs wherever a C++ compiler is, GPU or not: the check kernel's own source, compiled for the
/// host with the CUDA built-ins it uses stubbed (kernels/host/plan_check_host.cpp, its threads
/// run one after another), gives the CPU rules' verdict on every hand-made plan and on
/// thousands of random forgeries.
#[test]
fn region_plan_check_kernel_compiled_for_the_host_agrees_with_the_cpu_rules() {
    const TEST: &str = "region_plan_check_kernel_compiled_for_the_host_agrees_with_the_cpu_rules";
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let dir = std::env::temp_dir().join(format!("bounce-plan-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // The sources travel inside the test binary: ci/gpu-kernels runs it on a machine without
    // this checkout.
    std::fs::create_dir_all(dir.join("host")).unwrap();
    std::fs::write(dir.join("gather_scatter.cu"), include_str!("../kernels/gather_scatter.cu")).unwrap();
    let src = dir.join("host/plan_check_host.cpp");
    std::fs::write(&src, include_str!("../kernels/host/plan_check_host.cpp")).unwrap();
    let exe = dir.join("plan_check_host");
    match std::process::Command::new(&cxx).args(["-O2", "-std=c++17", "-o"]).arg(&exe).arg(&src).output() {
        Err(e) => {
            assert!(!on_ci(), "CI is set but no C++ compiler ({cxx}: {e})");
            println!("{TEST}: skipped: no C++ compiler ({cxx}: {e})");
            return;
        }
        Ok(o) => assert!(o.status.success(), "{cxx} {}:\n{}", src.display(), String::from_utf8_lossy(&o.stderr)),
    }
    // The hand-made list, then random valid plans, each followed by forgeries of it.
    let user_base = 0x7f00_0000_0000u64;
    /// A plan to judge, named, with its run count and allowed ranges.
    type Case = (String, Vec<u8>, usize, Vec<u64>, Vec<u64>);
    let mut cases: Vec<Case> =
        forged_plans(user_base).into_iter().map(|f| (f.what.to_string(), f.plan, f.n, f.starts, f.reach)).collect();
    let mut rng = Rng(0x4057);
    for round in 0..200 {
        let (n_runs, max_log2) = (1 + rng.below(48) as usize, 1 + rng.below(16));
        let runs = random_region_runs(&mut rng, user_base, n_runs, max_log2);
        let (_, starts, reach) = tight_ranges(&runs);
        let base = encoded(&runs);
        for case in 0..50 {
            let (p, m, what) = random_forgery(&mut rng, &base, runs.len(), starts.len());
            cases.push((
                format!("round {round} case {case}: {what}"),
                p,
                runs.len(),
                starts[..m].to_vec(),
                reach[..m].to_vec(),
            ));
        }
        cases.push((format!("round {round}: the valid plan"), base, runs.len(), starts, reach));
    }
    let mut input = Vec::new();
    for (_, plan, n, starts, reach) in &cases {
        input.extend((*n as u32).to_le_bytes());
        input.extend(RP_DATA.to_le_bytes());
        input.extend((starts.len() as u32).to_le_bytes());
        input.extend(plan);
        starts.iter().chain(reach).for_each(|v| input.extend(v.to_le_bytes()));
    }
    let path = dir.join("cases.bin");
    std::fs::write(&path, &input).unwrap();
    let out = std::process::Command::new(&exe).arg(&path).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.stdout.len(), cases.len(), "one verdict per case");
    let mut accepted = 0;
    for ((what, plan, n, starts, reach), &v) in cases.iter().zip(&out.stdout) {
        let want = cpu_accepts(plan, *n, RP_DATA, starts, reach);
        assert_eq!(v == b'1', want, "{what}: kernel verdict {}, CPU rules {want}", v == b'1');
        accepted += usize::from(want);
    }
    let _ = std::fs::remove_dir_all(&dir);
    // Both outcomes in numbers, or the agreement proved little.
    assert!(accepted >= 200 && cases.len() - accepted >= 1000, "accepted {accepted} of {}", cases.len());
    println!("{TEST}: {} cases agree ({accepted} accepted)", cases.len());
}

/// A plan pool (the same-host path's, one plan per request): plans uploaded through it scatter
/// byte-exact, a dropped plan's buffer serves the next plan of a similar size (the same device
/// address, no cuMemAlloc or cuMemFree), one far smaller or larger gets a buffer of its own,
/// and what the pool keeps is bounded.
#[test]
fn pooled_plans_scatter_exact_and_their_buffers_serve_the_next_plans() {
    let Some((gpu, k)) = gpu_or_skip("pooled_plans_scatter_exact_and_their_buffers_serve_the_next_plans") else {
        return;
    };
    let pool = PlanPool::new(&gpu).unwrap();
    let mut ctx = ExecContext::new(&gpu, 16).unwrap();
    let (piece, len) = (4096u64 + 5, 4 << 20);
    let region = alloc_vram(&gpu, len).unwrap();
    let user = alloc_vram(&gpu, 2 * len).unwrap();
    let mut rng = Rng(77);
    let src = rng.bytes(len);
    region.write(0, &src).unwrap();
    // `n` pieces of the region scattered to every other slot of `user`, in reverse order.
    let runs = |n: u64| -> Vec<CopyRun> {
        (0..n)
            .map(|i| CopyRun {
                region_off: i * piece,
                addr: user.ptr() + (n - 1 - i) * 2 * piece,
                len: piece,
                count: 1,
                region_stride: 0,
                addr_stride: 0,
            })
            .collect()
    };
    let mut scatter_and_check = |plan: &DevicePlan, n: u64| {
        user.fill(0xEE).unwrap();
        // SAFETY: every piece lies inside `region` and `user` (n * 2 * piece <= 2 * len), the
        // destinations do not overlap, and both allocations and the plan outlive the
        // synchronize below; the context is idle.
        unsafe { scatter_planned(&mut ctx, &k, plan, region.ptr()) }.unwrap();
        ctx.record().unwrap();
        ctx.synchronize().unwrap();
        let mut got = vec![0u8; 2 * len];
        user.read(0, &mut got).unwrap();
        for (i, &g) in got.iter().enumerate() {
            let (slot, at) = (i as u64 / (2 * piece), i as u64 % (2 * piece));
            let want = if slot < n && at < piece { src[((n - 1 - slot) * piece + at) as usize] } else { 0xEE };
            assert_eq!(g, want, "{n} pieces: byte {i}");
        }
    };
    let first = pool.upload(&runs(300)).unwrap();
    scatter_and_check(&first, 300);
    let addr = first.ptr();
    drop(first);
    assert_eq!(pool.kept(), 1, "the dropped plan's buffer is kept");
    let again = pool.upload(&runs(280)).unwrap();
    assert_eq!(again.ptr(), addr, "a plan of a similar size takes the kept buffer");
    assert_eq!(pool.kept(), 0);
    scatter_and_check(&again, 280);
    drop(again);
    let small = pool.upload(&runs(3)).unwrap();
    assert_ne!(small.ptr(), addr, "a far smaller plan leaves the large kept buffer alone");
    assert_eq!(pool.kept(), 1);
    scatter_and_check(&small, 3);
    drop(small);
    assert_eq!(pool.kept(), 2);
    // Bounded: more buffers than the pool keeps are freed on drop.
    let many: Vec<DevicePlan> = (0..40).map(|_| pool.upload(&runs(300)).unwrap()).collect();
    drop(many);
    assert!(pool.kept() <= 32, "{} kept", pool.kept());
}
