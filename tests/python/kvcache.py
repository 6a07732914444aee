"""A paged KV cache laid out as vLLM lays it out, for the issue-13 tests and benchmark.

One side's cache: one registration per layer (a numpy host buffer each); a layer is
[K | V] x `blocks` x `block_bytes`. A request is a set of random block ids on the side that
holds the KV (prefill / context: `src_blocks`) and as many on the side that receives it
(decode / generation: `dst_blocks`); its descriptor list has one descriptor per
layer x K/V x block, in that order, the two sides' lists pairing block i with block i
(16 layers x 2 x 32 blocks of 4 KiB = 1024 descriptors per request).

Byte patterns: every block row (one K or V block of one layer) holds
`tile(seed, layer) XOR row_key(seed, layer, row)` in 64-bit words, both drawn from
nixlkit.pattern. Generating 64 MiB of nixlkit.pattern per side takes seconds on the 2-core CI
machine; this costs one pass at memory speed, and still a word of a block equals the word at
the same offset of another block, layer or seed only with probability 2^-64, so a block written
to the wrong place, from the wrong place, or not at all is caught at every word.

Layers may live in files mapped shared (`shared_layers`, e.g. under /dev/shm), so that the
target process can look at the initiator's destination blocks at the very moment it sees the
notification (`KvCache(..., attached=attach_layers(...))`): that is how the pull tests prove the
notification comes only after the READ's data landed.

The checker keeps, per block row, where its bytes must come from (a seed and a row: the row's
`origin`), regenerates the expected bytes and compares every byte of every layer: rows a
transfer wrote must hold the source's bytes, every other row must still hold its own.
"""
import functools
import mmap
from dataclasses import dataclass

import numpy as np

import nixlkit

WORD = np.uint64


@dataclass(frozen=True)
class KvLayout:
    """The shape of one side's cache (both sides of a transfer use the same)."""
    layers: int = 16
    blocks: int = 512
    block_bytes: int = 4096

    @property
    def rows(self):
        """Block rows per layer: K blocks then V blocks."""
        return 2 * self.blocks

    @property
    def layer_bytes(self):
        return self.rows * self.block_bytes



@functools.lru_cache(maxsize=256)
def _keys(seed, layer, layout):
    """(tile words, one key per row) of `seed`'s layer, from nixlkit.pattern."""
    words = layout.block_bytes // 8
    raw = nixlkit.pattern(seed * 4096 + layer, 8 * (words + layout.rows)).view(WORD)
    return raw[:words], raw[words:]


def rows_bytes(seed, layer, rows, layout):
    """The bytes `seed`'s cache holds in block rows `rows` of `layer`, shape (len(rows), words)."""
    tile, keys = _keys(seed, layer, layout)
    return tile[None, :] ^ keys[np.asarray(rows, dtype=np.int64)][:, None]


@dataclass(frozen=True)
class KvRequest:
    index: int
    src_blocks: np.ndarray  # on the side holding the KV (prefill / context)
    dst_blocks: np.ndarray  # on the side receiving it (decode / generation)

    @property
    def notif(self):
        return f"req-{self.index}".encode()


def make_requests(layout, count=8, blocks=32, seed=0):
    """`count` requests of `blocks` random block ids each on both sides, distinct across the
    requests (so one batch of all of them writes every destination once) and interleaved."""
    if count * blocks > layout.blocks:
        raise ValueError(f"{count} x {blocks} blocks do not fit a cache of {layout.blocks}")
    rng = np.random.default_rng(seed)
    src = rng.permutation(layout.blocks)[:count * blocks].reshape(count, blocks)
    dst = rng.permutation(layout.blocks)[:count * blocks].reshape(count, blocks)
    return [KvRequest(i, src[i], dst[i]) for i in range(count)]


def rows_of(layout, blocks):
    """Block rows of `blocks`, K then V (the descriptor order within a layer)."""
    blocks = np.asarray(blocks, dtype=np.int64)
    return np.concatenate([blocks, blocks + layout.blocks])


def block_descs(layout, bases, blocks):
    """One (addr, len, dev) per layer x K/V x block, in that order, for the cache whose layers
    start at `bases`. A batch is the concatenation of its requests' lists."""
    offs = rows_of(layout, blocks) * layout.block_bytes
    return [(base + int(o), layout.block_bytes, 0) for base in bases for o in offs]


@dataclass
class CheckReport:
    """What a full check found: wrong bytes in rows a transfer wrote (`bad_written`, in
    `bad_written_rows` rows) and changed bytes in rows nothing may touch (`bad_untouched`)."""
    written_rows: int = 0
    bad_written: int = 0
    bad_written_rows: int = 0
    bad_untouched: int = 0
    bad_untouched_rows: int = 0
    first_bad: str = ""

    @property
    def clean(self):
        return self.bad_written == 0 and self.bad_untouched == 0

    def as_dict(self):
        return dict(self.__dict__, clean=self.clean)


def layer_paths(prefix, layout):
    return [f"{prefix}-{layer}" for layer in range(layout.layers)]


def _map(path, layout, create):
    with open(path, "w+b" if create else "r+b") as f:
        if create:
            f.truncate(layout.layer_bytes)
        m = mmap.mmap(f.fileno(), layout.layer_bytes, mmap.MAP_SHARED)
    return np.frombuffer(m, dtype=WORD)  # the array keeps the mapping alive


def shared_layers(prefix, layout):
    """New layers in files `prefix`-<layer> mapped shared (another process may attach them)."""
    return [_map(p, layout, True) for p in layer_paths(prefix, layout)]


def attach_layers(prefix, layout):
    """Another process's `shared_layers`, mapped here too: the same bytes, live."""
    return [_map(p, layout, False) for p in layer_paths(prefix, layout)]


class KvCache:
    """One side's cache: the layers (filled with `seed`'s bytes) and, per block row, where its
    bytes must come from now (`origin_seed`, `origin_row`) and whether a transfer wrote it.
    `layers` (from shared_layers) are filled; `attached` ones (attach_layers: a view of another
    process's cache, which holds `seed`'s bytes) are only read."""

    def __init__(self, layout, seed, layers=None, attached=None):
        self.layout = layout
        words = layout.layer_bytes // 8
        if attached is not None:
            self.layers = attached
            self._model(seed)
            return
        self.layers = layers or [np.empty(words, dtype=WORD) for _ in range(layout.layers)]
        self.fill(seed)

    def fill(self, seed):
        """Refills every layer with `seed`'s bytes; nothing counts as written any more."""
        L = self.layout
        every = np.arange(L.rows)
        for layer, buf in enumerate(self.layers):
            buf.reshape(L.rows, -1)[:] = rows_bytes(seed, layer, every, L)
        self._model(seed)

    def _model(self, seed):
        L = self.layout
        every = np.arange(L.rows)
        self.seed = seed
        self.origin_seed = np.full((L.layers, L.rows), seed, dtype=np.int64)
        self.origin_row = np.tile(every, (L.layers, 1))
        self.written = np.zeros((L.layers, L.rows), dtype=bool)

    def register(self, agent, backend):
        """One registration per layer, as vLLM registers its KV tensors."""
        return [agent.register_memory(
            agent.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM"),
            backends=[backend]) for buf in self.layers]

    @property
    def bases(self):
        """The layers' addresses (what a peer needs, with the layout, to name our blocks)."""
        return [buf.ctypes.data for buf in self.layers]

    def descs(self, blocks):
        return block_descs(self.layout, self.bases, blocks)

    def expect_copy(self, dst_blocks, src_seed, src_blocks):
        """Records that `dst_blocks` here must now hold `src_seed`'s `src_blocks` (every layer,
        K to K and V to V)."""
        d = rows_of(self.layout, dst_blocks)
        s = rows_of(self.layout, src_blocks)
        self.origin_seed[:, d] = src_seed
        self.origin_row[:, d] = s
        self.written[:, d] = True

    def expect_request(self, req, src_seed):
        self.expect_copy(req.dst_blocks, src_seed, req.src_blocks)

    def overwrite(self, blocks, seed):
        """Overwrites `blocks` here (every layer) with `seed`'s bytes, as a prefill worker
        reusing a request's blocks once the decode side said it has them."""
        L = self.layout
        rows = rows_of(L, blocks)
        for layer, buf in enumerate(self.layers):
            buf.reshape(L.rows, -1)[rows] = rows_bytes(seed, layer, rows, L)
        self.origin_seed[:, rows] = seed
        self.origin_row[:, rows] = rows

    def _expected(self, layer, rows):
        L = self.layout
        seeds = self.origin_seed[layer, rows]
        src_rows = self.origin_row[layer, rows]
        out = np.empty((len(rows), L.block_bytes // 8), dtype=WORD)
        for s in np.unique(seeds):
            pick = seeds == s
            out[pick] = rows_bytes(int(s), layer, src_rows[pick], L)
        return out

    def bad_bytes(self, blocks):
        """Wrong bytes in `blocks` (every layer) now: 0 when they all hold what they must."""
        L = self.layout
        rows = rows_of(L, blocks)
        bad = 0
        for layer, buf in enumerate(self.layers):
            got = buf.reshape(L.rows, -1)[rows].view(np.uint8)
            bad += int(np.count_nonzero(got != self._expected(layer, rows).view(np.uint8)))
        return bad

    def check(self):
        """Compares every byte of every layer with what it must hold."""
        L = self.layout
        rep = CheckReport(written_rows=int(self.written.sum()))
        every = np.arange(L.rows)
        for layer, buf in enumerate(self.layers):
            got = buf.reshape(L.rows, -1).view(np.uint8)
            diff = got != self._expected(layer, every).view(np.uint8)
            per_row = np.count_nonzero(diff, axis=1)
            w = self.written[layer]
            rep.bad_written += int(per_row[w].sum())
            rep.bad_written_rows += int(np.count_nonzero(per_row[w]))
            rep.bad_untouched += int(per_row[~w].sum())
            rep.bad_untouched_rows += int(np.count_nonzero(per_row[~w]))
            if not rep.first_bad and per_row.any():
                row = int(np.flatnonzero(per_row)[0])
                kv, block = divmod(row, L.blocks)
                rep.first_bad = (f"layer {layer} {'KV'[kv]} block {block} "
                                 f"({'written' if w[row] else 'untouched'}): {int(per_row[row])} bytes")
        return rep


class GpuKvCache(KvCache):
    """A cache whose layers live in GPU memory, one torch tensor per layer on GPU `dev` (as a
    framework's KV tensors do). The host layers are its image: filling and overwriting write
    them and upload; checks download first. Registered as VRAM, one registration per layer."""

    def __init__(self, layout, seed, dev=0):
        import torch
        self.dev = dev
        self.gpu = [torch.empty(layout.layer_bytes, dtype=torch.uint8, device=f"cuda:{dev}")
                    for _ in range(layout.layers)]
        super().__init__(layout, seed)

    def _upload(self):
        import torch
        for h, g in zip(self.layers, self.gpu):
            g.copy_(torch.from_numpy(h.view(np.uint8)))
        torch.cuda.synchronize(self.dev)

    def _download(self):
        import torch
        torch.cuda.synchronize(self.dev)
        for h, g in zip(self.layers, self.gpu):
            h.view(np.uint8)[:] = g.cpu().numpy()

    def fill(self, seed):
        super().fill(seed)
        self._upload()

    def overwrite(self, blocks, seed):
        super().overwrite(blocks, seed)
        self._upload()

    def register(self, agent, backend):
        return [agent.register_memory(
            agent.get_reg_descs([(g.data_ptr(), g.numel(), self.dev, "")], "VRAM"),
            backends=[backend]) for g in self.gpu]

    @property
    def bases(self):
        return [g.data_ptr() for g in self.gpu]

    def descs(self, blocks):
        return [(a, n, self.dev) for a, n, _ in block_descs(self.layout, self.bases, blocks)]

    def bad_bytes(self, blocks):
        self._download()
        return super().bad_bytes(blocks)

    def check(self):
        self._download()
        return super().check()
