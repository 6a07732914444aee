//! The CUDA gather/scatter kernels and the batched-memcpy path against a CPU reference.
//!
//! Without a GPU (a developer machine, CI) every GPU test prints "skipped: no GPU (reason)" and
//! returns; the checks of the embedded PTX need no GPU and run everywhere (under `CI=true` a
//! build without kernels fails them). On a GPU: random piece sizes (1 B .. 1 MiB) and
//! alignments, poisoned destinations with guard bytes between pieces (every byte outside the
//! pieces must stay poison; each case runs under two poisons, so a byte the copy forgot cannot
//! pass by equalling the poison), long pieces split across many warps, strided runs, both plan
//! placements and the batched memcpy. `bandwidth_report` (ignored by default) prints the kernels'
//! bandwidth against one device-to-device copy of the same bytes.

use std::sync::Arc;

use nixl_bounce::proto::CopyRun;
use nixl_bounce::sys::cuda::{
    CopyDir, CudaError, DeviceAlloc, ExecContext, GATHER_KERNEL, Gpu, GpuTimer, Kernels, PlanPlacement, SCATTER_KERNEL,
    alloc_vram, batched_copy, embedded_ptx, gather, scatter, stage_plan,
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

/// The GPU and its kernels, or `None` after printing why the test is skipped.
fn gpu_or_skip(test: &str) -> Option<(Arc<Gpu>, Kernels)> {
    match Gpu::open(0) {
        Ok(gpu) => {
            // A GPU without kernels is a build defect, not a reason to skip.
            let k = Kernels::load(&gpu).expect("loading the embedded PTX on the GPU");
            Some((gpu, k))
        }
        Err(e) => {
            println!("{test}: skipped: no GPU ({e})");
            None
        }
    }
}

fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

#[test]
fn embedded_ptx_names_both_kernels_and_loads_on_cuda_12_and_13_drivers() {
    let Some(ptx) = embedded_ptx() else {
        assert!(!under_ci(), "CI=true but the plugin was built without kernels (NVRTC not found)");
        println!("skipped: built without kernels (NVRTC not found at build time)");
        return;
    };
    for k in [GATHER_KERNEL, SCATTER_KERNEL] {
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
            let mut paths = vec![Path::Kernel(PlanPlacement::Device), Path::Kernel(PlanPlacement::Host)];
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
        }
    }
}
