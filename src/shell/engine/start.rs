//! Starting the bounce path when NIXL first asks for our connection info: which GPU, the arenas
//! (allocated and registered with the inner engine), their copy engines, the control channel,
//! the mailbox, our capabilities, and the reactor over all of them.

use super::*;

/// A control channel as started: the channel, the endpoint to advertise (ZMQ), and which
/// peers' endpoints it has reached (ZMQ).
struct Control {
    channel: Box<dyn ControlChannel>,
    endpoint: Vec<u8>,
    links: Option<Arc<Links>>,
}

impl Engine {
    /// The GPUs whose memory arenas should be (none: host memory only), as `bounce_arena_mem`
    /// and `bounce_arena_gpus` ask. With `current`: `vram` and `both` take the GPU of the CUDA
    /// context current on this thread (the application's), else GPU 0; `auto` takes the current
    /// context's GPU only (a process that has not used a GPU keeps a host arena, and no CUDA
    /// context is created for it). A list, or `all`, names the GPUs under any of the three (at
    /// most [`MAX_ARENA_GPUS`]); one that cannot be opened is left out with a warning. Without
    /// a usable driver or GPU no GPU arena can be had: one log line, then host memory for
    /// `auto` and `both`, no bounce path for `vram` (see [`Engine::attach`], which also gives
    /// `auto` a host arena when the GPU arena cannot start).
    pub(super) fn choose_gpus(agent: &str, config: &Config) -> Vec<Arc<Gpu>> {
        if !config.enabled || config.arena_mem == ArenaMem::Dram {
            return Vec::new();
        }
        let named = config.arena_gpus.named();
        let explicit = named || matches!(config.arena_mem, ArenaMem::Vram | ArenaMem::Both);
        let unusable = |e: &cuda::CudaError| match config.arena_mem {
            ArenaMem::Vram => {
                tracing::warn!(agent, error = %e, "bounce_arena_mem=vram but CUDA is unusable: no bounce path");
            }
            ArenaMem::Both => {
                tracing::warn!(agent, error = %e, "bounce_arena_mem=both but CUDA is unusable: a host arena only");
            }
            _ if named => {
                tracing::warn!(agent, error = %e, "bounce_arena_gpus names GPUs but CUDA is unusable: a host arena");
            }
            _ => tracing::debug!(agent, error = %e, "no CUDA: host-memory arena"),
        };
        let ordinals: Vec<i32> = match &config.arena_gpus {
            ArenaGpus::Current => match (cuda::current_device(), explicit) {
                (Ok(Some(dev)), _) => vec![dev],
                (Ok(None), true) => vec![0],
                (Ok(None), false) => return Vec::new(),
                (Err(e), _) => {
                    unusable(&e);
                    return Vec::new();
                }
            },
            ArenaGpus::All => match cuda::device_count() {
                Ok(n) => {
                    if n as usize > MAX_ARENA_GPUS {
                        tracing::warn!(
                            agent,
                            gpus = n,
                            "bounce_arena_gpus=all: arenas on the first {MAX_ARENA_GPUS} GPUs only"
                        );
                    }
                    (0..n).take(MAX_ARENA_GPUS).collect()
                }
                Err(e) => {
                    unusable(&e);
                    return Vec::new();
                }
            },
            ArenaGpus::Listed(list) => {
                if let Err(e) = cuda::device_count() {
                    unusable(&e);
                    return Vec::new();
                }
                list.iter().map(|&o| i32::from(o)).collect()
            }
        };
        let mut gpus = Vec::with_capacity(ordinals.len());
        for ordinal in ordinals {
            match Gpu::open(ordinal) {
                Ok(gpu) => gpus.push(gpu),
                Err(e) if named => {
                    tracing::warn!(agent, gpu = ordinal, error = %e, "cannot open a GPU bounce_arena_gpus names: no arena on it");
                }
                Err(e) => {
                    tracing::warn!(agent, gpu = ordinal, error = %e, "cannot open the GPU for the arena: host-memory arena");
                }
            }
        }
        gpus
    }

    /// The control channel `bounce_control` names.
    fn control_channel(&self, shim: Shim) -> Result<Control> {
        Ok(match self.config.control {
            ControlKind::Zmq => {
                let peers = Arc::clone(&self.peers);
                let resolve = Box::new(move |peer: &str| peers.endpoint(peer));
                let links = Arc::new(Links::default());
                let z = ZmqChannel::bind(
                    &self.agent,
                    &self.config.zmq_host,
                    resolve,
                    Arc::clone(&links),
                    Arc::clone(&self.stats),
                )?;
                tracing::info!(agent = self.agent, endpoint = z.endpoint(), "ZMQ control channel bound");
                let endpoint = z.endpoint().as_bytes().to_vec();
                Control { channel: Box::new(z), endpoint, links: Some(links) }
            }
            ControlKind::Ucx => Control {
                channel: Box::new(UcxChannel::new(shim, Arc::clone(&self.mail))),
                endpoint: Vec::new(),
                links: None,
            },
        })
    }

    /// The options an arena of memory `mem` runs under: the GPU arena's beside a host one
    /// (`both`), else the engine's.
    pub(super) fn arena_config(&self, mem: MemKind) -> &Config {
        match (mem, &self.gpu_config) {
            (MemKind::Vram, Some(c)) => c,
            _ => &self.config,
        }
    }

    /// The arenas `bounce_arena_mem` and `bounce_arena_gpus` ask for, allocated and registered,
    /// in the order of our capabilities: the first (host memory, or the first GPU's for
    /// `vram`/`auto` with a GPU) must be had; each further one (a GPU arena beside a host one,
    /// `both`, or on a further listed GPU) is given up with a warning, and that GPU's memory
    /// then goes to UCX between hosts.
    fn make_arenas(&self, shim: &Shim) -> Result<Vec<Arena>> {
        let (first, further) = match (self.gpus.split_first(), &self.gpu_config) {
            (Some((gpu, rest)), None) => (Arena::new_gpu(shim, gpu, self.config.arena_size)?, rest),
            _ => (Arena::new(shim, self.config.arena_size)?, &self.gpus[..]),
        };
        let mut arenas = vec![first];
        let size = self.arena_config(MemKind::Vram).arena_size;
        for gpu in further {
            match Arena::new_gpu(shim, gpu, size) {
                Ok(a) => arenas.push(a),
                Err(e) => tracing::warn!(
                    agent = self.agent,
                    gpu = gpu.ordinal(),
                    error = %e,
                    "no arena on this GPU: its memory's transfers between hosts stay on UCX"
                ),
            }
        }
        Ok(arenas)
    }

    /// The copy engine of `arena`: CUDA streams for GPU memory, CPU workers for host memory.
    fn copier_for(&self, arena: &Arena, shared: &Arc<Shared>) -> Result<Box<dyn CopyEngine>> {
        let config = self.arena_config(arena.place().mem);
        Ok(match arena.device() {
            Some(vram) => {
                let path = match config.gpu_copy {
                    GpuCopy::Kernel => CopyPath::Kernel(PlanPlacement::Device),
                    GpuCopy::Batched => CopyPath::Batched,
                };
                let contexts = config.copy_workers.max(1) as usize;
                let engine = CudaCopyEngine::new(Arc::clone(vram), contexts, path)
                    .map_err(|e| Error::Arena { len: arena.len(), why: crate::shell::error::ArenaFault::Gpu(e) })?;
                tracing::info!(agent = self.agent, contexts, path = ?engine.path(), "CUDA copy engine");
                Box::new(engine)
            }
            None => {
                let host =
                    HostArena { base: arena.base(), len: arena.len(), streaming_scatter: config.streaming_scatter };
                let waker = Arc::clone(shared);
                let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
                let linger = crate::shell::reactor::hot_spin(cores);
                Box::new(CpuEngine::start(
                    config.copy_workers,
                    host,
                    INLINE_MAX_BYTES,
                    linger,
                    Arc::clone(&shared.stats),
                    move || {
                        waker.copy_finished();
                    },
                )?)
            }
        })
    }

    /// Our capabilities: every arena with its own options' usable bytes and max chunk (`None`
    /// for no arena or more than the wire's 16; we make at most 16: a host arena and 15 GPUs).
    fn capabilities_of(&self, arenas: &[Arena]) -> Option<Capabilities> {
        let listed = arenas
            .iter()
            .map(|a| {
                let c = self.arena_config(a.place().mem);
                a.advert(c.arena_usable_capacity(), c.max_chunk_size)
            })
            .collect();
        Some(Capabilities {
            wire_version: u16::from(bounce_proto::wire::WIRE_VERSION),
            control: self.config.control,
            session: self.session,
            arenas: Arenas::new(listed)?,
            endpoint: Vec::new(),
            mailbox: None,
            mailbox_base: 0,
            mailbox_len: 0,
            mailbox_key: Vec::new(),
            // Our leases on the regions we grant run by it (peers keep our credits within it).
            request_timeout_ms: u64::try_from(self.config.request_timeout.as_millis()).unwrap_or(u64::MAX).max(1),
        })
    }

    /// Each arena with its copy engine. A GPU arena beside a host one whose copy engine cannot
    /// start (no kernels in this build, a module the driver refuses, no VRAM for the plan
    /// buffers) is given up like one that could not be allocated, and the host arena goes on
    /// alone; the first arena's failure is the bounce path's (every arena is deregistered).
    fn arenas_with_copiers(&self, shim: &Shim, shared: &Arc<Shared>) -> Result<Vec<(Arena, Box<dyn CopyEngine>)>> {
        let mut out = Vec::new();
        for (i, a) in self.make_arenas(shim)?.into_iter().enumerate() {
            match self.copier_for(&a, shared) {
                Ok(c) => out.push((a, c)),
                Err(e) if i > 0 && a.device().is_some() => {
                    tracing::warn!(
                        agent = self.agent,
                        gpu = a.place().dev,
                        error = %e,
                        "no copy engine for this GPU's arena: its memory's transfers between hosts stay on UCX"
                    );
                    a.deregister(shim);
                }
                Err(e) => {
                    for (done, _) in &out {
                        done.deregister(shim);
                    }
                    a.deregister(shim);
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    pub(super) fn start_bounce(&self, shim: Shim) -> Result<Bounce> {
        // Bound before the arenas: a failure here costs no registration to undo.
        let Control { channel: control, endpoint: control_endpoint, links } = self.control_channel(shim)?;
        let shared = Arc::new(Shared::new(
            Arc::clone(&self.stats),
            Arc::clone(&self.peers),
            Arc::clone(&self.registry),
            self.mail.doorbell(),
        ));
        let (arenas, copiers): (Vec<Arena>, Vec<Box<dyn CopyEngine>>) =
            self.arenas_with_copiers(&shim, &shared)?.into_iter().unzip();
        let Some(mut caps) = self.capabilities_of(&arenas) else {
            for a in &arenas {
                a.deregister(&shim);
            }
            return Err(Error::Arenas("none, or more than the wire's 16"));
        };
        let places: Vec<ArenaPlace> = arenas.iter().map(Arena::place).collect();
        // The mailbox one-way peers READ our answers from, and the fetch area our own one-way
        // READs land in (bounce_proto::oneway): host memory registered on its own, whatever
        // the arenas' memory, so the reactor writes records and reads answers in place.
        let layout = OneWayLayout::for_config(&self.config);
        let one_way = OneWayArea::new(&shim, &layout)
            .map_err(|e| tracing::warn!(agent = self.agent, error = %e, "no mailbox: bouncing two way only"))
            .ok();
        caps.endpoint = control_endpoint;
        if let Some(area) = &one_way {
            (caps.mailbox_base, caps.mailbox_len, caps.mailbox_key) = area.advert();
            caps.mailbox = Some(layout.advertised());
        }
        let started =
            shim.conn_info().map_err(|status| Error::Inner { op: "getConnInfo", status }).and_then(|endpoint| {
                let parts = arenas
                    .iter()
                    .zip(copiers)
                    .map(|(a, copier)| {
                        let c = self.arena_config(a.place().mem);
                        ArenaPart {
                            arena: LocalArena { place: a.place(), base: a.base(), md: a.md() },
                            copier,
                            geometry: (c.arena_usable_capacity(), c.arena_granularity, c.max_chunk_size),
                        }
                    })
                    .collect();
                let parts = Parts {
                    agent: self.agent.clone(),
                    session: self.session,
                    endpoint,
                    arenas: parts,
                    one_way: one_way.as_ref().map(OneWayArea::view),
                    data: Box::new(ShimPath::new(shim, Arc::clone(&self.mail))),
                    control,
                    // The inner engine hands over everything it delivered at once; a socket
                    // is read in bounded batches.
                    control_budget: match self.config.control {
                        ControlKind::Zmq => SOCKET_POLL_BATCH,
                        ControlKind::Ucx => usize::MAX,
                    },
                };
                Reactor::start(&self.config, Arc::clone(&shared), parts)
            });
        let reactor = match started {
            Ok(r) => r,
            Err(e) => {
                for a in &arenas {
                    a.deregister(&shim);
                }
                if let Some(area) = &one_way {
                    area.deregister(&shim);
                }
                return Err(e);
            }
        };
        if self.config.control == ControlKind::Ucx {
            if let Some(t) = reactor.thread() {
                self.mail.accept_control(t);
            }
        }
        let bounce = Bounce { reactor, arenas, places, one_way, caps, links };
        // Registrations made before the bounce path started, each to the arena that serves it.
        for (md, r) in self.registry.all() {
            if let (Some(arena), Some(d)) = (bounce.arena_serving(&r), self.keys.local(md)) {
                shared.inbox.push(Cmd::Registered(d, r.addr, r.len, arena));
            }
        }
        self.stats.arenas.store(bounce.arenas.len() as u64, Ordering::Relaxed);
        for a in &bounce.arenas {
            let place = a.place();
            if place.mem == MemKind::Vram && self.stats.arena_gpu.load(Ordering::Relaxed) == 0 {
                // The first GPU arena's: one GPU arena per engine unless bounce_arena_gpus lists more.
                self.stats.arena_gpu.store(place.dev.saturating_add(1), Ordering::Relaxed);
            }
            // Reading /proc/self/smaps costs time in a large process: only when it will be logged.
            let huge = tracing::enabled!(tracing::Level::INFO).then(|| a.huge_bytes()).flatten();
            tracing::info!(
                agent = self.agent,
                arena = a.len(),
                mem = ?place.mem,
                gpu = place.dev,
                huge_pages = huge,
                "bounce path ready"
            );
        }
        Ok(bounce)
    }
}
