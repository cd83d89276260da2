"""Chunked gated linear attention for extend steps (GDN, Lightning), in place on the state pool.

What this module owns: `chunk_extend`, the recurrent cores of an extend step over any number of
tokens per request in three Triton launches (two without the delta rule), reading each request's
state from its slot of the pool and writing the new one back, over the step's table of (request,
chunk) rows (launch_math.token_blocks, the table FLA's chunk kernels take too, which the backend
plans once per step); and the cached workspaces the launches share.
It replaces FLA's chunk kernels where their Python launch path (about a millisecond of host time
a layer, BENCHMARKS.md) costs more than their kernels: the host work here is shape checks and
three launches through `launch_cache.Launcher`.

The math (per request, value head and chunk of C rows; decay acts on the key dimension as in
cpu_reference.gated_recurrence, the oracle). g_i is row i's log-decay, G_i = g_0 + ... + g_i the
chunk-local cumulative gate, S0 the state [Dk, Dv] entering the chunk (S_c in the kernels below):

    A_ij  = beta_i (k_i . k_j) exp(G_i - G_j)     j < i (strictly lower; the delta rule only)
    W     = (I + A)^-1 diag(beta) (K * exp(G))     U = (I + A)^-1 diag(beta) V
    V'    = U - W S0                               (no delta rule: V' = V)
    O     = scale ((Q * exp(G)) S0 + (causal(Q K^T) * exp(G_i - G_j)) V')
    S1    = exp(G_last) S0 + (K * exp(G_last - G))^T V'

Row i of V' is the delta rule's corrected value u_i = beta_i (v_i - k_i^T S_{i-1}), all rows of a
chunk at once: unrolling S_{i-1} inside the chunk gives (I + A) V' = diag(beta) (V - (K*exp(G)) S0).
With g <= 0 (a decay) every exponent taken is <= 0 (i >= j; masked entries never reach exp), so
nothing overflows whatever the chunk's total decay.

The inverse. T = (I + A)^-1 is formed per chunk by blocks of SUB = 16 rows, in registers: the
diagonal blocks' inverses D^-1 (D = I + the diagonal blocks A_ii) by plain forward substitution
(15 row steps, the four blocks' chains side by side in one [4, 16, 16] tile), then, with L the
blocks below the diagonal and N = D^-1 L (strictly lower by blocks: N^4 = 0 for four blocks),
T = (I + N)^-1 D^-1 = (I - N)(I + N^2) D^-1, four [64, 64] products on tensor cores (tl.dot);
W = T R_w and U = T R_u are then two products over the whole chunk. Why not the row-level
nilpotent product (I - A)(I + A^2)(I + A^4)...: it is exact in exact arithmetic but unstable in
floating point, since the powers of A grow like binomial coefficients when keys repeat (a chunk of
identical keys with beta = 1 and no decay: A^k entries up to C(63, 31) ~ 1e18 for the 64-row chunk,
then cancelled back to an inverse with entries 0 and -1), and tf32 tensor-core products keep 10
mantissa bits. Forward substitution on a unit lower-triangular system is backward stable, and it
takes the diagonal blocks, where the growth would start; what is left is powers of N, D^-1 already
applied, at most three of them (for those identical keys N's entries are 0 and 1 and N^2's at most
2). The earlier form (`ChunkConfig.solve_in_registers=False`) did the same block algebra as block
forward substitution, T_ij = -T_ii sum_{j<=c<i} A_ic T_cj block row by block row, through a
scratch tile in memory: Triton cannot index a register tile by row or block, so A's rows and T's
blocks went through memory and back (a barrier before each read), about ten dependent round trips
a program; in registers the rows are picked out by masked sums and the blocks by the products'
masks instead.

Three kernels (a launch with the same arguments goes through a Launcher: no Triton binding):

1. `_chunk_solve_kernel`, one program per (chunk, value head), the delta rule only: A, T over it
   and W = T R_w, U = T R_u, all in registers, then W [rows, Hv, Dk] and U [rows, Hv, Dv] into
   their workspace (memory below), indexed by the step's row. Measured on an H200 (bf16, 32 GDN
   heads of 128, 2048 rows) with T through the scratch tile and W and U float32: 0.114 ms, against
   0.171 with the diagonal blocks one after another and 0.180 for the form before that, which
   solved W and U block by block, reading the earlier blocks' rows back.
2. `_chunk_state_kernel`, one program per (request, value head, Dv tile), the only sequential part:
   it walks the request's chunks in order with the state tile [Dk, BV] in float32 registers and,
   per chunk, stores the state entering it (S_c, into the chunk-state workspace at the chunk's row
   of the chunk table), forms V' = U - W S_c (the delta rule; stored over U: the same rows, head and
   columns, which this program alone owns) and moves the state on, S_c+1 = exp(G_last) S_c +
   (K * exp(G_last - G))^T V'. The tile is loaded from the request's slot once and stored back once.
   Where the step asks for an in-step snapshot after the request's first r rows (StepSnapshots),
   the walk stops at the chunk holding row r and, beside that chunk's step, forms the state after
   its first rows from the same S_c, V', K and G (the later rows masked: what the walk leaves on a
   request of r rows) into the snapshot pool.
3. `_chunk_output_kernel`, one program per (chunk, value head, Dv tile), all independent: the
   chunk's outputs O = scale ((Q * exp(G)) S_c + (causal(Q K^T) * exp(G_i - G_j)) V'), from S_c and
   V' (V without the delta rule) as the state kernel left them. It takes the key dimension in
   blocks of 64, so q, k and S_c are never live whole.

Chunk length: 64 rows (CHUNK_T, FLA's), or for a step of fewer rows those rounded up to a power of
two of at least 16 (`chunk_length`, the one rule of eager and captured steps): such a step has one
chunk a request either way, and a 16- or 32-row chunk has one or two diagonal blocks (T = D^-1, or
(I - N) D^-1 with no squaring) and a quarter or a sixteenth of the 64-row solve's products. Its
launches are latency-bound, so `chunk_config` gives them more programs in flight (narrower output
tiles, the solve's W and U columns split over `ChunkConfig.solve_col_tiles` programs), within what
the empty programs of a captured bucket's grid cost.

The cumulative gates are a scan over the chunk's gate row (tl.cumsum; cheap beside the chunk's
products, and short on the state kernel's sequential walk), recomputed in each kernel rather than
stored.

Why the split. Before it, the state kernel also produced the outputs: every step of its walk
computed the chunk's Q K^T and both output products besides the two the recurrence needs (W S_c
and K^T V'), five products a chunk in the sequential part, and its tile set (q, k, W, U, the
scores, the state) spilled (255 registers and 224 spills on an H200 at Dk = Dv = 128). Now the walk
does only those two, and the output products, most of a long prompt's work, run in parallel over
chunks; the price is the chunk states' round trip through memory (written once, read once per
output Dv tile). Kernel time of one GDN layer, one request of 2048 tokens, H200 (benchmarks/history/extend.md, "GDN
extend steps on our chunk kernels"): 0.54 ms before the split, 0.45 after it, 0.29 with 16-bit
products, a pipelined walk and the solve through its scratch tile (float32 W and U), against 0.17
for FLA's kernels; 0.155 now (16-bit workspaces, the solve in registers) against FLA's 0.174 in the
same run, and 0.295 against 0.320 at 4096 tokens (benchmarks/kernels/chunk_kernel_sweep.py --quick,
benchmarks/history/prefix_cache.md, "Per-bucket extend graphs and 16-bit chunk workspaces").

Memory. What goes through memory between the kernels: W and U (V' written over U), and the chunk
states; all three in `chunk_workspace_dtype` of the inputs: bfloat16 for 16-bit inputs (FLA keeps
its w, u, v_new and h in the input dtype), float32 for float32 inputs. In 16 bits the launches
move about half the bytes they did with float32 W and U: the solve's stores, and per chunk the
state kernel's loads of W and V' (once per Dv tile) and its V' stores, and the output kernel's V'.
- W [rows, Hv, Dk] and U [rows, Hv, Dv], the delta rule only (`chunk_workspace`): rows x Hv x
  (Dk + Dv) x 2 bytes for 16-bit inputs, 32 MiB for 2048 rows at Hv = 32, Dk = Dv = 128 (64 MiB in
  float32). V' [rows, Hv, Dv] is written over U, so it costs nothing more.
- T: nothing, since the solve keeps it in registers. The earlier form's scratch
  (`chunk_matrix_workspace`, [chunks, Hv, 64, 64] float32, 16 MiB for 32 chunks at Hv = 32) is
  allocated only for it, from the shared cache, so it never serves a captured step. It keeps
  float32 whatever the inputs, since each block of T is formed from the blocks before it.
- the chunk states [chunks, Hv, Dk, Dv] (`chunk_state_workspace`), with and without the delta rule:
  chunks x Hv x Dk x Dv x 2 bytes for 16-bit inputs (4 for float32 inputs), 32 MiB for one request
  of 2048 rows (32 chunks) at Hv = 32, Dk = Dv = 128, and never less than 16 chunks' worth (16 MiB
  there). A step has at most rows / 64 + requests chunks.
The shared workspaces are cached per (device, Hv, Dk, Dv, dtype), shared by every layer of that
shape, grown to a power of two and never shrunk (stable addresses for the Launcher); a captured
step's are the caller's own (`ChunkWorkspaces`), allocated once and never regrown.

Rows past a request's last row in its last chunk load as zeros (k = v = beta = g = 0): their A
rows and columns, W, U and V' rows are zero and their gates repeat the last real row's, so the
masked chunk is exactly the shorter one; only real rows are stored. A step may also hand the
padding rows past its last request to the kernels as one more request (bounds [R+2]): the output
kernel stores zeros over its chunks and the other two skip them, so a captured step, whose real row
count only the device knows, gets every row of `out` written without a separate fill (an H200 spent
about 97 us of a 4096-token bench qwen3_next step zeroing `out` before the kernels, and a launch a
layer in every small one).

Precision: every product accumulates in float32. For 16-bit inputs (the production case) the
products take 16-bit operands, as FLA's kernels take theirs: the solve's K K^T (exact), and its
W = T R_w and U = T R_u with T and the right-hand sides rounded to bfloat16 in registers (FLA keeps
its A inverse in the input dtype); the walk's W S_c and K^T (decay * V') and the output kernel's
products with q and k as they are and the state, W and V' (decayed, in the walk) in bfloat16. The
walk keeps its state in float32 registers, so the rounding of S_c reaches each chunk's products
once and never accumulates through the recurrence. W and U are stored rounded to bfloat16 and
V' = U - W S_c formed in float32 before it is rounded and stored; the output kernel's product with
V' took that rounding before the storage was 16-bit too, and the walk's own product rounds
decay * V' from float32 registers.
On an H200 (benchmarks/kernels/chunk_kernel_sweep.py, requests of 1 to 1000 rows at Dk = Dv = 128
against the float32 recurrence), with W and U float32 and the solve's products tf32, the 16-bit
products moved GDN's worst output error from 2.3e-3 to 2.9e-3 and its states' from 8.4e-4 to 1.9e-3
(Lightning's: 2.0e-3 to 2.7e-3, 4.3e-4 to 1.5e-3), against 1.7e-3 to 3.2e-3 for FLA's; the tests'
bound is 1e-2, which the sweep checks again for every config before timing it, and
`ChunkConfig.low_precision_dots=False` keeps float32 operands (tf32) over the 16-bit storage.
Bfloat16 rather than float16 storage (for float16 inputs too) since a state sums many tokens and
can pass float16's 65504 (and V' = U - W S_c with it), where bfloat16 has float32's range.
Float32 inputs keep float32 workspaces and float32 operands as tf32x3 (about float32 accuracy).
Triton's interpreter takes float32 operands throughout (launch_math.triton_interpreted says why),
over the same 16-bit storage.

Not here: per-channel gates (KDA), which keep FLA's chunk kernels; the choice of path (the
backend's `chunk_impl` option, runtime/backends/triton_linear.py).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from runtime.backends.kernels.launch_cache import Launcher
from runtime.backends.kernels.launch_math import cdiv, next_pow2, triton_interpreted
from runtime.backends.kernels.sm_count import num_sms
from runtime.backends.kernels.linear import (GATE_PER_CHANNEL, OP_OF_GATE, GatedNorm, StepSnapshots, _check_rows,
                                            _recurrent_args, gated_norm_head, rounds_weighted_norm)
from runtime.cache.state_pool import PADDING_SLOT

__all__ = ["CHUNK_T", "SUB_T", "ChunkConfig", "ChunkWorkspaces", "chunk_length", "takes_short_tiles", "chunk_config", "chunk_workspace",
           "chunk_matrix_workspace", "chunk_workspace_dtype", "chunk_state_workspace", "chunk_extend", "GatedNorm"]

CHUNK_T = 64  # rows of a chunk by default: FLA's chunk length, so the backend's one table serves both
SUB_T = 16  # rows of a diagonal block solved by forward substitution (tl.dot's smallest tile)
# Key and value columns of the solve kernel's tiles, at least: with 16 (head dims of 16, the tests'
# small models) and 16-bit products after the inverse in registers, an H200 gave wrong W and U
# (relative error 1.09 against the recurrence) and, inside a model's step, an illegal memory access,
# where 32 and the same product in float32 were exact; the masked extra columns cost nothing at real
# head dims (128 and up). tests/gpu/test_gpu_linear_kernels.py, small_head_dims, checks both sizes
# (which also failed, at tiles of 32, while the kernel ran a program's row as a loop of one trip:
# _chunk_solve_kernel says why it no longer does).
SOLVE_MIN_TILE = 32


def takes_short_tiles(rows: int) -> bool:
    """Whether a step of `rows` rows launches with chunk_config's single-chunk tiles: where its
    chunks are shorter than CHUNK_T (chunk_config says why not at CHUNK_T)."""
    return chunk_length(rows) < CHUNK_T


def chunk_length(rows: int) -> int:
    """Rows of a chunk for an extend step of `rows` rows (padding rows included: a captured step's
    bucket): CHUNK_T, or the step's rows rounded up to a power of two (at least SUB_T) where fewer.

    Why shorter: a step of at most CHUNK_T rows has one chunk per request whatever the length, and
    the solve's work grows with the chunk's square (A, the diagonal blocks, T's products, W and U
    over every row), so a 32-row step in a 64-row chunk did a whole 64-row solve for 32 real rows.
    One rule of the step's rows alone, taken by the eager path and by a captured step alike, so an
    eager step and the replay of its bucket (buckets of 16, 32, 64 and on) chunk, and round, alike.
    A length under CHUNK_T is never less than the step's rows, so every request still has one
    chunk: the table of CHUNK_T-row chunks (FLA's, the backend's one table, and the device-built
    tables of a captured step) is this length's table too."""
    return min(CHUNK_T, max(SUB_T, next_pow2(rows)))


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    block_v: int  # BV: Dv columns of the state one program of the state kernel owns (a power of two >= 16)
    num_warps: int  # of the state kernel
    solve_warps: int  # of the solve kernel
    out_block_v: int = 64  # Dv columns of one output kernel program (a power of two >= 16)
    out_warps: int = 4  # of the output kernel
    state_stages: int = 1  # software-pipelining stages of the state kernel's chunk loop
    # Key columns the output kernel takes at a time (its q, k and S_c blocks; a power of two >= 16):
    # fewer live registers than all of Dk, at the price of one more product per block
    out_key_block: int = 64
    # The solve forms T = (I + A)^-1 in registers (module docstring, the inverse); False: through the
    # shared matrix workspace, the earlier form, kept for timing beside it (not for captured steps:
    # their workspaces hold no matrix)
    solve_in_registers: bool = True
    # 16-bit inputs: the state and output kernels' products take 16-bit operands (module docstring,
    # precision); False keeps float32 operands as tf32. Float32 inputs ignore it.
    low_precision_dots: bool = True
    # Programs per (chunk, value head) of the solve, each forming the chunk's T and storing W and U
    # for its own share of the key and value columns (at least SOLVE_MIN_TILE wide): more programs
    # in flight where the step has few chunks, for T formed again in each (registers only).
    solve_col_tiles: int = 1


@functools.lru_cache(maxsize=None)  # a pure function of its arguments, on every launch path
def chunk_config(requests: int, heads: int, dv: int, device: torch.device, single_chunk: bool = False) -> ChunkConfig:
    """Tiles per kernel; `single_chunk`: a step whose chunks are shorter than CHUNK_T
    (`takes_short_tiles`), one chunk per request.

    The state kernel's programs each walk one request's chunks one after another, so its time is the
    longest request's chunks times one chunk's latency: narrower Dv tiles mean more programs in
    flight, but each tile loads the chunk's k and W again. The rule: 64 columns where that still
    gives a program per SM, else 32 (measured on an earlier design; on an H200 with this one, bf16,
    32 GDN heads of 128: one request of 2048 tokens 0.131 ms in tiles of 32 and 0.155 in tiles of
    64, 2 stages). Its chunk loop is software-pipelined, the next chunk's loads issued during this
    chunk's products: 3 stages for tiles of 32 columns (0.112 ms there against 0.133 with 2 and
    0.165 with 1), 2 for tiles of 64, where a third does not fit in shared memory beside the others
    (four requests of 512: 0.068 ms with 2, 0.119 with 3; benchmarks/kernels/chunk_kernel_sweep.py).
    Those were measured with float32 W. A stage holds one chunk's k and W [64, Dk] and V' [64, BV]:
    at Dk = 128 in 16 bits about 34 KiB for tiles of 16, 36 for 32, 40 for 64 (56 for 64 with float32
    W), so two programs of 3 stages now fit an SM's 228 KiB in tiles of 16 or 32, and one in tiles of
    64 (whose 256 programs for four requests then take two waves, the likely cost of the third stage
    measured above); the sweep's candidates (tiles of 16 for one request, 3 stages in tiles of 64, 8
    warps) time what the smaller stages change before the rule does.

    The output kernel's programs are independent (chunks x heads x Dv tiles, thousands for a long
    prompt): 64 columns in 4 warps (8 warps or 128 columns were slower, the same sweep). The solve
    kernel: 4 warps (2 or 8 were slower, with T through memory).

    A step of one chunk per request (a short prompt, a prefix-cache hit's suffix) is latency-bound,
    each kernel a few MB at 10-20x its copy-rate floor (an H200, bench qwen3_next, 32 rows of one
    request in 64-row chunks: 10.4 us solve, 5.9 state, 5.0 output a GDN layer). More programs in
    flight shorten it only where they are not empty: a captured bucket's grid covers every request
    row it could hold (a 32-row bucket: 33 request rows, one real in a prompt's step), and every
    program of an empty row still loads the tables before it returns (fewer since such grids walk
    their rows: `_table_programs`). So: the state kernel's
    32-column tiles (what one request takes anyway), 32-column output tiles (twice the long steps'
    programs, each with half their state product), one stage (no chunk loop to pipeline) and the
    solve's W and U columns over two programs. An estimate, for benchmarks/kernels/chunk_kernel_sweep.py
    --short to settle (it times the buckets' steps over their padded tables). Not for 64-row chunks:
    on an H200 these tiles gave a 40-row request of a 64-row bf16 step a relative error of 0.82
    against the recurrence (GDN and Lightning; float32 and the 16- and 32-row chunks were right;
    tests/gpu/test_gpu_linear_kernels.py), so such a step keeps the long steps' tiles."""
    if single_chunk:
        return ChunkConfig(min(32, max(16, next_pow2(dv))), 4, 4, min(32, max(16, next_pow2(dv))), 4,
                           state_stages=1, solve_col_tiles=max(1, min(2, next_pow2(dv) // SOLVE_MIN_TILE)))
    block_v = min(64 if requests * heads * cdiv(dv, 64) >= num_sms(device) else 32, max(16, next_pow2(dv)))
    return ChunkConfig(block_v, 4, 4, min(64, max(16, next_pow2(dv))), 4, state_stages=3 if block_v <= 32 else 2)


# Requests the state kernel sums at a time to find a request's first chunk (its row of the table).
_REQUEST_BLOCK = 128

# Programs an SM, at the least, that a walking kernel's grid keeps (`_table_programs`). 2 and not
# more: on an H100 over bench qwen3_next's 512- / 4096-token buckets of 256 request rows the three
# kernels of a one-request step took 56 / 373 us at 2, 68 / 378 at 4, 82 / 396 at 8
# (chunk_walk_256_requests_h100_2026-12-06.json; one request's own table: 45 / 314).
TABLE_PROGRAMS_PER_SM = 2
# A kernel walks a padded table only where it has more than this many times the rows its walking
# grid keeps: every walking program first reads the table's bounds to find its last live row (8 KiB
# at 256 request rows), which the grid's programs pay whether or not they walk far. On an H100 a
# one-request step over a 256-request bucket (kernels us, walking at two an SM against a program a
# row; chunk_walk_256_requests_two_an_sm_h100_2026-12-07.json): at 512 tokens (the table 29 times the
# solve's and output's walking rows) solve 18.3 against 35.6, output 13.5 against 28.8; at 4096 (4.9
# times) solve 127.7 against 124.0, output 122.6 against 104.9; the state kernel (86 times at
# both) 20.8 against 113.8 and 108.6 against 254.4. 8 lies between the measured ratios; the crossing
# itself is not measured.
WALK_TABLE_RATIO = 8


def _live_block(table_seqs: int, walk: bool) -> int:
    """Requests a walking program reads at once to find the table's last live row: every request of
    the table in one vector up to 1024, so the count is one round trip before the walk, not one a
    block of 128. The walking output kernel of a 4096-token step over a 256-request table took 130
    us summing 128 at a time (four programs an SM) and 123 in one vector (two; walk 4 an SM: 123
    too), against 96 over one request's table (H100,
    chunk_walk_256_requests_h100_2026-12-06.json, ..._two_an_sm_h100_2026-12-07.json): the rest of
    that gap is not explained. 16 where the kernel does not walk (one variant)."""
    return min(1024, max(16, next_pow2(table_seqs + 1))) if walk else 16


def _table_programs(table_rows: int, one_request_rows: int, programs_a_row: int, padded: bool,
                    device: torch.device) -> tuple[int, bool]:
    """(grid rows, WALK) of a kernel with a program per table row (a request, or a chunk row) and
    `programs_a_row` programs a row. Over a padded table (a captured bucket's, laid out for every
    request the bucket could hold: most rows empty in a step of few requests) a program per row
    would launch them all, and every empty program still loads the table before it returns, at the
    occupancy the kernel's registers and shared memory allow: over bench qwen3_next's 512-token
    bucket laid out for 256 requests, a one-request step's state kernel took 113.5 us against 15.9
    over its own table, the solve 36.0 against 15.6, the output 28.6 against 12.1 (an H200,
    conv_extend_rows_lookahead_h200_2026-12-04.json against chunk_kernel_sweep_step_snapshots_h200_
    2026-12-03.json). So there the grid keeps as many rows as one request's step fills
    (`one_request_rows`), and at least TABLE_PROGRAMS_PER_SM programs an SM, and each program walks
    the rows a grid's width apart up to the last row with rows (WALK), where the table has more
    than WALK_TABLE_RATIO times those rows; a shorter table, or an eager step's (every row live),
    keeps a program a row."""
    if not padded:
        return table_rows, False
    rows = max(one_request_rows, cdiv(TABLE_PROGRAMS_PER_SM * num_sms(device), programs_a_row))
    return (rows, True) if table_rows > WALK_TABLE_RATIO * rows else (table_rows, False)


# One set of workspaces per (device, Hv, Dk, Dv, dtype), shared by every layer of that shape: the
# launches of one layer complete before the next layer's on the same stream. Each grows to a power
# of two of rows (chunks) and never shrinks, so steps of the same bucket (and every layer of a step)
# get the same addresses, which the Launcher's cache keys on.
_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_STATE_WORKSPACES: dict[tuple, torch.Tensor] = {}
_MATRIX_WORKSPACES: dict[tuple, torch.Tensor] = {}


def chunk_workspace_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of W, U (V') and the chunk states for inputs of `dtype`: float32 for float32, else
    bfloat16 (module docstring, memory and precision: 16 bits halve the kernels' bytes; float16
    could overflow where a state sums many tokens, bfloat16 has float32's range)."""
    return torch.float32 if dtype == torch.float32 else torch.bfloat16


def chunk_workspace(rows: int, heads: int, dk: int, dv: int, dtype: torch.dtype,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(W [rows, heads, dk], U [rows, heads, dv]) views of the cached workspace in `dtype`
    (chunk_workspace_dtype of the inputs'): the solve kernel writes both, the state kernel
    overwrites U with V' (module docstring, memory)."""
    key = (torch.device(device), heads, dk, dv, dtype)
    held = _WORKSPACES.get(key)
    if held is None or held[0].shape[0] < rows:
        cap = max(256, next_pow2(rows))
        held = (torch.empty(cap, heads, dk, dtype=dtype, device=device),
                torch.empty(cap, heads, dv, dtype=dtype, device=device))
        _WORKSPACES[key] = held
    return held[0][:rows], held[1][:rows]


def chunk_matrix_workspace(chunks: int, heads: int, block_t: int, device: torch.device) -> torch.Tensor:
    """[chunks, heads, block_t, block_t] float32 view of the cached matrix workspace: the scratch of
    the solve through memory (ChunkConfig.solve_in_registers=False) for A and then T = (I + A)^-1 of
    each chunk and value head, read back only by the program that wrote it (float32 whatever the
    inputs: module docstring, memory). Cached and grown like `chunk_state_workspace`, by chunks (at
    least 16)."""
    key = (torch.device(device), heads, block_t)
    held = _MATRIX_WORKSPACES.get(key)
    if held is None or held.shape[0] < chunks:
        held = torch.empty(max(16, next_pow2(chunks)), heads, block_t, block_t, dtype=torch.float32, device=device)
        _MATRIX_WORKSPACES[key] = held
    return held[:chunks]


@dataclasses.dataclass(frozen=True)
class ChunkWorkspaces:
    """Workspaces owned by one caller instead of the shared cache: a captured step's kernels keep
    their addresses, so they must never be regrown under it (an eager step longer than every
    bucket regrows the cache). W and U are None without the delta rule (V' is V there); the solve
    in registers needs no matrix workspace."""

    w: torch.Tensor | None  # [rows, Hv, Dk] in chunk_workspace_dtype
    u: torch.Tensor | None  # [rows, Hv, Dv] in chunk_workspace_dtype (V' over U)
    cs: torch.Tensor  # [chunks, Hv, Dk, Dv] in chunk_workspace_dtype

    @classmethod
    def allocate(cls, rows: int, chunks: int, heads: int, dk: int, dv: int, dtype: torch.dtype, delta: bool,
                 device: torch.device) -> "ChunkWorkspaces":
        work = dict(dtype=chunk_workspace_dtype(dtype), device=device)
        return cls(torch.empty(rows, heads, dk, **work) if delta else None,
                   torch.empty(rows, heads, dv, **work) if delta else None,
                   torch.empty(chunks, heads, dk, dv, **work))

    def fits(self, rows: int, chunks: int, delta: bool) -> bool:
        if delta and (self.u is None or self.u.shape[0] < rows):
            return False
        return self.cs.shape[0] >= chunks


def chunk_state_workspace(chunks: int, heads: int, dk: int, dv: int, dtype: torch.dtype,
                          device: torch.device) -> torch.Tensor:
    """[chunks, heads, dk, dv] view of the cached chunk-state workspace in `dtype`
    (chunk_workspace_dtype of the inputs'): row c holds the state entering chunk c of the chunk
    table, as the state kernel left it for the output kernel. Cached and grown like
    `chunk_workspace`, by chunks (at least 16)."""
    key = (torch.device(device), heads, dk, dv, dtype)
    held = _STATE_WORKSPACES.get(key)
    if held is None or held.shape[0] < chunks:
        held = torch.empty(max(16, next_pow2(chunks)), heads, dk, dv, dtype=dtype, device=device)
        _STATE_WORKSPACES[key] = held
    return held[:chunks]


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _chunk_gates(g_ptr, start, n, head, stride_g_row, stride_g_head, BT: tl.constexpr, GATE: tl.constexpr):
    """Cumulative log-gates G of the chunk's BT rows (float32): G_i is the sum of the gates of rows
    0 .. i. Rows at or past n (the masked tail) hold the last real row's G, so G at row BT-1 is
    always the chunk's total decay. A scan rather than a [BT, BT] masked sum: it sits on the state
    kernel's sequential walk, once a chunk."""
    offs = tl.arange(0, BT)
    if GATE == 2:  # GATE_CONSTANT: one log-decay per head
        g = tl.load(g_ptr + head * stride_g_head).to(tl.float32)
        cum = (tl.minimum(offs, n - 1) + 1).to(tl.float32) * g
    else:
        gates = tl.load(g_ptr + (start + offs) * stride_g_row + head * stride_g_head, mask=offs < n, other=0.0)
        cum = tl.cumsum(gates.to(tl.float32), axis=0)
    return cum


@triton.jit
def _diagonal_block_inverses(tile, BT: tl.constexpr, BS: tl.constexpr):
    """(I + A_bb)^-1 for every diagonal [BS, BS] block b of the strictly lower [BT, BT] A at `tile`
    (row-major, in memory), by forward substitution, all blocks at once: row r of each inverse is
    e_r - sum_{j<r} a_rj (row j of it). The rows not yet reached hold e_j and a_rj = 0 for j >= r,
    so each step is one masked product; row r of A is loaded rather than picked out of a register
    tile (a reduction less a step), and the blocks' chains run side by side in one [NB, BS, BS]
    tile rather than one after another. Returns that tile."""
    NB: tl.constexpr = BT // BS
    blk = tl.arange(0, NB)
    offs = tl.arange(0, BS)
    inv = tl.where((offs[:, None] == offs[None, :])[None, :, :], 1.0, 0.0) + tl.zeros([NB, BS, BS], tl.float32)
    for r in tl.static_range(1, BS):
        a_r = tl.load(tile + (blk[:, None] * BS + r) * BT + blk[:, None] * BS + offs[None, :])  # [NB, BS]: j
        step = tl.sum(a_r[:, :, None] * inv, axis=1)  # [NB, BS]: sum_j a_rj inv_j
        inv = tl.where((offs == r)[None, :, None], inv - step[:, None, :], inv)
    return inv


@triton.jit
def _unit_lower_inverse_in_scratch(a, tile, BT: tl.constexpr, BS: tl.constexpr, DOT_PREC: tl.constexpr):
    """(I + a)^-1 of the strictly lower [BT, BT] tile a through `tile`, this program's [BT, BT]
    row-major scratch in memory (the matrix workspace): a is stored, its diagonal blocks inverted
    from rows read back, then block row by block row T_ij = -T_ii sum_{j<=c<i} A_ic T_cj from
    blocks read back (the blocks are read after a barrier, as other threads of the program wrote
    them). The earlier form, kept as a candidate (ChunkConfig.solve_in_registers=False)."""
    offs_t = tl.arange(0, BT)
    tl.store(tile + offs_t[:, None] * BT + offs_t[None, :], a)
    tl.debug_barrier()  # the blocks below are read back by other threads of this program
    # T over A: first every diagonal block T_ii = (I + A_ii)^-1, then block row by block row
    # T_ij = -T_ii sum_{j<=c<i} A_ic T_cj. Block (i, j) is overwritten after its last read (j
    # ascending); rows c < i hold T already (the barrier at the end of each block row).
    offs_s = tl.arange(0, BS)
    blk = tl.arange(0, BT // BS)
    diagonal = ((blk[:, None, None] * BS + offs_s[None, :, None]) * BT + blk[:, None, None] * BS
                + offs_s[None, None, :])
    inverses = _diagonal_block_inverses(tile, BT=BT, BS=BS)
    tl.debug_barrier()  # every thread's reads of the diagonal blocks of A are done
    tl.store(tile + diagonal, inverses)
    tl.debug_barrier()
    block = offs_s[:, None] * BT + offs_s[None, :]
    for i in tl.static_range(1, BT // BS):
        t_ii = tl.load(tile + i * BS * BT + i * BS + block)
        for j in tl.static_range(i):
            acc = tl.zeros([BS, BS], dtype=tl.float32)
            for c in tl.static_range(j, i):
                acc += tl.dot(tl.load(tile + i * BS * BT + c * BS + block), tl.load(tile + c * BS * BT + j * BS + block),
                              input_precision=DOT_PREC)
            tl.store(tile + i * BS * BT + j * BS + block, -tl.dot(t_ii, acc, input_precision=DOT_PREC))
        tl.debug_barrier()
    return tl.load(tile + offs_t[:, None] * BT + offs_t[None, :])


@triton.jit
def _unit_lower_inverse_in_registers(a, BT: tl.constexpr, BS: tl.constexpr, SQUARINGS: tl.constexpr,
                                     DOT_PREC: tl.constexpr):
    """(I + a)^-1 of the strictly lower [BT, BT] tile a, in registers (no memory, no barrier).

    With D = I + (a's diagonal [BS, BS] blocks) and L = a's blocks below them, I + a = D (I + N),
    N = D^-1 L. D^-1: forward substitution on every diagonal block side by side in one [NB, BS, BS]
    tile (_diagonal_block_inverses' steps, row r of a picked out by a masked sum instead of a load).
    N is strictly lower by blocks, so N^NB = 0 and (I + N)^-1 = (I - N)(I + N^2)(I + N^4)..., one
    factor per squaring (SQUARINGS = log2(NB) - 1). Stable where the row-level product is not
    (module docstring, the inverse): its powers are of N, D^-1 already applied, at most NB - 1 of
    them, not of A over BT rows."""
    NB: tl.constexpr = BT // BS
    offs_t = tl.arange(0, BT)
    offs_s = tl.arange(0, BS)
    blk = tl.arange(0, NB)
    same = blk[:, None, None, None] == blk[None, None, :, None]  # [NB, 1, NB, 1]: a diagonal block
    a_diag = tl.sum(tl.where(same, tl.reshape(a, [NB, BS, NB, BS]), 0.0), axis=2)  # [NB, BS, BS]: A_bb
    inv = tl.where((offs_s[:, None] == offs_s[None, :])[None, :, :], 1.0, 0.0) + tl.zeros([NB, BS, BS], tl.float32)
    for r in tl.static_range(1, BS):
        at_r = (offs_s == r)[None, :, None]
        a_r = tl.sum(tl.where(at_r, a_diag, 0.0), axis=1)  # [NB, BS]: row r of every block
        inv = tl.where(at_r, inv - tl.sum(a_r[:, :, None] * inv, axis=1)[:, None, :], inv)
    d_inv = tl.reshape(tl.where(same, inv[:, :, None, :], 0.0), [BT, BT])  # block diagonal
    if NB == 1:
        t = d_inv
    else:
        below = offs_t[:, None] // BS > offs_t[None, :] // BS
        nil = tl.dot(d_inv, tl.where(below, a, 0.0), input_precision=DOT_PREC)  # N = D^-1 L
        eye = tl.where(offs_t[:, None] == offs_t[None, :], 1.0, 0.0)
        inv_n = eye - nil
        for _ in tl.static_range(SQUARINGS):
            nil = tl.dot(nil, nil, input_precision=DOT_PREC)
            inv_n = tl.dot(inv_n, eye + nil, input_precision=DOT_PREC)
        t = tl.dot(inv_n, d_inv, input_precision=DOT_PREC)
    return t


@triton.jit
def _times_t(t, rhs, DOT_PREC: tl.constexpr, LOWP: tl.constexpr):
    """T rhs for a float32 right-hand side [BT, D]: in T's 16 bits with LOWP (t already rounded),
    else float32 operands at DOT_PREC."""
    if LOWP:
        prod = tl.dot(t, rhs.to(t.dtype))
    else:
        prod = tl.dot(t, rhs, input_precision=DOT_PREC)
    return prod


@triton.jit
def _chunk_solve_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, t_ptr, bounds_ptr, chunks_ptr,
    stride_k_row, stride_k_head, stride_v_row, stride_v_head, stride_g_row, stride_g_head,
    stride_b_row, stride_b_head, stride_w_row, stride_w_head, stride_u_row, stride_u_head,
    stride_t_chunk, stride_t_head, num_seqs, table_seqs,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
    BVF: tl.constexpr,  # next power of two >= DV (at least 16): all of Dv in one program
    BKW: tl.constexpr,  # key columns of W this program stores (BK: all of them)
    BVW: tl.constexpr,  # value columns of U this program stores (BVF: all of them)
    BT: tl.constexpr, BS: tl.constexpr, GATE: tl.constexpr, DOT_PREC: tl.constexpr, LOWP: tl.constexpr,
    SCRATCH: tl.constexpr,  # T through the matrix workspace t (else in registers; t is then never read)
    SQUARINGS: tl.constexpr,  # log2(BT // BS) - 1, at least 0
    WALK: tl.constexpr, BR: tl.constexpr,  # `_table_programs`; BR: the requests the live rows are summed over at once
):
    """W and U of one chunk and value head (module docstring): A, then T = (I + A)^-1 by blocks,
    then W = T R_w and U = T R_u, in column tile program_id(2) of each (BKW and BVW columns: every
    tile's program forms T). Request num_seqs (the padding rows) has no W or U. WALK: program
    (c, ...) takes chunk rows c, c + the grid's width, ... up to the table's last row with rows
    (`_table_programs`)."""
    head = tl.program_id(1)
    col_tile = tl.program_id(2)
    # A program that does not walk takes its row outside any loop. As a loop of one trip (the
    # walk's loop with its bounds set to the program's row) the kernels with 16-bit products and
    # the solve in registers gave wrong outputs and states on an H100 at key and value head dims of
    # 16 and 32 (64 and up were right; float32 products, or T through the matrix workspace, right
    # at every size, so the solve in registers is where it goes wrong): tests/gpu/test_gpu_linear_kernels.py
    # small_head_dims, and the GPU graph tests' start-up parity, whose padded and unpadded eager
    # steps of the same requests then differed (gdn_fused_padding_probe.py,
    # benchmarks/results/gdn_fused_padding_probe_h100_2026-12-07.json). A walking program's loop at
    # those dims is not checked on a GPU.
    if WALK:
        for chunk in range(tl.program_id(0).to(tl.int64), _first_chunk(bounds_ptr, table_seqs, BT=BT, BR=BR),
                           tl.num_programs(0)):
            _solve_chunk(chunk, head, col_tile, k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, t_ptr, bounds_ptr,
                         chunks_ptr, stride_k_row, stride_k_head, stride_v_row, stride_v_head, stride_g_row,
                         stride_g_head, stride_b_row, stride_b_head, stride_w_row, stride_w_head, stride_u_row,
                         stride_u_head, stride_t_chunk, stride_t_head, num_seqs, GROUP=GROUP, DK=DK, DV=DV, BK=BK,
                         BKW=BKW, BVW=BVW, BT=BT, BS=BS, GATE=GATE, DOT_PREC=DOT_PREC, LOWP=LOWP, SCRATCH=SCRATCH,
                         SQUARINGS=SQUARINGS)
    else:
        _solve_chunk(tl.program_id(0).to(tl.int64), head, col_tile, k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr,
                     t_ptr, bounds_ptr, chunks_ptr, stride_k_row, stride_k_head, stride_v_row, stride_v_head,
                     stride_g_row, stride_g_head, stride_b_row, stride_b_head, stride_w_row, stride_w_head,
                     stride_u_row, stride_u_head, stride_t_chunk, stride_t_head, num_seqs, GROUP=GROUP, DK=DK,
                     DV=DV, BK=BK, BKW=BKW, BVW=BVW, BT=BT, BS=BS, GATE=GATE, DOT_PREC=DOT_PREC, LOWP=LOWP,
                     SCRATCH=SCRATCH, SQUARINGS=SQUARINGS)


@triton.jit
def _solve_chunk(chunk, head, col_tile, k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, t_ptr, bounds_ptr, chunks_ptr,
                 stride_k_row, stride_k_head, stride_v_row, stride_v_head, stride_g_row, stride_g_head,
                 stride_b_row, stride_b_head, stride_w_row, stride_w_head, stride_u_row, stride_u_head,
                 stride_t_chunk, stride_t_head, num_seqs,
                 GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                 BKW: tl.constexpr, BVW: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, GATE: tl.constexpr,
                 DOT_PREC: tl.constexpr, LOWP: tl.constexpr, SCRATCH: tl.constexpr, SQUARINGS: tl.constexpr):
    """`_chunk_solve_kernel`'s work for chunk row `chunk` of the table."""
    key_head = head // GROUP
    req = tl.load(chunks_ptr + 2 * chunk)
    start = tl.load(bounds_ptr + req) + tl.load(chunks_ptr + 2 * chunk + 1) * BT  # the request's j-th chunk
    n = tl.minimum(tl.load(bounds_ptr + req + 1) - start, BT)
    # n <= 0: a row of a captured step's table past the step's chunks (an empty request's)
    if (n > 0) & (req != num_seqs):
        offs_t = tl.arange(0, BT)
        offs_k = tl.arange(0, BK)
        m_t = offs_t < n
        m_k = offs_k < DK
        rows = start + offs_t
        k = tl.load(k_ptr + rows[:, None] * stride_k_row + key_head * stride_k_head + offs_k[None, :],
                    mask=m_t[:, None] & m_k[None, :], other=0.0)
        beta = tl.load(beta_ptr + rows * stride_b_row + head * stride_b_head, mask=m_t, other=0.0).to(tl.float32)
        gate = _chunk_gates(g_ptr, start, n, head, stride_g_row, stride_g_head, BT=BT, GATE=GATE)
        if LOWP:  # 16-bit keys: their products are exact either way, the 16-bit tensor cores faster
            kk = tl.dot(k, tl.trans(k))
        else:
            kk = tl.dot(k.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=DOT_PREC)
        # A, strictly lower, masked before exp (G_i - G_j > 0 above the diagonal could overflow)
        lower = offs_t[:, None] > offs_t[None, :]
        a = tl.where(lower, beta[:, None] * kk * tl.exp(tl.where(lower, gate[:, None] - gate[None, :], 0.0)), 0.0)
        if SCRATCH:
            t = _unit_lower_inverse_in_scratch(a, t_ptr + chunk * stride_t_chunk + head * stride_t_head, BT=BT, BS=BS,
                                               DOT_PREC=DOT_PREC)
        else:
            t = _unit_lower_inverse_in_registers(a, BT=BT, BS=BS, SQUARINGS=SQUARINGS, DOT_PREC=DOT_PREC)
        if LOWP:  # T and the right-hand sides in the workspace's 16 bits, as FLA's (module docstring, precision)
            t = t.to(w_ptr.dtype.element_ty)
        # W, then U: one [BT, D] right-hand side live at a time. Only the chunk's own rows are stored:
        # the rows after it belong to the next request.
        if BKW == BK:
            k_cols = k
        else:  # this tile's key columns, again from memory (the whole rows were loaded for A)
            offs_k = col_tile * BKW + tl.arange(0, BKW)
            m_k = offs_k < DK
            k_cols = tl.load(k_ptr + rows[:, None] * stride_k_row + key_head * stride_k_head + offs_k[None, :],
                             mask=m_t[:, None] & m_k[None, :], other=0.0)
        w = _times_t(t, (beta * tl.exp(gate))[:, None] * k_cols.to(tl.float32), DOT_PREC=DOT_PREC, LOWP=LOWP)
        tl.store(w_ptr + rows[:, None] * stride_w_row + head * stride_w_head + offs_k[None, :],
                 w.to(w_ptr.dtype.element_ty), mask=m_t[:, None] & m_k[None, :])
        offs_v = col_tile * BVW + tl.arange(0, BVW)
        m_v = offs_v < DV
        v = tl.load(v_ptr + rows[:, None] * stride_v_row + head * stride_v_head + offs_v[None, :],
                    mask=m_t[:, None] & m_v[None, :], other=0.0)
        u = _times_t(t, beta[:, None] * v.to(tl.float32), DOT_PREC=DOT_PREC, LOWP=LOWP)
        tl.store(u_ptr + rows[:, None] * stride_u_row + head * stride_u_head + offs_v[None, :],
                 u.to(u_ptr.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])


@triton.jit
def _first_chunk(bounds_ptr, req, BT: tl.constexpr, BR: tl.constexpr):
    """Request req's first row of the chunk table: the chunks of the requests before it, which
    the chunk table lists first (requests in order), summed from the bounds BR requests at a time."""
    first = tl.full([], 0, tl.int64)
    for base in range(0, req, BR):
        offs = base + tl.arange(0, BR)
        m = offs < req
        lo = tl.load(bounds_ptr + offs, mask=m, other=0).to(tl.int64)
        hi = tl.load(bounds_ptr + offs + 1, mask=m, other=0).to(tl.int64)
        first += tl.sum((hi - lo + BT - 1) // BT, axis=0)
    return first


@triton.jit
def _chunk_advance(s, k, v_new, gate, total, cs_ptr, DOT_PREC: tl.constexpr, LOWP: tl.constexpr):
    """The state after a chunk's rows: exp(G_total) S + (K * exp(G_total - G))^T V', as K^T (decay * V'):
    the decay scales the [BT, BV] tile rather than the [BT, Dk] one, and k goes from memory to the
    product as it is. Rows whose V' is zero (masked) add nothing."""
    v_decayed = v_new * tl.exp(total - gate)[:, None]
    if LOWP:  # 16-bit operands: the workspaces' dtype (module docstring, precision)
        return s * tl.exp(total) + tl.dot(tl.trans(k.to(cs_ptr.dtype.element_ty)),
                                          v_decayed.to(cs_ptr.dtype.element_ty))
    return s * tl.exp(total) + tl.dot(tl.trans(k.to(tl.float32)), v_decayed, input_precision=DOT_PREC)


@triton.jit
def _chunk_walk_step(s, start, eos, chunk, head, offs_t, offs_k, offs_v, m_k, m_v, cs_tile,
                     k_ptr, g_ptr, w_ptr, vp_ptr, cs_ptr,
                     stride_k_row, stride_k_head, stride_g_row, stride_g_head, stride_w_row, stride_w_head,
                     stride_vp_row, stride_vp_head, stride_cs_chunk,
                     GROUP: tl.constexpr, BT: tl.constexpr, GATE: tl.constexpr, DELTA: tl.constexpr,
                     DOT_PREC: tl.constexpr, LOWP: tl.constexpr):
    """One chunk of the walk from state s (S_c): stores S_c, forms V' (stored over U with the delta
    rule) and returns (S_c+1, k, V', G) of the chunk's rows, the last three for a snapshot inside it."""
    tl.store(cs_tile + chunk * stride_cs_chunk, s.to(cs_ptr.dtype.element_ty), mask=m_k[:, None] & m_v[None, :])
    n = tl.minimum(eos - start, BT)
    m_t = offs_t < n
    rows = start + offs_t
    m_tk = m_t[:, None] & m_k[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    vp_ptrs = vp_ptr + rows[:, None] * stride_vp_row + head * stride_vp_head + offs_v[None, :]
    v_new = tl.load(vp_ptrs, mask=m_tv, other=0.0).to(tl.float32)
    if DELTA:
        w = tl.load(w_ptr + rows[:, None] * stride_w_row + head * stride_w_head + offs_k[None, :], mask=m_tk,
                    other=0.0)
        if LOWP:
            v_new -= tl.dot(w.to(cs_ptr.dtype.element_ty), s.to(cs_ptr.dtype.element_ty))
        else:
            v_new -= tl.dot(w.to(tl.float32), s, input_precision=DOT_PREC)
        # Over U: this program alone reads and writes these rows' columns of this head.
        tl.store(vp_ptrs, v_new.to(vp_ptr.dtype.element_ty), mask=m_tv)
    k = tl.load(k_ptr + rows[:, None] * stride_k_row + (head // GROUP) * stride_k_head + offs_k[None, :], mask=m_tk,
                other=0.0)
    gate = _chunk_gates(g_ptr, start, n, head, stride_g_row, stride_g_head, BT=BT, GATE=GATE)
    total = tl.sum(tl.where(offs_t == BT - 1, gate, 0.0), axis=0)  # the chunk's G_last (masked rows repeat it)
    return _chunk_advance(s, k, v_new, gate, total, cs_ptr, DOT_PREC=DOT_PREC, LOWP=LOWP), k, v_new, gate


@triton.jit
def _chunk_state_kernel(
    k_ptr, g_ptr, w_ptr, vp_ptr, cs_ptr, state_ptr, slots_ptr, bounds_ptr, snap_rows_ptr, snap_ids_ptr, snap_ptr,
    stride_k_row, stride_k_head, stride_g_row, stride_g_head, stride_w_row, stride_w_head,
    stride_vp_row, stride_vp_head, stride_cs_chunk, stride_cs_head, stride_s_slot, stride_s_head,
    stride_snap_slot, stride_snap_head, num_seqs,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, BR: tl.constexpr, GATE: tl.constexpr, DELTA: tl.constexpr, DOT_PREC: tl.constexpr,
    LOWP: tl.constexpr, PAD_SLOT: tl.constexpr, WALK: tl.constexpr, BL: tl.constexpr,
):
    """One request's chunks in order through one [BK, BV] state tile: per chunk the state entering it
    (to the chunk-state workspace cs, [chunks, Hv, Dk, Dv] contiguous in its last two dims), V' and
    the next state; the last state back to the slot. vp is U with the delta rule (V' is written over
    it) and V without (read only). A request on the padding slot (a graph capture's placeholder
    requests) starts from a zero state and writes none back: the padding slot is never touched.

    In-step snapshot: where snap_rows[req] = r >= 0, the state after the request's first r rows also
    goes to snapshot snap_ids[req] of snap (the prefix cache's pool, the slot's layout). The walk
    stops at the chunk holding row r, takes that chunk's step, forms the state after its first
    j = r - (chunk start) rows from the same S_c, V', K and G (rows from j on masked out: the state
    the walk would end with on a request of r rows), and walks on. The two walks are plain loops,
    so the compiler pipelines each as it did the one.

    WALK: program (r, ...) takes requests r, r + the grid's width, ... up to the last of the
    num_seqs requests with rows (`_requests_with_rows`, BL requests at a time; `_table_programs` says
    why)."""
    head = tl.program_id(1)
    v_tile = tl.program_id(2)
    # A request's chunk walk is a software-pipelined loop, which a program that does not walk keeps
    # outside any other loop, as the timed kernel had it (and as the solve and output kernels do).
    if WALK:
        live = _requests_with_rows(bounds_ptr, num_seqs, BR=BL)
        for req in range(tl.program_id(0).to(tl.int64), live, tl.num_programs(0)):
            _state_request(req, head, v_tile, k_ptr, g_ptr, w_ptr, vp_ptr, cs_ptr, state_ptr, slots_ptr,
                           bounds_ptr, snap_rows_ptr, snap_ids_ptr, snap_ptr, stride_k_row, stride_k_head,
                           stride_g_row, stride_g_head, stride_w_row, stride_w_head, stride_vp_row, stride_vp_head,
                           stride_cs_chunk, stride_cs_head, stride_s_slot, stride_s_head, stride_snap_slot,
                           stride_snap_head, GROUP=GROUP, DK=DK, DV=DV, BK=BK, BV=BV, BT=BT, BR=BR, GATE=GATE,
                           DELTA=DELTA, DOT_PREC=DOT_PREC, LOWP=LOWP, PAD_SLOT=PAD_SLOT)
    else:
        _state_request(tl.program_id(0).to(tl.int64), head, v_tile, k_ptr, g_ptr, w_ptr, vp_ptr, cs_ptr, state_ptr,
                       slots_ptr, bounds_ptr, snap_rows_ptr, snap_ids_ptr, snap_ptr, stride_k_row, stride_k_head,
                       stride_g_row, stride_g_head, stride_w_row, stride_w_head, stride_vp_row, stride_vp_head,
                       stride_cs_chunk, stride_cs_head, stride_s_slot, stride_s_head, stride_snap_slot,
                       stride_snap_head, GROUP=GROUP, DK=DK, DV=DV, BK=BK, BV=BV, BT=BT, BR=BR, GATE=GATE,
                       DELTA=DELTA, DOT_PREC=DOT_PREC, LOWP=LOWP, PAD_SLOT=PAD_SLOT)


@triton.jit
def _requests_with_rows(bounds_ptr, num_seqs, BR: tl.constexpr):
    """One past the last of requests 0 .. num_seqs-1 with rows: the requests that start before
    bounds[num_seqs] (the bounds never decrease), counted BR at a time."""
    end = tl.load(bounds_ptr + num_seqs).to(tl.int64)
    n = tl.full([], 0, tl.int64)
    for base in range(0, num_seqs, BR):
        offs = base + tl.arange(0, BR)
        lo = tl.load(bounds_ptr + offs, mask=offs < num_seqs, other=0).to(tl.int64)
        n += tl.sum(((lo < end) & (offs < num_seqs)).to(tl.int64), axis=0)
    return n


@triton.jit
def _state_request(req, head, v_tile, k_ptr, g_ptr, w_ptr, vp_ptr, cs_ptr, state_ptr, slots_ptr, bounds_ptr,
                   snap_rows_ptr, snap_ids_ptr, snap_ptr, stride_k_row, stride_k_head, stride_g_row, stride_g_head,
                   stride_w_row, stride_w_head, stride_vp_row, stride_vp_head, stride_cs_chunk, stride_cs_head,
                   stride_s_slot, stride_s_head, stride_snap_slot, stride_snap_head,
                   GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   BT: tl.constexpr, BR: tl.constexpr, GATE: tl.constexpr, DELTA: tl.constexpr,
                   DOT_PREC: tl.constexpr, LOWP: tl.constexpr, PAD_SLOT: tl.constexpr):
    """`_chunk_state_kernel`'s work for request `req`, Dv tile `v_tile` of value head `head`."""
    bos = tl.load(bounds_ptr + req).to(tl.int64)
    eos = tl.load(bounds_ptr + req + 1).to(tl.int64)
    if eos > bos:  # a request without rows keeps its state as it is (not even rewritten)
        offs_t = tl.arange(0, BT)
        offs_k = tl.arange(0, BK)
        offs_v = v_tile * BV + tl.arange(0, BV)
        m_k = offs_k < DK
        m_v = offs_v < DV
        slot = tl.load(slots_ptr + req).to(tl.int64)
        # slot ids are int64 and the pool can exceed 2**31 elements: offsets stay int64.
        s_ptrs = state_ptr + slot * stride_s_slot + head * stride_s_head + offs_k[:, None] * DV + offs_v[None, :]
        m_s = m_k[:, None] & m_v[None, :]
        # the padding slot's tile: neither read nor written (a [BK, BV] mask: the interpreter takes no
        # scalar in a mask)
        m_own = m_s & ((offs_k[:, None] * 0 + slot) != PAD_SLOT)
        s = tl.load(s_ptrs, mask=m_own, other=0.0).to(tl.float32)  # a bfloat16 pool's too: the walk is float32
        cs_tile = cs_ptr + head * stride_cs_head + offs_k[:, None] * DV + offs_v[None, :]
        first = _first_chunk(bounds_ptr, req, BT=BT, BR=BR)
        # Tables of requests with rows only: a captured step's extra request has none.
        snap_row = tl.load(snap_rows_ptr + req).to(tl.int64)
        snap_at = tl.where(snap_row >= 0, bos + snap_row, eos)  # eos: no snapshot in this step
        mid = bos + (snap_at - bos) // BT * BT  # the start of the chunk holding the snapshot's row
        for start in range(bos, tl.where(snap_at < eos, mid, eos), BT):
            s, _k, _v, _g = _chunk_walk_step(
                s, start, eos, first + (start - bos) // BT, head, offs_t, offs_k, offs_v, m_k, m_v, cs_tile,
                k_ptr, g_ptr, w_ptr, vp_ptr, cs_ptr, stride_k_row, stride_k_head, stride_g_row, stride_g_head,
                stride_w_row, stride_w_head, stride_vp_row, stride_vp_head, stride_cs_chunk,
                GROUP=GROUP, BT=BT, GATE=GATE, DELTA=DELTA, DOT_PREC=DOT_PREC, LOWP=LOWP)
        if snap_at < eos:
            before = s
            s, k, v_new, gate = _chunk_walk_step(
                s, mid, eos, first + (mid - bos) // BT, head, offs_t, offs_k, offs_v, m_k, m_v, cs_tile,
                k_ptr, g_ptr, w_ptr, vp_ptr, cs_ptr, stride_k_row, stride_k_head, stride_g_row, stride_g_head,
                stride_w_row, stride_w_head, stride_vp_row, stride_vp_head, stride_cs_chunk,
                GROUP=GROUP, BT=BT, GATE=GATE, DELTA=DELTA, DOT_PREC=DOT_PREC, LOWP=LOWP)
            j = snap_at - mid  # rows of the chunk before the snapshot point; 0: the state entering it
            upto = tl.sum(tl.where(offs_t == j - 1, gate, 0.0), axis=0)  # G_(j-1); 0 for j = 0
            kept = tl.where((offs_t < j)[:, None], v_new, 0.0)
            snap = _chunk_advance(before, k, kept, tl.where(offs_t < j, gate, upto), upto, cs_ptr,
                                  DOT_PREC=DOT_PREC, LOWP=LOWP)
            snap_id = tl.load(snap_ids_ptr + req).to(tl.int64)
            tl.store(snap_ptr + snap_id * stride_snap_slot + head * stride_snap_head + offs_k[:, None] * DV
                     + offs_v[None, :], snap.to(snap_ptr.dtype.element_ty), mask=m_s)
            for start in range(mid + BT, eos, BT):
                s, _k, _v, _g = _chunk_walk_step(
                    s, start, eos, first + (start - bos) // BT, head, offs_t, offs_k, offs_v, m_k, m_v, cs_tile,
                    k_ptr, g_ptr, w_ptr, vp_ptr, cs_ptr, stride_k_row, stride_k_head, stride_g_row, stride_g_head,
                    stride_w_row, stride_w_head, stride_vp_row, stride_vp_head, stride_cs_chunk,
                    GROUP=GROUP, BT=BT, GATE=GATE, DELTA=DELTA, DOT_PREC=DOT_PREC, LOWP=LOWP)
        # Only this program owns this tile of this slot (requests have distinct slots).
        tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=m_own)


@triton.jit
def _chunk_output(q_ptr, k_ptr, vp_ptr, g_ptr, cs_ptr, start, n, chunk, head, offs_v, m_tv,
                  stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_vp_row, stride_vp_head,
                  stride_g_row, stride_g_head, stride_cs_chunk, stride_cs_head,
                  GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, KB: tl.constexpr,
                  BV: tl.constexpr, BT: tl.constexpr, GATE: tl.constexpr, DOT_PREC: tl.constexpr,
                  LOWP: tl.constexpr):
    """The chunk's unscaled outputs [BT, BV] float32 (rows at or past n are not meaningful)."""
    key_head = head // GROUP
    offs_t = tl.arange(0, BT)
    m_t = offs_t < n
    m_v = offs_v < DV
    rows = start + offs_t
    gate = _chunk_gates(g_ptr, start, n, head, stride_g_row, stride_g_head, BT=BT, GATE=GATE)
    q_decay = tl.exp(gate)[:, None]
    cs_chunk = cs_ptr + chunk * stride_cs_chunk + head * stride_cs_head
    scores = tl.zeros([BT, BT], dtype=tl.float32)
    o = tl.zeros([BT, BV], dtype=tl.float32)
    for kb in tl.static_range(BK // KB):
        offs_k = kb * KB + tl.arange(0, KB)
        m_k = offs_k < DK
        m_tk = m_t[:, None] & m_k[None, :]
        q = tl.load(q_ptr + rows[:, None] * stride_q_row + key_head * stride_q_head + offs_k[None, :], mask=m_tk,
                    other=0.0)
        k = tl.load(k_ptr + rows[:, None] * stride_k_row + key_head * stride_k_head + offs_k[None, :], mask=m_tk,
                    other=0.0)
        s = tl.load(cs_chunk + offs_k[:, None] * DV + offs_v[None, :], mask=m_k[:, None] & m_v[None, :],
                    other=0.0)
        if LOWP:  # q and k in their own 16-bit dtype, S_c in its stored one (module docstring, precision)
            scores += tl.dot(q, tl.trans(k))
            o += tl.dot((q.to(tl.float32) * q_decay).to(cs_ptr.dtype.element_ty), s)
        else:
            q = q.to(tl.float32)
            scores += tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=DOT_PREC)
            o += tl.dot(q * q_decay, s.to(tl.float32), input_precision=DOT_PREC)
    # intra-chunk attention, masked before exp (G_i - G_j > 0 above the diagonal could overflow)
    causal = offs_t[:, None] >= offs_t[None, :]
    p = tl.where(causal, scores * tl.exp(tl.where(causal, gate[:, None] - gate[None, :], 0.0)), 0.0)
    v_new = tl.load(vp_ptr + rows[:, None] * stride_vp_row + head * stride_vp_head + offs_v[None, :], mask=m_tv,
                    other=0.0)
    if LOWP:  # V' as stored (the workspaces' dtype; V without the delta rule, cast to it)
        o += tl.dot(p.to(cs_ptr.dtype.element_ty), v_new.to(cs_ptr.dtype.element_ty))
    else:
        o += tl.dot(p, v_new.to(tl.float32), input_precision=DOT_PREC)
    return o


@triton.jit
def _chunk_output_kernel(
    q_ptr, k_ptr, vp_ptr, g_ptr, cs_ptr, out_ptr, bounds_ptr, chunks_ptr, z_ptr, norm_w_ptr,
    stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_vp_row, stride_vp_head,
    stride_g_row, stride_g_head, stride_o_row, stride_o_head, stride_cs_chunk, stride_cs_head,
    stride_z_row, stride_z_head, scale, eps, num_seqs, table_seqs,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, KB: tl.constexpr,
    BV: tl.constexpr, BT: tl.constexpr, GATE: tl.constexpr, DOT_PREC: tl.constexpr, LOWP: tl.constexpr,
    WALK: tl.constexpr, BR: tl.constexpr,  # as the solve kernel's
    NORM: tl.constexpr, ROUND_Y: tl.constexpr,  # the gated norm after the outputs (`GatedNorm`)
):
    """One chunk's output rows for one value head and Dv tile, from the state entering the chunk (cs)
    and V' (vp: V' over U with the delta rule, V without), the key dimension KB columns at a time.
    A chunk of request num_seqs (the padding rows) stores zeros and reads nothing. WALK: as the
    solve kernel's. NORM (one Dv tile a head): each row's head rounded to out's dtype, as the core
    would be stored, then GatedRMSNorm'd with z and the norm weight before it is stored."""
    head = tl.program_id(1)
    v_tile = tl.program_id(2)
    if WALK:  # as the solve kernel's: a program that does not walk takes its row outside any loop
        for chunk in range(tl.program_id(0).to(tl.int64), _first_chunk(bounds_ptr, table_seqs, BT=BT, BR=BR),
                           tl.num_programs(0)):
            _output_chunk(chunk, head, v_tile, q_ptr, k_ptr, vp_ptr, g_ptr, cs_ptr, out_ptr, bounds_ptr, chunks_ptr,
                          z_ptr, norm_w_ptr,
                          stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_vp_row, stride_vp_head,
                          stride_g_row, stride_g_head, stride_o_row, stride_o_head, stride_cs_chunk, stride_cs_head,
                          stride_z_row, stride_z_head, scale, eps, num_seqs, GROUP=GROUP, DK=DK, DV=DV, BK=BK, KB=KB,
                          BV=BV, BT=BT, GATE=GATE, DOT_PREC=DOT_PREC, LOWP=LOWP, NORM=NORM, ROUND_Y=ROUND_Y)
    else:
        _output_chunk(tl.program_id(0).to(tl.int64), head, v_tile, q_ptr, k_ptr, vp_ptr, g_ptr, cs_ptr, out_ptr,
                      bounds_ptr, chunks_ptr, z_ptr, norm_w_ptr, stride_q_row, stride_q_head, stride_k_row,
                      stride_k_head, stride_vp_row, stride_vp_head, stride_g_row, stride_g_head, stride_o_row,
                      stride_o_head, stride_cs_chunk, stride_cs_head, stride_z_row, stride_z_head, scale, eps,
                      num_seqs, GROUP=GROUP, DK=DK, DV=DV, BK=BK, KB=KB, BV=BV, BT=BT, GATE=GATE, DOT_PREC=DOT_PREC,
                      LOWP=LOWP, NORM=NORM, ROUND_Y=ROUND_Y)


@triton.jit
def _output_chunk(chunk, head, v_tile, q_ptr, k_ptr, vp_ptr, g_ptr, cs_ptr, out_ptr, bounds_ptr, chunks_ptr,
                  z_ptr, norm_w_ptr,
                  stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_vp_row, stride_vp_head,
                  stride_g_row, stride_g_head, stride_o_row, stride_o_head, stride_cs_chunk, stride_cs_head,
                  stride_z_row, stride_z_head, scale, eps, num_seqs,
                  GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, KB: tl.constexpr,
                  BV: tl.constexpr, BT: tl.constexpr, GATE: tl.constexpr, DOT_PREC: tl.constexpr,
                  LOWP: tl.constexpr, NORM: tl.constexpr, ROUND_Y: tl.constexpr):
    """`_chunk_output_kernel`'s work for chunk row `chunk` of the table."""
    req = tl.load(chunks_ptr + 2 * chunk)
    start = tl.load(bounds_ptr + req) + tl.load(chunks_ptr + 2 * chunk + 1) * BT  # the request's j-th chunk
    n = tl.minimum(tl.load(bounds_ptr + req + 1) - start, BT)
    if n > 0:  # else a row of a captured step's table past the step's chunks (an empty request's)
        offs_t = tl.arange(0, BT)
        offs_v = v_tile * BV + tl.arange(0, BV)
        m_tv = (offs_t < n)[:, None] & (offs_v < DV)[None, :]
        # Only the chunk's own rows: the rows after it belong to the next request (or to the padding).
        o_ptrs = out_ptr + (start + offs_t)[:, None] * stride_o_row + head * stride_o_head + offs_v[None, :]
        if req == num_seqs:
            # padding rows: their inputs may hold anything; they read nothing and come out zero
            tl.store(o_ptrs, tl.zeros([BT, BV], dtype=out_ptr.dtype.element_ty), mask=m_tv)
        else:
            o = _chunk_output(q_ptr, k_ptr, vp_ptr, g_ptr, cs_ptr, start, n, chunk, head, offs_v, m_tv,
                              stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_vp_row, stride_vp_head,
                              stride_g_row, stride_g_head, stride_cs_chunk, stride_cs_head,
                              GROUP=GROUP, DK=DK, DV=DV, BK=BK, KB=KB, BV=BV, BT=BT, GATE=GATE, DOT_PREC=DOT_PREC,
                              LOWP=LOWP)
            act = out_ptr.dtype.element_ty
            y = (o * scale).to(act)  # the core as the unfused op stores it
            if NORM:
                z = tl.load(z_ptr + (start + offs_t)[:, None] * stride_z_row + head * stride_z_head + offs_v[None, :],
                            mask=m_tv, other=0.0).to(tl.float32)
                weight = tl.load(norm_w_ptr + offs_v, mask=offs_v < DV, other=0.0).to(tl.float32)
                y = gated_norm_head(y.to(tl.float32), z, weight[None, :], m_tv, eps, DV, act, ROUND_Y).to(act)
            tl.store(o_ptrs, y, mask=m_tv)


# ---------------------------------------------------------------------------------------------
# launcher (host side: shape checks only, never a device read)
# ---------------------------------------------------------------------------------------------

_CHUNK_SOLVE = Launcher(_chunk_solve_kernel)
_CHUNK_STATE = Launcher(_chunk_state_kernel)
_CHUNK_OUTPUT = Launcher(_chunk_output_kernel)


def chunk_extend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, beta: torch.Tensor | None,
                 out: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, bounds: torch.Tensor,
                 chunks: torch.Tensor, scale: float, gate_kind: int, block_t: int | None = None,
                 config: ChunkConfig | None = None, workspaces: ChunkWorkspaces | None = None,
                 snapshots: StepSnapshots | None = None, gated_norm: GatedNorm | None = None) -> None:
    """The recurrent cores of an extend step by chunks, over the slot-indexed pool, in place.

    q, k [T, Hk, Dk]; v, out [T, Hv, Dv] (value head h reads key head h // (Hv // Hk)); gate [T, Hv]
    (GATE_PER_HEAD) or [Hv] (GATE_CONSTANT) log-decays; beta [T, Hv] (the delta rule) or None;
    state [num_slots+1, Hv, Dk, Dv] float32 or bfloat16; slots [R] int64, request r's state slot (no padding
    slot); bounds [R+1] int64, request r owns rows bounds[r] .. bounds[r+1]-1 (maybe none); chunks
    [N, 2] int64 on the device, (request, chunk j) rows: launch_math.token_blocks of the requests'
    lengths for this block_t (chunk j of request r starts at row bounds[r] + j * block_t); block_t
    None: `chunk_length` of the step's rows (q.shape[0]), whose table is the one of CHUNK_T-row
    chunks. Rows from bounds[R] on are not touched. The host reads no device value: the tables are the step's plan.

    Or bounds [R+2]: then request R, which has no slot, owns the padding rows bounds[R] ..
    bounds[R+1]-1 (bounds[R+1] is the step's row count), the chunk table lists its chunks after the
    real ones, and the output kernel stores zeros there (no solve, no state walk); every row of
    `out` is then written, so a caller whose real row count lives on the device only (a captured
    step) needs no fill of `out` before.

    Inside a captured graph the tables are static buffers padded to the bucket (the backend's
    static plan): slots and bounds for more requests than the step has, the extra ones empty
    (bounds[r] == bounds[r+1]: their programs do nothing), the padding rows as request R, and the
    chunk table's extra rows naming an empty request (their programs store nothing; over such a
    table each kernel launches fewer programs, each walking its rows: `_table_programs`); `workspaces`
    are then the caller's own, sized for the largest bucket (ChunkWorkspaces). Requests on the
    padding slot read a zero state and write none back.

    `snapshots`: the step's in-step snapshots (StepSnapshots; None: none), request r's state after
    its first rows[r] rows of the step into snapshot ids[r] of the pool tensor.

    `gated_norm` (GatedNorm; None: none): `out` receives GatedRMSNorm(core, z) instead of the core,
    each row's head normalised by the output kernel as it stores it (`gated_norm_head`, the values
    of the core rounded to out's dtype then `gated_rmsnorm`): one launch and the core's round trip
    through memory fewer. Its programs then take a head's whole Dv row (one Dv tile)."""
    op = OP_OF_GATE[gate_kind]
    if gate_kind == GATE_PER_CHANNEL:
        raise ValueError(f"{op}: chunk_extend takes per-head or constant log-decays; per-channel gates (KDA) "
                         f"run FLA's chunk kernels")
    if block_t is not None and (block_t < SUB_T or block_t & (block_t - 1)):
        raise ValueError(f"{op}: block_t must be a power of two of at least {SUB_T}, got {block_t}")
    R = slots.shape[0]
    _check_rows(op, R, slots, q, k, v, gate, out, state, bounds, chunks)
    assert tuple(bounds.shape) in ((R + 1,), (R + 2,)), (
        f"{op}: bounds must be [{R + 1}] for {R} requests, or [{R + 2}] with the padding rows, got {tuple(bounds.shape)}")
    assert chunks.dim() == 2 and chunks.shape[1] == 2 and chunks.dtype == torch.int64 and chunks.is_contiguous(), (
        f"{op}: chunks must be a contiguous [N, 2] int64 table (token_blocks), got {chunks.dtype} {tuple(chunks.shape)}")
    if q.dtype != k.dtype:
        q = q.to(k.dtype)  # one tl.dot takes both; a rare caller's mix costs a copy
    rows = q.shape[0]
    q, k, v, gate, strides, consts = _recurrent_args(op, q, k, v, gate, beta, out, state, gate_kind, rows)
    num_chunks = chunks.shape[0]
    if R == 0 or num_chunks == 0:
        return
    Hv, Dk, Dv = v.shape[1], q.shape[2], v.shape[2]
    (sq_r, sq_h, sk_r, sk_h, sv_r, sv_h, sg_r, sg_h, sb_r, sb_h, so_r, so_h, ss_slot, ss_head) = strides
    block_t = chunk_length(rows) if block_t is None else block_t
    # A padded table (bounds [R+2], a captured bucket's) may end in many empty rows: _table_programs.
    padded, table_seqs = bounds.shape[0] == R + 2, bounds.shape[0] - 1
    chunk_rows = cdiv(rows, block_t) + 1  # one request's chunks and the padding rows' one
    cfg = config or chunk_config(R, Hv, Dv, q.device, takes_short_tiles(rows))
    BK = max(SUB_T, next_pow2(Dk))
    common = dict(GROUP=consts["GROUP"], DK=Dk, DV=Dv, BK=BK, BT=block_t, GATE=gate_kind,
                  DOT_PREC="tf32x3" if v.dtype == torch.float32 else "tf32")
    delta = beta is not None
    lowp = cfg.low_precision_dots and v.dtype != torch.float32 and not triton_interpreted()
    work_dtype = chunk_workspace_dtype(v.dtype)
    if workspaces is not None:
        if delta and not cfg.solve_in_registers:
            raise ValueError(f"{op}: the solve through the shared matrix workspace (solve_in_registers=False) "
                             f"takes no caller's workspaces")
        if not workspaces.fits(rows, num_chunks, delta) or workspaces.cs.dtype != work_dtype:
            held_rows = 0 if workspaces.u is None else workspaces.u.shape[0]
            raise ValueError(f"{op}: the caller's workspaces hold {held_rows} rows and "
                             f"{workspaces.cs.shape[0]} chunks in {workspaces.cs.dtype}; this step needs {rows} and "
                             f"{num_chunks} in {work_dtype}" + (" with the delta rule's W and T" if delta else ""))
        cs = workspaces.cs[:num_chunks]
    else:
        cs = chunk_state_workspace(num_chunks, Hv, Dk, Dv, work_dtype, q.device)
    if delta:
        if workspaces is not None:
            w, vp = workspaces.w[:rows], workspaces.u[:rows]
        else:
            w, vp = chunk_workspace(rows, Hv, Dk, Dv, work_dtype, q.device)
        # the solve in registers never reads t: any valid pointer will do
        t = cs if cfg.solve_in_registers else chunk_matrix_workspace(num_chunks, Hv, block_t, q.device)
        bk, bvf, tiles = max(SOLVE_MIN_TILE, BK), max(SOLVE_MIN_TILE, next_pow2(Dv)), cfg.solve_col_tiles
        if tiles > 1 and not cfg.solve_in_registers:
            raise ValueError(f"{op}: the solve through the matrix workspace takes one program a chunk and head "
                             f"(solve_col_tiles={tiles}: each would write the same scratch)")
        bkw, bvw = max(SOLVE_MIN_TILE, bk // tiles), max(SOLVE_MIN_TILE, bvf // tiles)
        col_tiles = max(cdiv(bk, bkw), cdiv(bvf, bvw))
        grid_rows, walk = _table_programs(num_chunks, chunk_rows, Hv * col_tiles, padded, q.device)
        _CHUNK_SOLVE[(grid_rows, Hv, col_tiles)](
            k, v, gate, beta, w, vp, t, bounds, chunks,
            sk_r, sk_h, sv_r, sv_h, sg_r, sg_h, sb_r, sb_h, w.stride(0), w.stride(1), vp.stride(0), vp.stride(1),
            t.stride(0), t.stride(1), R, table_seqs,
            **{**common, "BK": bk}, BVF=bvf, BKW=bkw, BVW=bvw, BS=SUB_T,
            LOWP=lowp, SCRATCH=not cfg.solve_in_registers,
            SQUARINGS=max(0, (block_t // SUB_T).bit_length() - 2), WALK=walk, BR=_live_block(table_seqs, walk),
            num_warps=cfg.solve_warps)
    else:
        w, vp = k, v  # w is never read without the delta rule (any valid pointer will do); V' is V
    snap_rows, snap_ids, snap = (snapshots or StepSnapshots.none(R, state)).checked(op, R, state)
    v_tiles = cdiv(Dv, cfg.block_v)
    grid_rows, walk = _table_programs(R, 1, Hv * v_tiles, padded, q.device)
    _CHUNK_STATE[(grid_rows, Hv, v_tiles)](
        k, gate, w, vp, cs, state, slots, bounds, snap_rows, snap_ids, snap,
        sk_r, sk_h, sg_r, sg_h, w.stride(0), w.stride(1), vp.stride(0), vp.stride(1), cs.stride(0), cs.stride(1),
        ss_slot, ss_head, snap.stride(0), snap.stride(1), R,
        **common, BV=cfg.block_v, BR=_REQUEST_BLOCK, DELTA=delta, LOWP=lowp, PAD_SLOT=PADDING_SLOT, WALK=walk,
        BL=_live_block(R, walk), num_warps=cfg.num_warps, num_stages=cfg.state_stages)
    out_bv, z, norm_w, eps, round_y = cfg.out_block_v, out, out, 0.0, False
    if gated_norm is not None:
        z, norm_w, eps = gated_norm
        assert z.shape == out.shape and z.stride(-1) == 1 and tuple(norm_w.shape) == (Dv,), (
            f"{op}: the gated norm's z {tuple(z.shape)} and weight {tuple(norm_w.shape)} for out {tuple(out.shape)}")
        # The norm reduces a head's whole row in one program, on the tile's warps: compiled for sm90
        # at bench qwen3_next's Dv of 128 (bf16, testkit/sm90.py), 4 warps take 230 registers a
        # thread and an SM holds 2 programs (2 heads' rows), 8 warps 180 and 1; the default tile of
        # 64 columns 154 and 3 (1.5 heads' rows). No spills in any.
        out_bv = max(SUB_T, next_pow2(Dv))
        round_y = rounds_weighted_norm(norm_w, out)
    out_tiles = cdiv(Dv, out_bv)
    grid_rows, walk = _table_programs(num_chunks, chunk_rows, Hv * out_tiles, padded, q.device)
    _CHUNK_OUTPUT[(grid_rows, Hv, out_tiles)](
        q, k, vp, gate, cs, out, bounds, chunks, z, norm_w,
        sq_r, sq_h, sk_r, sk_h, vp.stride(0), vp.stride(1), sg_r, sg_h, so_r, so_h, cs.stride(0), cs.stride(1),
        z.stride(0), z.stride(1), float(scale), float(eps), R, table_seqs, **common,
        KB=min(BK, cfg.out_key_block), BV=out_bv, LOWP=lowp, WALK=walk, BR=_live_block(table_seqs, walk),
        NORM=gated_norm is not None, ROUND_Y=round_y, num_warps=cfg.out_warps)
