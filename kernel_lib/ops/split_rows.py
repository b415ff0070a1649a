"""Rows too wide for one program: a *team* of programs shares each row, a chunk of columns each, and the lanes
meet at a barrier in global memory to combine the row's partial reductions. Every element is still read once
and written once, as when a row fits one program (softmax and norms over 64k-262k columns: vocabularies,
flattened features).

    lane l of a team holds columns [l * BLOCK_D, (l + 1) * BLOCK_D) of the team's rows in registers:
    1. it reduces its chunk to a few floats (a max and a sum, a sum of squares, ...) and stores them in a slot
    2. it arrives at the team's counter (atomic add, release) and polls it until all LANES lanes have (acquire)
    3. it reads the LANES partials (from L2), combines them, and finishes its chunk from registers

Why not one program per row: a 65,536-column row held by one program is 64 float32 registers per thread at the
most threads a program may have (1,024), one such program per SM, so its loads, reductions and stores take
turns instead of overlapping (about half the copy rate on an H200: benchmarks/NOTES.md); a 262,144-column row
does not fit at all. A team of 8-32 programs of 8,192 columns each leaves two or more programs per SM.

A spin-wait needs every lane of a team running at once. The launcher never starts more programs than the GPU
holds at one time (``resident_programs``: from the compiled kernel's registers, shared memory and warps) and
teams loop over rows (team t takes rows t, t + teams, ...). A team's counter only grows: its k-th row waits for
(k + 1) * LANES arrivals. Its slots alternate between two: a lane is never more than one row ahead of the
slowest lane, which has read the older slot before it arrives at the next row. A wait that never ends (a bug,
or a GPU shared with a kernel that never yields its SMs) gives up after 2^22 polls (seconds), marks the team's
counter, and from then every lane of the team writes NaN for its rows instead of hanging.

Under Triton's interpreter programs run one after another, so a barrier would wait forever: there, and on a
GPU when a row needs more lanes than the GPU holds programs, the same kernels run in two launches (PHASE 1
stores every row's partials in a slot of its own, PHASE 2 reads them, loads its chunk again and finishes it),
which reads the input twice; teams loop over rows there too. The CPU tests check that path; the GPU tests check both.
"""

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

__all__ = [
    "lane_of", "lane_row", "slot_of", "team_barrier", "resident_programs", "Plan", "plan", "lane_block", "launch",
]  # fmt: skip

MAX_POLLS = tl.constexpr(1 << 22)  # seconds of polling an L2 atomic: far past any real wait
POISON = tl.constexpr(1 << 30)  # set in a team's counter when a lane gave up; arrivals stay far below it


@triton.jit
def lane_of(lanes, D, BLOCK_D: tl.constexpr, LANES_P2: tl.constexpr):
    """This program's team and lane; the lane's columns of every row and their mask (columns < D); the offsets of
    the team's LANES_P2 partial slots; and the team's health, True until a barrier gives up."""
    pid = tl.program_id(0)
    lane = pid % lanes
    cols = lane * BLOCK_D + tl.arange(0, BLOCK_D)
    return pid // lanes, lane, cols, cols < D, tl.arange(0, LANES_P2), tl.full([], 1, tl.int1)


@triton.jit
def lane_row(ptr, row, row_stride, cols, mask, n_rows, OTHER: tl.constexpr):
    """A lane's columns of row ``row`` (OTHER where masked), or OTHER everywhere past the last row: the prefetch of
    a team's next row. The row offset is taken in int64 (row * stride overflows int32 past 2**31 elements)."""
    return tl.load(ptr + tl.cast(row, tl.int64) * row_stride + cols, mask=mask & (row < n_rows), other=OTHER)


@triton.jit
def slot_of(part_ptr, team, k, row, WIDTH: tl.constexpr, PHASE: tl.constexpr):
    """Where the partials of a team's k-th row (``row``) go, WIDTH floats a slot: with barriers (PHASE 0), two
    slots a team, alternating by row; in two launches, a slot a row."""
    if PHASE == 0:
        slot = part_ptr + (team * 2 + k % 2) * WIDTH
    else:
        slot = part_ptr + row * WIDTH
    return slot


@triton.jit
def team_barrier(count_ptr, target, healthy):
    """Arrive at a team's counter and wait until it reaches ``target``. Returns whether the team is still healthy.
    A lane whose wait gives up sets the counter's POISON bit: every lane of the team then sees it, stops waiting
    at this and every later barrier, and writes NaN (a lane that gave up must not let its later arrivals count
    for a row it never reached)."""
    tl.debug_barrier()  # every thread's stores of this lane's partials come before its arrival
    tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    polls = 0
    while (seen < target) & (polls < MAX_POLLS) & healthy:
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
        polls += 1
    if healthy & (seen < target):  # gave up
        tl.atomic_or(count_ptr, POISON, sem="relaxed", scope="gpu")
    return healthy & (seen >= target) & (seen < POISON)


def _occupancy(compiled, device: torch.device) -> int:
    """Programs of this compiled kernel one SM holds at once: the least of what its threads, registers
    (allocated per warp in units of 256) and shared memory allow."""
    props = torch.cuda.get_device_properties(device)
    compiled._init_handles()  # loads the binary: n_regs is known from then on
    warps = compiled.metadata.num_warps
    by_threads = props.max_threads_per_multi_processor // (32 * warps)
    regs_per_warp = -(-compiled.n_regs * 32 // 256) * 256
    by_regs = (getattr(props, "regs_per_multiprocessor", 65536) // max(regs_per_warp, 256)) // warps
    shared = compiled.metadata.shared
    sm_shared = getattr(props, "shared_memory_per_multiprocessor", 233472)
    by_shared = sm_shared // (shared + 1024) if shared else 32  # the driver reserves 1 KB a block
    return max(1, min(by_threads, by_regs, by_shared, 32))


_resident: dict = {}


def resident_programs(kernel, args: tuple, kwargs: dict, key: tuple, device: torch.device) -> int:
    """How many programs of ``kernel`` (launched with these arguments) the whole GPU holds at one time.

    Compiles the kernel for these arguments (``warmup``; Triton's cache makes later launches free) and reads
    its resources; remembered under ``key`` (the kernel and its constexprs) and what Triton specializes the
    arguments on. One program per SM when
    the compiled kernel cannot be inspected (a Triton without these fields): always resident."""
    key = (key, device.index, tuple(_specialization(a) for a in args))
    if key not in _resident:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        try:
            per_sm = _occupancy(kernel.warmup(*args, grid=(1,), **kwargs), device)
        except (AttributeError, TypeError):  # an older or newer Triton without warmup / n_regs
            per_sm = 1
        _resident[key] = per_sm * sms
    return _resident[key]


def _specialization(arg):
    """What Triton compiles differently for an argument: a tensor's dtype and 16-byte alignment, an integer's
    divisibility by 16, its being 1 and its needing 64 bits (the split kernels do not specialize on n_rows,
    lanes and teams)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, int):
        return arg % 16 == 0, arg == 1, arg >= 2**31
    return type(arg)


class Plan(NamedTuple):
    """How wide rows are split: lanes a row, teams, and the path (0: one launch with barriers; 1: two launches)."""

    lanes: int
    teams: int
    phase: int


def plan(n_rows: int, D: int, block_d: int, resident: int | None) -> Plan:
    """Lanes a row, teams, and the path: teams of lanes meeting at barriers when the GPU holds at least one team
    at a time (``resident`` programs), else (``resident`` None under the interpreter, or too few) two launches
    with a few teams (any number works there: nothing waits)."""
    lanes = triton.cdiv(D, block_d)
    if resident is not None and resident >= lanes:
        return Plan(lanes, min(n_rows, resident // lanes), 0)
    return Plan(lanes, min(n_rows, 4 if resident is None else max(4, resident // lanes)), 1)


@functools.cache
def lane_block(D: int, widest: int) -> int:
    """Columns per lane: the next power of two of D, at most ``widest`` (a power of two)."""
    return min(widest, 1 << max(0, (D - 1).bit_length()))


def launch(kernel, make_args, n_rows: int, D: int, block_d: int, stats: int, constants: dict, like: torch.Tensor):
    """Launch a split kernel over n_rows rows of D columns, ``block_d`` columns a lane, and return its Plan.

    ``make_args(part, count, teams)`` gives the kernel's positional arguments around the scratch this allocates:
    ``part``, float32 (slots, stats, LANES_P2) for each lane's ``stats`` partial floats, and ``count``, the teams'
    zeroed barrier counters. The kernel takes LANES_P2, BLOCK_D and PHASE besides ``constants``; on a GPU it is
    first compiled for PHASE 0 (with two teams' worth of arguments) to learn how many programs stay resident."""
    lanes_p2 = triton.next_power_of_2(triton.cdiv(D, block_d))
    constants = dict(constants, LANES_P2=lanes_p2, BLOCK_D=block_d)
    resident = None
    if like.is_cuda:  # under the interpreter programs run one at a time: two launches, no barrier
        dummy = (torch.empty(1, device=like.device), torch.empty(1, device=like.device, dtype=torch.int32))
        key = (kernel.__name__, like.dtype, tuple(sorted(constants.items())))
        resident = resident_programs(kernel, make_args(*dummy, 2), dict(constants, PHASE=0), key, like.device)
    split = plan(n_rows, D, block_d, resident)
    slots = 2 * split.teams if split.phase == 0 else n_rows
    part = torch.empty((slots, stats, lanes_p2), device=like.device, dtype=torch.float32)
    count = torch.zeros(split.teams if split.phase == 0 else 1, device=like.device, dtype=torch.int32)
    args = make_args(part, count, split.teams)
    for phase in (0,) if split.phase == 0 else (1, 2):
        kernel[(split.teams * split.lanes,)](*args, PHASE=phase, **constants)
    return split
