"""Byte-level gather/scatter of runs between a page buffer and a staging buffer.

A run is ``(from_offset, to_offset, length)`` in bytes, exactly the rows of the transfer plan
(``state/plan.py`` produces them as an int64 numpy array ``[R, 3]``)::

    pack:    staging[to : to + length] = src[from : from + length]      (from = src, to = staging)
    unpack:  dst[to : to + length]     = staging[from : from + length]  (from = staging, to = dst)

Runs are checked on the host before anything is copied: every run must lie inside both buffers
and destination runs must not overlap (each destination byte is written at most once). When
every offset, length and buffer is a multiple of 8, 4 or 2 bytes, the copy moves words of that
size instead of single bytes; the result is the same.

The per-step path checks runs ONCE: :func:`prepare_runs` checks them against the two buffer
sizes and copies them to the device as a :class:`RunTemplate`; :func:`pack` / :func:`unpack`
given a template only compare buffer sizes and addresses on the host (tensor metadata, no device
work) and launch one kernel, with no host-to-device copy and no synchronisation. Given a numpy
array or tensor instead, they build a template on the spot (a check and a copy per call).

:func:`copy_runs_host` is the host copy of the data plane's staged transfers
(``statebridge.connector.data``): plain numpy on CPU buffers, no checks (its caller checked the
runs once), fast for hundreds of thousands of tiny runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from numpy.lib.stride_tricks import as_strided

from statebridge.errors import ShapeError
from statebridge.kernels._common import check_same_device, reference_of
from statebridge.kernels._launch import Launcher

__all__ = ["RunTemplate", "GatherTemplate", "copy_runs_host", "gather", "gather_ref", "pack", "pack_ref",
           "prepare_gather", "prepare_runs", "unpack", "unpack_ref"]

_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))
_WORD_DTYPE = dict(_WORDS)


@triton.jit
def _pack_kernel(p_from, p_to, p_runs, WORD: tl.constexpr, BLOCK: tl.constexpr):
    # Serves pack and unpack alike (only the roles of the buffers differ). The runs are in bytes;
    # the buffers are viewed as WORD-byte words, and WORD divides every offset and length.
    # One program: one run x a strided share of its BLOCK-word pieces.
    i_r = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1).to(tl.int64)
    n_c = tl.num_programs(1).to(tl.int64)
    from_off = tl.load(p_runs + i_r * 3) // WORD
    to_off = tl.load(p_runs + i_r * 3 + 1) // WORD
    length = tl.load(p_runs + i_r * 3 + 2) // WORD
    for start in range(i_c * BLOCK, length, n_c * BLOCK):
        o_x = start + tl.arange(0, BLOCK)
        m_x = o_x < length
        b_x = tl.load(p_from + from_off + o_x, mask=m_x)
        tl.store(p_to + to_off + o_x, b_x, mask=m_x)


# The launches, declared once (the compile check builds every variant): the word size picks
# the buffers' view dtype (1: uint8, 2: int16, 4: int32, 8: int64).
_BLOCK = 1024
_MAX_PROGRAMS_PER_RUN = 256
_PACK = Launcher(
    _pack_kernel,
    name="pack.copy_runs",
    constexprs=dict(WORD=tuple(w for w, _ in reversed(_WORDS)), BLOCK=(_BLOCK,)),
    dtypes={("p_from", "p_to"): tuple(d for _, d in reversed(_WORDS)), "p_runs": (torch.int64,)},
)


class _OnDevice:
    """Runs held as a ``[R, 3]`` tensor ``runs`` on a device: ``len`` is R."""

    runs: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.runs.device

    def __len__(self) -> int:
        return self.runs.shape[0]


@dataclass(frozen=True, eq=False)
class RunTemplate(_OnDevice):
    """Runs checked once against two buffer sizes and held on a device.

    ::

        runs  [R, 3] int64 on ``device``: (from_offset, to_offset, length) in bytes, R >= 0,
              every length > 0 (empty runs are dropped)

    ``word`` is the widest of 8/4/2/1 bytes dividing every offset and length; ``max_length``
    and ``total`` are the longest run and the sum of lengths, in bytes (host integers, so a
    launch needs no device read).
    """

    runs: torch.Tensor
    from_size: int
    to_size: int
    word: int
    max_length: int
    total: int


def _check_buffer(name: str, t: torch.Tensor) -> None:
    if t.dtype != torch.uint8 or t.dim() != 1 or (t.numel() > 1 and t.stride(0) != 1):
        raise ShapeError(
            f"{name} must be a contiguous 1-D uint8 tensor, got {t.dtype} {list(t.shape)} strides {t.stride()}"
        )


def _host_runs(runs: object) -> np.ndarray:
    if isinstance(runs, torch.Tensor):
        arr = runs.detach().cpu().numpy()
    elif isinstance(runs, np.ndarray):
        arr = runs
    else:
        raise ShapeError(f"runs must be a numpy array or torch tensor [R, 3], got {type(runs).__name__}")
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise ShapeError(f"runs must be [R, 3] (from_offset, to_offset, length), got shape {list(arr.shape)}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ShapeError(f"runs must be integers, got {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def prepare_runs(
    runs: object,
    from_size: int,
    to_size: int,
    device: torch.device | str = "cpu",
    *,
    from_name: str = "from buffer",
    to_name: str = "to buffer",
) -> RunTemplate:
    """Check ``runs`` ``[R, 3]`` (numpy or tensor) once against buffers of ``from_size`` and
    ``to_size`` bytes and copy them to ``device``.

    Raises :class:`ShapeError` naming the first bad run: a negative offset or length, a run
    that ends past a buffer, or two runs that overlap in the destination.
    """
    arr = _host_runs(runs)
    frm, to, length = arr[:, 0], arr[:, 1], arr[:, 2]
    bad = np.flatnonzero((length < 0) | (frm < 0) | (to < 0))
    if bad.size:
        raise ShapeError(f"run {int(bad[0])} {arr[bad[0]].tolist()} has a negative offset or length")
    for name, off, size in ((from_name, frm, from_size), (to_name, to, to_size)):
        bad = np.flatnonzero(off + length > size)
        if bad.size:
            raise ShapeError(f"run {int(bad[0])} {arr[bad[0]].tolist()} ends past {name} ({size} bytes)")
    live = np.flatnonzero(length > 0)
    order = live[np.argsort(to[live], kind="stable")]
    clash = np.flatnonzero(to[order][:-1] + length[order][:-1] > to[order][1:])
    if clash.size:
        i, j = int(order[clash[0]]), int(order[clash[0] + 1])
        raise ShapeError(f"runs {i} {arr[i].tolist()} and {j} {arr[j].tolist()} overlap in {to_name}")
    arr = arr[live]
    align = int(np.bitwise_or.reduce(arr, axis=None)) if arr.size else 0
    word = next(w for w, _ in _WORDS if align % w == 0)
    return RunTemplate(
        runs=torch.from_numpy(arr).to(device),
        from_size=int(from_size),
        to_size=int(to_size),
        word=word,
        max_length=int(arr[:, 2].max()) if arr.size else 0,
        total=int(arr[:, 2].sum()) if arr.size else 0,
    )


def _template(runs: object, from_name: str, from_buf: torch.Tensor, to_name: str, to_buf: torch.Tensor) -> RunTemplate:
    """The template for one call: checked per call unless ``runs`` is a :class:`RunTemplate`."""
    _check_buffer(from_name, from_buf)
    _check_buffer(to_name, to_buf)
    device = check_same_device(**{from_name: from_buf, to_name: to_buf})
    if not isinstance(runs, RunTemplate):
        return prepare_runs(runs, from_buf.numel(), to_buf.numel(), device, from_name=from_name, to_name=to_name)
    for name, buf, size in ((from_name, from_buf, runs.from_size), (to_name, to_buf, runs.to_size)):
        if buf.numel() < size:
            raise ShapeError(f"{name} has {buf.numel()} bytes; the run template was checked against {size}")
    if runs.device != device:
        raise ShapeError(f"the run template is on {runs.device}, the buffers on {device}")
    return runs


def _word(template: RunTemplate, *bufs: torch.Tensor) -> int:
    """The widest word dividing the runs, and each buffer's address and size."""
    for size, _ in _WORDS:
        if template.word % size == 0 and all(b.numel() % size == 0 and b.data_ptr() % size == 0 for b in bufs):
            return size
    return 1


def _copy_runs(
    from_name: str, from_buf: torch.Tensor, runs: object, to_name: str, to_buf: torch.Tensor
) -> torch.Tensor:
    """Copy the runs from ``from_buf`` into ``to_buf``; return ``to_buf``."""
    template = _template(runs, from_name, from_buf, to_name, to_buf)
    _PACK.check_runnable(from_buf)
    if len(template) > 0:
        word = _word(template, from_buf, to_buf)
        dtype = _WORD_DTYPE[word]
        grid = (len(template), min(triton.cdiv(template.max_length // word, _BLOCK), _MAX_PROGRAMS_PER_RUN))
        _PACK(grid, from_buf.view(dtype), to_buf.view(dtype), template.runs, WORD=word, BLOCK=_BLOCK)
    return to_buf


def _copy_runs_ref(
    from_name: str, from_buf: torch.Tensor, runs: object, to_name: str, to_buf: torch.Tensor
) -> torch.Tensor:
    """:func:`_copy_runs` in plain torch."""
    template = _template(runs, from_name, from_buf, to_name, to_buf)
    if len(template) == 0:
        return to_buf
    word = _word(template, from_buf, to_buf)
    frm, to = from_buf.view(_WORD_DTYPE[word]), to_buf.view(_WORD_DTYPE[word])
    w = template.runs // word
    lengths = w[:, 2]
    total = template.total // word
    run_of = torch.repeat_interleave(torch.arange(w.shape[0], device=w.device), lengths, output_size=total)
    run_start = torch.cumsum(lengths, 0) - lengths
    within = torch.arange(total, device=w.device) - run_start[run_of]
    to[w[run_of, 1] + within] = frm[w[run_of, 0] + within]
    return to_buf


def pack(src: torch.Tensor, runs: object, staging: torch.Tensor) -> torch.Tensor:
    """Gather byte runs of ``src`` into ``staging``.

    Args:
        src: ``[bytes]`` contiguous uint8 (e.g. a page buffer viewed as bytes).
        runs: a :class:`RunTemplate` (checked once by :func:`prepare_runs`, on src's device),
            or ``[R, 3]`` int64 numpy array or tensor of ``(src_offset, staging_offset, length)``
            (checked and copied to the device on every call).
        staging: ``[bytes]`` contiguous uint8; bytes outside the runs are left as they were.

    Returns:
        ``staging``.
    """
    return _copy_runs("src", src, runs, "staging", staging)


@reference_of(pack)
def pack_ref(src, runs, staging):
    return _copy_runs_ref("src", src, runs, "staging", staging)


def unpack(staging: torch.Tensor, runs: object, dst: torch.Tensor) -> torch.Tensor:
    """Scatter byte runs of ``staging`` into ``dst``, the inverse of :func:`pack`: the same
    arguments, with the runs ``(staging_offset, dst_offset, length)`` and ``dst`` (contiguous
    uint8, bytes outside the runs left as they were) returned."""
    return _copy_runs("staging", staging, runs, "dst", dst)


@reference_of(unpack)
def unpack_ref(staging, runs, dst):
    return _copy_runs_ref("staging", staging, runs, "dst", dst)


# -- the gather of one request: every run of two groups in one launch --------------------------------

_CHUNK = 16384          # bytes of a run one program copies (a multiple of every word)
_SUB = 1024             # words per load/store inside a chunk


@triton.jit
def _gather_copy(p_from, p_to, from_w, to_w, n_w, WORD: tl.constexpr, CHUNK: tl.constexpr,
                 SUB: tl.constexpr):
    for s in tl.static_range(0, CHUNK // WORD, SUB):
        o_x = s + tl.arange(0, SUB)
        m_x = o_x < n_w
        b_x = tl.load(p_from + from_w + o_x, mask=m_x)
        tl.store(p_to + to_w + o_x, b_x, mask=m_x)


@triton.jit(do_not_specialize=["n_runs", "n_first", "n_steps"],
            do_not_specialize_on_alignment=["p_src0", "p_dst0", "p_src1", "p_dst1"])
def _gather_kernel(p_src0, p_dst0, p_src1, p_dst1, p_runs, p_chunks, n_runs, n_first, n_steps,
                   WORD: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr):
    # One program: one CHUNK-byte piece of one run. Runs [0, n_first) copy from p_src0 to
    # p_dst0 (the first group's bases are in those pointers), the others from p_src1 to p_dst1.
    # p_chunks[r] is the first program of run r (a prefix sum, n_runs + 1 entries): the program
    # finds its run by binary search, so long runs get many programs and short runs one each.
    # Pointers and counts are not specialized: a request's bases (in the pointers) change the
    # alignment from call to call, and each new specialization would compile in the rank loop.
    i_p = tl.program_id(0).to(tl.int64)
    lo = i_p * 0
    hi = i_p * 0 + n_runs - 1
    for _ in range(n_steps):                     # largest r with p_chunks[r] <= i_p
        mid = (lo + hi + 1) // 2
        ok = tl.load(p_chunks + mid) <= i_p
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    r = lo
    first = tl.load(p_chunks + r)
    start = (i_p - first) * CHUNK
    length = tl.load(p_runs + r * 3 + 2)
    n_w = (tl.minimum(length - start, CHUNK)) // WORD
    from_w = (tl.load(p_runs + r * 3) + start) // WORD
    to_w = (tl.load(p_runs + r * 3 + 1) + start) // WORD
    if r < n_first:
        _gather_copy(p_src0, p_dst0, from_w, to_w, n_w, WORD, CHUNK, SUB)
    else:
        _gather_copy(p_src1, p_dst1, from_w, to_w, n_w, WORD, CHUNK, SUB)


_GATHER = Launcher(
    _gather_kernel,
    name="pack.gather",
    constexprs=dict(WORD=tuple(w for w, _ in reversed(_WORDS)), CHUNK=(_CHUNK,), SUB=(_SUB,)),
    dtypes={("p_src0", "p_dst0", "p_src1", "p_dst1"): tuple(d for _, d in reversed(_WORDS)),
            ("p_runs", "p_chunks"): (torch.int64,)},
)


@dataclass(frozen=True, eq=False)
class GatherTemplate(_OnDevice):
    """The runs of one request's gather, in ONE or TWO groups, checked once and held on a
    device (:func:`prepare_gather`); a request adds one ``(src base, dst base)`` per group
    (:func:`gather`).

    ::

        runs    [R, 3] int64 on ``device``: (src offset, dst offset, length) in bytes relative to
                the group's bases; rows [0, n_first) group 0, rows [n_first, R) group 1; every
                length > 0
        chunks  [R + 1] int64 on ``device``: the first program of each run (runs split in
                16 KiB pieces), chunks[R] = programs

    Host integers (no device read at launch): ``align`` (OR of every offset and length),
    ``src_end`` / ``dst_end`` (per group, the end of the furthest run), ``dst_start`` (per
    group, the lowest destination offset), ``total`` bytes.
    """

    runs: torch.Tensor
    chunks: torch.Tensor
    groups: int
    n_first: int
    programs: int
    steps: int
    align: int
    src_end: tuple[int, int]
    dst_start: tuple[int, int]
    dst_end: tuple[int, int]
    total: int


def _group_runs(i: int, runs: object) -> np.ndarray:
    """Group ``i``'s runs checked on their own: integers, no negative offset or length, no two
    overlapping in the destination; empty runs dropped."""
    arr = _host_runs(runs)
    frm, to, length = arr[:, 0], arr[:, 1], arr[:, 2]
    bad = np.flatnonzero((length < 0) | (frm < 0) | (to < 0))
    if bad.size:
        raise ShapeError(f"group {i} run {int(bad[0])} {arr[bad[0]].tolist()} has a negative offset or length")
    arr = arr[length > 0]
    order = np.argsort(arr[:, 1], kind="stable")
    to_s, len_s = arr[order, 1], arr[order, 2]
    clash = np.flatnonzero(to_s[:-1] + len_s[:-1] > to_s[1:])
    if clash.size:
        a, b = arr[order[clash[0]]].tolist(), arr[order[clash[0] + 1]].tolist()
        raise ShapeError(f"group {i} runs {a} and {b} overlap in the destination")
    return arr


def prepare_gather(groups: "list[object] | tuple", device: torch.device | str = "cpu") -> GatherTemplate:
    """Check one or two groups of runs (``[R, 3]`` numpy arrays or tensors of ``(src offset,
    dst offset, length)``) once and copy them to ``device`` as a :class:`GatherTemplate`.

    Raises :class:`ShapeError` naming the first bad run (a negative offset or length, two runs
    of a group overlapping in the destination) or a wrong number of groups."""
    if not 1 <= len(groups) <= 2:
        raise ShapeError(f"a gather takes one or two groups of runs, got {len(groups)}")
    parts = [_group_runs(i, g) for i, g in enumerate(groups)]
    if len(parts) == 1:
        parts.append(np.zeros((0, 3), dtype=np.int64))
    arr = np.concatenate(parts)
    lengths = arr[:, 2]
    pieces = -(-lengths // _CHUNK)
    chunks = np.zeros(len(arr) + 1, dtype=np.int64)
    np.cumsum(pieces, out=chunks[1:])

    def ends(part: np.ndarray, col: int) -> int:
        return int((part[:, col] + part[:, 2]).max()) if len(part) else 0

    return GatherTemplate(
        runs=torch.from_numpy(np.ascontiguousarray(arr)).to(device),
        chunks=torch.from_numpy(chunks).to(device),
        groups=len(groups),
        n_first=len(parts[0]),
        programs=int(chunks[-1]),
        steps=max(1, int(len(arr)).bit_length()),
        align=int(np.bitwise_or.reduce(arr, axis=None)) if arr.size else 0,
        src_end=(ends(parts[0], 0), ends(parts[1], 0)),
        dst_start=tuple(int(p[:, 1].min()) if len(p) else 0 for p in parts),
        dst_end=(ends(parts[0], 1), ends(parts[1], 1)),
        total=int(lengths.sum()),
    )


def _gather_bases(src: torch.Tensor, dst: torch.Tensor, template: GatherTemplate,
                  bases: "list[tuple[int, int]] | tuple") -> tuple[list[tuple[int, int]], int]:
    """Check a request's bases against the buffers (host integers only): every run inside
    both buffers, the groups' destinations disjoint. Returns both groups' bases (an absent
    second group's are group 0's) and the word the launch moves."""
    _check_buffer("src", src)
    _check_buffer("dst", dst)
    if template.device != dst.device:
        raise ShapeError(f"the gather template is on {template.device}, the destination on {dst.device}")
    if len(bases) != template.groups:
        raise ShapeError(f"{len(bases)} (src base, dst base) pairs for a template of {template.groups} group(s)")
    pairs = [(int(s), int(d)) for s, d in bases]
    pairs += pairs[:1] * (2 - len(pairs))
    counts = (template.n_first, len(template) - template.n_first)
    align = template.align
    spans = []
    for g, (s, d) in enumerate(pairs):
        if not counts[g]:                            # no runs: its bases are not used
            continue
        if s < 0 or d < 0 or s + template.src_end[g] > src.numel() or d + template.dst_end[g] > dst.numel():
            raise ShapeError(f"group {g} at bases (src {s}, dst {d}) reaches past the buffers "
                             f"(src {src.numel()} bytes, dst {dst.numel()} bytes; its runs end at "
                             f"{template.src_end[g]} and {template.dst_end[g]})")
        spans.append((d + template.dst_start[g], d + template.dst_end[g]))
        align |= s | d
    if len(spans) == 2 and spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1]:
        raise ShapeError(f"the two groups' destinations overlap: bytes {spans[0]} and {spans[1]}")
    align |= src.data_ptr() | dst.data_ptr()
    word = next(w for w, _ in _WORDS if align % w == 0)
    if not counts[0]:
        pairs[0] = pairs[1]
    if not counts[1]:
        pairs[1] = pairs[0]
    return pairs, word


def gather(src: torch.Tensor, dst: torch.Tensor, template: GatherTemplate,
           bases: "list[tuple[int, int]] | tuple") -> torch.Tensor:
    """Copy every run of ``template`` from ``src`` into ``dst`` in ONE kernel launch: run
    ``(a, b, n)`` of group ``g`` copies ``src[bases[g][0] + a :][:n]`` to
    ``dst[bases[g][1] + b :][:n]``.

    Args:
        src: ``[bytes]`` contiguous uint8 -- e.g. a same-host peer's pool opened from its CUDA
            IPC handle (it may live on another GPU of the host).
        dst: ``[bytes]`` contiguous uint8 on the template's device; bytes outside the runs are
            left as they were.
        template: from :func:`prepare_gather`, on ``dst``'s device.
        bases: one ``(src base, dst base)`` per group of the template, in bytes.

    Launches on the current stream and returns at once: no host synchronisation, nothing
    copied to the device (the bases ride in the pointers). Raises :class:`ShapeError` when a
    run would leave a buffer or the groups' destinations overlap (host integers only).

    Returns:
        ``dst``.
    """
    pairs, word = _gather_bases(src, dst, template, bases)
    _GATHER.check_runnable(dst)
    if template.programs == 0:
        return dst
    dtype = _WORD_DTYPE[word]
    s, d = src.view(dtype), dst.view(dtype)
    (s0, d0), (s1, d1) = pairs
    _GATHER((template.programs,), s[s0 // word:], d[d0 // word:], s[s1 // word:], d[d1 // word:],
            template.runs, template.chunks, len(template), template.n_first, template.steps,
            WORD=word, CHUNK=_CHUNK, SUB=_SUB)
    return dst


def gather_ref(src: torch.Tensor, dst: torch.Tensor, template: GatherTemplate,
               bases: "list[tuple[int, int]] | tuple") -> torch.Tensor:
    """:func:`gather` in plain torch (same arguments, same checks): the oracle of the kernel."""
    pairs, _ = _gather_bases(src, dst, template, bases)
    runs = template.runs
    for g, (lo, hi) in enumerate(((0, template.n_first), (template.n_first, len(template)))):
        if hi == lo:
            continue
        shift = torch.tensor([pairs[g][0], pairs[g][1], 0], dtype=torch.int64, device=runs.device)
        group = runs[lo:hi] + shift
        lengths = group[:, 2]
        total = int(lengths.sum())
        run_of = torch.repeat_interleave(torch.arange(group.shape[0], device=runs.device), lengths,
                                         output_size=total)
        within = torch.arange(total, device=runs.device) - (torch.cumsum(lengths, 0) - lengths)[run_of]
        taken = src[(group[run_of, 0] + within).to(src.device)]
        dst[group[run_of, 1] + within] = taken.to(dst.device)
    return dst


# -- host copy of the data plane ------------------------------------------------------------------

_DIRECT_COPY_BYTES = 64 * 1024
_HOST_WORD_DTYPES = {8: np.uint64, 4: np.uint32, 2: np.uint16}


def copy_runs_host(frm: np.ndarray, runs: np.ndarray, to: np.ndarray) -> None:
    """``to[b:b+n] = frm[a:a+n]`` for every run ``(a, b, n)`` of ``runs`` ``[R, 3]`` int64.

    ``frm`` and ``to`` are 1-D uint8 numpy arrays. Nothing is checked: the runs must already lie
    inside both buffers (numpy would wrap negative offsets) -- the data plane checks them once
    per post (``statebridge.connector.data.runs``).

    Runs shorter than 64 KiB -- a plan can have hundreds of thousands, e.g. 2-byte pieces of an
    LSD -> DLS pair -- are copied with one vectorised fancy-index assignment per distinct
    length (a plan has a handful): both buffers are viewed as overlapping rows
    ``[size - L + 1, L]`` with strides (1, 1) -- in 8/4/2-byte words when the offsets and the
    length allow -- and the selected rows copied at once. Runs of 64 KiB and more are copied
    one slice each: there are at most ``bytes / 64 KiB`` of them, a slice copy runs at memcpy
    speed without the row gather's temporary, and the per-call cost is small against moving
    64 KiB.

    It is far faster than :func:`pack_ref`, the pure torch reference, on the same runs
    (docs/measurements.md, "Transport choices"), and the Triton :func:`pack` needs CUDA.
    """
    lengths = runs[:, 2]
    big = lengths >= _DIRECT_COPY_BYTES
    if big.any():
        for a, b, n in runs[big].tolist():
            to[b:b + n] = frm[a:a + n]
        runs, lengths = runs[~big], lengths[~big]
    keep = lengths > 0
    if not keep.all():
        runs, lengths = runs[keep], lengths[keep]
    if len(runs) == 0:
        return
    lo, hi = int(lengths.min()), int(lengths.max())
    distinct = [lo] if lo == hi else np.unique(lengths).tolist()
    for length in distinct:
        sel = runs if len(distinct) == 1 else runs[lengths == length]
        offsets = sel[:, :2]
        # Move 8/4/2-byte words when every offset and the length are multiples of the word.
        align = int(np.bitwise_or.reduce(offsets, axis=None)) | length
        word = next(w for w in (8, 4, 2, 1) if align % w == 0)
        src, dst = frm, to
        if word > 1:
            dtype = _HOST_WORD_DTYPES[word]
            src = frm[:frm.size - frm.size % word].view(dtype)
            dst = to[:to.size - to.size % word].view(dtype)
            offsets = offsets >> (word.bit_length() - 1)
        n = length // word
        if n == 1:
            dst[offsets[:, 1]] = src[offsets[:, 0]]
            continue
        src_rows = as_strided(src, (src.size - n + 1, n), (word, word), writeable=False)
        dst_rows = as_strided(dst, (dst.size - n + 1, n), (word, word))
        dst_rows[offsets[:, 1]] = src_rows[offsets[:, 0]]

