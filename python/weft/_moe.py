"""Expert parallelism: the grouped GEMM of a layer's experts on one GPU (grouped_mm, swiglu_interleave) and the
team's MoE ops (moe_dispatch, moe_combine, moe_grouped_mm_combine, moe_layer)."""
from __future__ import annotations

import sys
from typing import Optional

from . import _op_table, _weft
from ._args import _comm, _dtype_name, _torch_tensor
from ._errors import WeftTypeError, WeftValueError
from ._fp8 import _ACTIVATIONS, grouped_scaled_mm, quantize_fp8
from ._op_table import DTYPES, Tensor, _native, _stream, _world, declare, torch

__all__ = ["grouped_mm", "swiglu_interleave", "MoeDispatch", "moe_dispatch", "moe_dispatch_grouped_mm",
           "moe_dispatch_fp8", "moe_combine_input", "moe_combine", "moe_grouped_mm_combine", "moe_layer", "moe_layer_fp8"]


# ---- grouped GEMM (one GPU, no communicator) ---------------------------------------------------------------


def _stored_weights(b):
    """Experts' weights given as [E, K, N]: (the tensor as stored, whether that is [E, N, K]). A transposed view of
    contiguous [E, N, K] (stacked nn.Linear) is read in place; anything else not contiguous is copied."""
    if b.is_contiguous():
        return b, False
    if b.transpose(1, 2).is_contiguous():
        return b.transpose(1, 2), True
    return b.contiguous(), False


def grouped_mm(a, b, group_end, out_dtype=None, validate=True, zero_unused_rows=True, activation=None,
               group_rows=None):
    """Grouped matmul of an MoE layer's experts on one GPU (weft's Hopper kernel), with autograd.

    a [rows, K] bf16: the rows of group e are [group_end[e - 1], group_end[e]) (group 0 from row 0), each end
    a multiple of 128 (e.g. weft.moe_dispatch's group_end with align=128), ascending, at most rows; rows a
    multiple of 128. b [E, K, N] bf16 (torch._grouped_mm's layout): contiguous, or the transpose of a
    contiguous [E, N, K] (stacked nn.Linear weights, `w.transpose(1, 2)`), read in place either way.
    group_end: int32 [E] on a's device. Returns [rows, N] of out_dtype (torch.bfloat16, the default, or
    torch.float32): row r of group e is a[r] @ b[e]; rows past the last end are zero (left unwritten with
    zero_unused_rows=False, e.g. for a dispatch's worst-case capacity, whose unused rows combine never reads;
    the backward's dA then leaves them too). K and N multiples of 8.
    The backward gives dA by the same kernel and dB by torch's row-grouped matmul.
    activation="swiglu": the epilogue returns silu(gate) * up, [rows, N / 2], from the fp32 accumulators; b's
    columns must hold gate and up in blocks of 128 (weft.swiglu_interleave), N a multiple of 256. Its
    backward computes the pre-activation again (one more GEMM) instead of keeping it.
    validate=True reads group_end on the host (a synchronisation; skipped while a CUDA graph is captured): an
    end that is not a multiple of 128 would otherwise stop the kernel with a device trap.
    group_rows (int32 [E] on a's device, e.g. a low-latency dispatch's d.group_rows): group e holds only its
    first group_rows[e] rows: the kernel walks only the tiles holding them (the rest of each group's output
    rows are left unwritten). No autograd with it (inference).
    """
    where = "weft.grouped_mm"
    if not (_torch_tensor(a) and _torch_tensor(b) and _torch_tensor(group_end)):
        raise WeftTypeError(f"{where}: a, b and group_end must be torch tensors")
    for name, x in (("a", a), ("b", b), ("group_end", group_end)):
        if not x.is_cuda or x.device != a.device:
            raise WeftValueError(f"{where}: {name} must be a CUDA tensor on a's device, got one on {x.device}")
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        raise WeftTypeError(f"{where}: a and b must be bf16, got {a.dtype} and {b.dtype}")
    if group_end.dtype != torch.int32 or group_end.dim() != 1 or group_end.numel() < 1:
        raise WeftTypeError(f"{where}: group_end must be a 1-d int32 tensor of at least one end, got "
                            f"{group_end.dtype} {tuple(group_end.shape)}")
    if a.dim() != 2 or b.dim() != 3:
        raise WeftValueError(f"{where}: a must be [rows, K] and b [E, K, N], got {tuple(a.shape)} and "
                             f"{tuple(b.shape)}")
    rows, k = a.shape
    e, kb, n = b.shape
    if kb != k or e != group_end.numel():
        raise WeftValueError(f"{where}: b must be [E, K, N] with K = a's {k} and E = group_end's "
                             f"{group_end.numel()}, got {tuple(b.shape)}")
    if rows % 128 or rows < 128:
        raise WeftValueError(f"{where}: a's rows must be a positive multiple of 128 (whole tiles), got {rows}")
    if k % 8 or n % 8:
        raise WeftValueError(f"{where}: K and N must be multiples of 8 (16-byte rows for TMA), got K {k}, N {n}")
    if activation not in (None, "swiglu"):
        raise WeftValueError(f"{where}: activation must be None or 'swiglu', got {activation!r}")
    if activation == "swiglu" and n % 256:
        raise WeftValueError(f"{where}: activation='swiglu' needs N (gate and up columns) a multiple of 256, "
                             f"got {n}")
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise WeftTypeError(f"{where}: out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    if validate and not torch.cuda.is_current_stream_capturing() and not torch.compiler.is_compiling():
        ends = group_end.tolist()
        if any(x % 128 for x in ends) or any(y < x for x, y in zip(ends, ends[1:])) or ends[0] < 0 or ends[-1] > rows:
            raise WeftValueError(f"{where}: group_end must ascend in multiples of 128 up to rows ({rows}), got "
                                 f"{ends[:8]}{' ...' if len(ends) > 8 else ''}")
    if group_rows is not None:
        if not _torch_tensor(group_rows) or group_rows.dtype != torch.int32 or tuple(group_rows.shape) != (e,) \
                or group_rows.device != a.device:
            raise WeftValueError(f"{where}: group_rows must be an int32 tensor of {e} on a's device")
        if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
            raise WeftValueError(f"{where}: no gradient with group_rows (inference): call it under torch.no_grad()")
        group_rows = group_rows.contiguous()
    stored, nk = _stored_weights(b)
    return _torch_grouped_mm(a.contiguous(), stored, group_end.contiguous(), nk, out_dtype, bool(zero_unused_rows),
                             activation or "", group_rows)


def swiglu_interleave(w):
    """SwiGLU weights [E, K, 2 I] (gate columns, then up: torch's chunk(2) order) in the column order
    weft.grouped_mm(activation="swiglu") reads: blocks of 256 columns, the first 128 of block b gate columns
    [128 b, 128 b + 128), the last 128 the same up columns. I a multiple of 128. A transposed view of
    contiguous [E, 2 I, K] weights (stacked nn.Linear) stays one (nn.Linear layout); anything else comes back
    contiguous. A copy: do it once, not per step."""
    if not _torch_tensor(w) or w.dim() != 3 or w.shape[2] % 256:
        raise WeftValueError("weft.swiglu_interleave: w must be a torch tensor [E, K, 2 I] with I a multiple of "
                             f"128, got {tuple(w.shape) if hasattr(w, 'shape') else type(w).__name__}")
    blocks = w.shape[2] // 256
    if not w.is_contiguous() and w.transpose(1, 2).is_contiguous():  # [E, 2 I, K] stored
        t = w.transpose(1, 2)
        t = t.unflatten(1, (2, blocks, 128)).transpose(1, 2).flatten(1, 3).contiguous()
        return t.transpose(1, 2)
    return w.unflatten(2, (2, blocks, 128)).transpose(2, 3).flatten(2, 4).contiguous()


# ---- grouped_mm's torch operator (weft._op_table) --------------------------------------------------------------
# b is passed as stored: [E, N, K] (b_nk: nn.Linear weights) or [E, K, N]. activation "swiglu": b's columns
# are gate / up in blocks of 128 (swiglu_interleave) and the output has N / 2 columns.


@declare("weft::grouped_mm")
def _grouped_mm(a: Tensor, b: Tensor, group_end: Tensor, b_nk: bool, out_dtype: torch.dtype,
                zero_unused_rows: bool, activation: str, group_rows: Optional[Tensor] = None) -> Tensor:
    rows, k = a.shape
    n = b.shape[1] if b_nk else b.shape[2]
    out = a.new_empty((rows, n // 2 if activation == "swiglu" else n), dtype=out_dtype)
    _weft.grouped_gemm(a.get_device(), a.data_ptr(), b.data_ptr(), out.data_ptr(), group_end.data_ptr(),
                       group_end.shape[0], rows, n, k, "nk" if b_nk else "kn", DTYPES[out_dtype], zero_unused_rows,
                       activation, _stream(a), 0 if group_rows is None else group_rows.data_ptr())
    return out


@_grouped_mm.register_fake
def _(a, b, group_end, b_nk, out_dtype, zero_unused_rows, activation, group_rows=None):
    n = b.shape[1] if b_nk else b.shape[2]
    return a.new_empty((a.shape[0], n // 2 if activation == "swiglu" else n), dtype=out_dtype)


def _grouped_mm_setup(ctx, inputs, output):
    a, b, group_end, b_nk, _, zero_unused_rows, activation, *rest = inputs  # (group_rows, where passed)
    if rest and rest[0] is not None:
        raise WeftValueError("weft.grouped_mm: no gradient over a low-latency dispatch's groups (group_rows): "
                             "run it under torch.no_grad() (inference)")
    ctx.save_for_backward(a, b, group_end)
    ctx.b_nk, ctx.zero_unused_rows, ctx.activation = b_nk, zero_unused_rows, activation


def _grouped_weight_grad(a, g, group_end):
    """[E, K, N]: A_e^T dC_e per group (rows past the last end belong to none)."""
    try:
        return torch._grouped_mm(a.t(), g, offs=group_end)
    except (RuntimeError, AttributeError):  # a torch without the row-grouped form: one matmul per group
        ends = [0] + group_end.tolist()
        return torch.stack([a[ends[e]:ends[e + 1]].t() @ g[ends[e]:ends[e + 1]] for e in range(len(ends) - 1)])


def _swiglu_grad(h, grad):
    """The gradient of the pre-activation h [rows, N] (gate / up in blocks of 128) from the output's."""
    rows = h.shape[0]
    hb = h.view(rows, -1, 2, 128)
    gate, up = hb[:, :, 0], hb[:, :, 1]
    g = grad.float().view(rows, -1, 128)
    sig = torch.sigmoid(gate)
    d_up = g * gate * sig
    d_gate = g * up * sig * (1 + gate * (1 - sig))
    return torch.stack((d_gate, d_up), dim=2).view(rows, -1)


def _grouped_mm_backward(ctx, grad):
    a, b, group_end = ctx.saved_tensors
    if ctx.activation == "swiglu":  # the pre-activation again (fp32), then the activation's gradient
        h = _grouped_mm.op(a, b, group_end, ctx.b_nk, torch.float32, ctx.zero_unused_rows, "")
        g = _swiglu_grad(h, grad).to(a.dtype).contiguous()
    else:
        g = grad.to(a.dtype).contiguous()
    da = db = None
    if ctx.needs_input_grad[0]:  # dA = dC B_e^T: the same stored B read the other way round
        da = _grouped_mm.op(g, b, group_end, not ctx.b_nk, a.dtype, ctx.zero_unused_rows, "")
    if ctx.needs_input_grad[1]:
        dkn = _grouped_weight_grad(a, g, group_end).to(b.dtype)
        db = dkn.transpose(1, 2).contiguous() if ctx.b_nk else dkn
    return da, db, None, None, None, None, None, None


_grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def _torch_grouped_mm(a, b, group_end, b_nk, out_dtype, zero_unused_rows, activation="", group_rows=None):
    """Arguments checked by the caller; b as stored (see above)."""
    return _grouped_mm.op(a, b, group_end, b_nk, out_dtype, zero_unused_rows, activation, group_rows)


# ---- expert parallelism (a team) ---------------------------------------------------------------------
class MoeDispatch:
    """What weft.moe_dispatch returns on this rank: `rows` [capacity, hidden] (this rank's experts' rows, one
    padded group per local expert, back to back; a view valid until the next dispatch on the team, a copy
    while autograd records), `group_end` int32 [experts per rank] (each group's padded end, on the GPU; a
    copy), `capacity` (the worst case);
    with exact=True also `counts` (rows per local expert, a host list) and rows cut to the rows in use (the
    last group's end), else counts is None; and what weft.moe_combine needs of the dispatch (each slot's row on
    its expert's rank, the expert ids)."""

    def __init__(self, comm, shape, rows, group_end, row_of, experts, capacity, counts=None, out_dtype=None,
                 group_rows=None):
        self.rows, self.group_end, self.capacity = rows, group_end, capacity
        # low_latency=True: the rows each group holds (int32 [experts per rank], on the GPU; the groups are
        # fixed, group_end their ends); else None.
        self.group_rows = group_rows
        self.counts = list(counts[0]) if counts is not None else None
        self._comm, self._shape = comm, shape
        self._row_of, self._experts = row_of, experts
        self._out_dtype = rows.dtype if out_dtype is None else out_dtype  # the experts' outputs' (combine's)
        self.scales = None  # moe_dispatch_fp8's: each row's block scales


def _dispatch_args(x, experts, comm, where):
    """The communicator of a dispatch, after the checks of x [tokens, hidden] (bf16 / fp16) and experts [tokens,
    top_k] (integer ids) on this rank's GPU."""
    if not (_torch_tensor(x) and _torch_tensor(experts)):
        raise WeftTypeError(f"{where}: x and experts must be torch tensors")
    c = _comm(comm)
    if not x.is_cuda or x.device.index != c.device or experts.device != x.device:
        raise WeftValueError(f"{where}: x and experts must be CUDA tensors on this rank's cuda:{c.device}")
    if x.dim() != 2 or experts.dim() != 2 or experts.shape[0] != x.shape[0]:
        raise WeftValueError(f"{where}: x must be [tokens, hidden] and experts [tokens, top_k], got "
                             f"{tuple(x.shape)} and {tuple(experts.shape)}")
    if DTYPES.get(x.dtype) not in ("bf16", "fp16"):
        raise WeftTypeError(f"{where}: x must be bf16 or fp16, got {x.dtype}")
    if experts.dtype.is_floating_point:
        raise WeftTypeError(f"{where}: experts must hold integer ids, got {experts.dtype}")
    return c


def moe_dispatch(x, experts, num_experts, max_tokens=None, align=128, comm=None, exact=False, low_latency=False):
    """Sends each token of this rank to the ranks holding its top-k experts (experts split evenly over the team).

    x [tokens, hidden] bf16 / fp16 on this rank's GPU (hidden a multiple of 8); experts [tokens, top_k] integer
    global expert ids (-1: a dropped slot). max_tokens: the most tokens any rank passes (the same on every rank;
    default this rank's count, right when all ranks pass as many). Every rank calls it. No host
    synchronisation: buffers are sized for the worst case; exact=True reads the counts back (one
    synchronisation; not for CUDA graphs, nor for a team one process drives) and cuts rows to the rows in use, so what runs on them (expert
    GEMMs, activations) skips the worst case's empty rows. Returns a MoeDispatch. A torch operator
    (torch.compile traces it) with autograd: x's gradient is the sum of its rows' gradients (a combine with
    weights 1). rows is a view of the team's dispatch area, valid until the next dispatch; while autograd
    records it is a copy (its consumers, e.g. weft.grouped_mm, may keep it for their backward), and group_end
    always is.
    low_latency=True (decoding: up to a few hundred tokens a rank; inference, no autograd: under
    torch.no_grad()): one kernel, no count exchange (MoeShape::low_latency): each expert a fixed group of
    W x max_tokens rows rounded up to 128 (group_end fixed), d.group_rows the rows each group received
    (weft.grouped_mm(..., group_rows=d.group_rows) walks only those); combine as usual: an expert_out other
    than weft.moe_combine_input(d) has the rows its groups received copied there (not the capacity, every
    group's worst case: ~470 MB a rank at DeepSeek-V3 sizes on 4 ranks); weft.moe_layer(low_latency=True) writes
    its down GEMM there directly, with no copy. align is ignored.
    """
    where = "weft.moe_dispatch"
    c = _dispatch_args(x, experts, comm, where)
    if low_latency and (exact or (torch.is_grad_enabled() and x.requires_grad)):
        raise WeftValueError(f"{where}: low_latency=True is for inference: no exact counts, no gradient (call it "
                             "under torch.no_grad())")
    if exact and c._c.local_ranks > 1:  # refused before anything is queued: the peers would wait for ever
        raise WeftValueError(f"{where}: exact=True reads the counts back, synchronising this rank's stream, "
                             f"which in a team that one process drives ({c._c.local_ranks} ranks here) waits for "
                             "ranks not yet launched; run one process per rank (torchrun), or use exact=False")
    tokens, hidden = x.shape
    # Under torch.no_grad() no backward can meet the padding rows (a weight's gradient rows^T . dY would): the
    # dispatch leaves them as they are (MoeShape::zero_padding), at decode sizes most of its work.
    zero_padding = int(torch.is_grad_enabled())
    shape = (tokens, int(max_tokens) if max_tokens is not None else tokens, hidden, int(num_experts),
             experts.shape[1], int(align), zero_padding, int(bool(low_latency)))
    ids = experts.to(torch.int32).contiguous()
    rows, ends, row_of, kept, counts, group_rows = _torch_moe_dispatch(x.contiguous(), ids, shape, c, bool(exact))
    # (Exact counts cut rows; the pybind call is kept out of what torch.compile traces otherwise.)
    capacity = rows.shape[0] if counts is None else _moe_capacity(shape, c.world_size)
    return MoeDispatch(c, shape, rows, ends, row_of, kept, capacity, counts,
                       group_rows=group_rows if low_latency else None)


def moe_dispatch_grouped_mm(x, experts, num_experts, w, max_tokens=None, align=128, comm=None, activation=None):
    """weft.moe_dispatch and the first expert GEMM in one kernel (inference: under torch.no_grad()): each
    128-row tile's GEMM starts once its rows have landed, the rows moved by the GEMM's idle loader warps.
    Returns (out, d): d the dispatch's handle (as weft.moe_dispatch(x, experts, num_experts, max_tokens, align,
    comm) returns it; d.rows a view of the team's dispatch area, valid until the next dispatch), and out
    [capacity, N] (or [capacity, N / 2] with activation="swiglu": w's columns in weft.swiglu_interleave's
    order) = each group's rows times its expert's w, as weft.grouped_mm(d.rows, w, d.group_end,
    activation=activation) computes them on the rows of the groups; rows past the last group's end are left
    unwritten and the groups' padding rows hold whatever the area held (their outputs may be NaN or inf,
    which combine never reads). x [tokens, hidden] bf16; w [experts per rank, hidden, N] bf16 (torch._grouped_mm's
    [E, K, N]; a transposed view of stacked nn.Linear weights is read in place), N a multiple of 8 (256 with
    SwiGLU); align a multiple of 128. Every rank calls it, with the same max_tokens (or as many tokens). It waits
    for peers inside one kernel, so a team one process drives (virtual ranks) runs it on each rank's share of
    the SMs, where the unfused pair is faster."""
    where = "weft.moe_dispatch_grouped_mm"
    c = _dispatch_args(x, experts, comm, where)
    if torch.is_grad_enabled() and any(_torch_tensor(t) and t.requires_grad for t in (x, w)):
        raise WeftValueError(f"{where}: no backward: run it under torch.no_grad() (inference), or weft.moe_dispatch "
                             "then weft.grouped_mm")
    if activation not in (None, "swiglu"):
        raise WeftValueError(f"{where}: activation must be None or 'swiglu', got {activation!r}")
    if not _torch_tensor(w):
        raise WeftTypeError(f"{where}: w must be a torch tensor")
    if int(num_experts) % c.world_size:
        raise WeftValueError(f"{where}: num_experts ({num_experts}) must split evenly over the {c.world_size} ranks")
    tokens, hidden = x.shape
    local = int(num_experts) // c.world_size
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or w.device != x.device:
        raise WeftTypeError(f"{where}: x and w must be bf16 on this rank's GPU, got {x.dtype} and {w.dtype} on "
                            f"{w.device}")
    if w.dim() != 3 or w.shape[0] != local or w.shape[1] != hidden:
        raise WeftValueError(f"{where}: w must be [{local} experts of this rank, {hidden}, N], got {tuple(w.shape)}")
    n = w.shape[2]
    if n % 8 or (activation == "swiglu" and n % 256):
        raise WeftValueError(f"{where}: N must be a multiple of {256 if activation == 'swiglu' else 8} (16-byte rows"
                             f"{'; gate and up columns in blocks of 128' if activation == 'swiglu' else ''}), got {n}")
    if int(align) % 128:
        raise WeftValueError(f"{where}: align must be a multiple of 128 (the GEMM's tile rows), got {align}")
    # (zero_padding under grad mode, as moe_dispatch: a caller's later backward may read the padding rows)
    shape = (tokens, int(max_tokens) if max_tokens is not None else tokens, hidden, int(num_experts),
             experts.shape[1], int(align), int(torch.is_grad_enabled()), 0)
    stored, nk = _stored_weights(w)
    out, rows, ends, row_of, kept = _torch_moe_dispatch_grouped_mm(
        x.contiguous(), experts.to(torch.int32).contiguous(), stored, nk, activation == "swiglu", shape, c)
    return out, MoeDispatch(c, shape, rows, ends, row_of, kept, rows.shape[0])


def moe_dispatch_fp8(x, experts, num_experts, max_tokens=None, align=128, comm=None, low_latency=False):
    """weft.moe_dispatch with FP8 tokens (about half the bytes on the links): x quantized to e4m3 with 1 x 128
    block scales on this rank (weft.quantize_fp8's), each row travelling with its scales. Returns a MoeDispatch
    whose `rows` are the FP8 values [capacity, hidden] (torch.float8_e4m3fn) and `scales` their block scales
    [capacity, ceil(hidden / 128)] (float32), both views of the packed rows in the team's dispatch area (valid
    until the next dispatch): weft.grouped_scaled_mm(d.rows, w, d.group_end, d.scales, w_scales) runs the experts
    on them in place, then weft.moe_combine_input(d) / weft.moe_combine(expert_out, d, weights) as after
    weft.moe_dispatch, expert_out of x's dtype. x bf16 / fp16 with hidden a multiple of 16. Eager, no autograd
    (inference). Under torch.no_grad() the padding rows are left as they were (any bytes): their GEMM output rows
    may then hold NaN or inf, which combine never reads but a reduction over all of the output would.
    low_latency=True: weft.moe_dispatch(low_latency=True)'s fixed groups and one kernel (decoding), d.group_rows
    the rows each group received: weft.grouped_scaled_mm(..., group_rows=d.group_rows) walks only those."""
    where = "weft.moe_dispatch_fp8"
    c = _dispatch_args(x, experts, comm, where)
    tokens, hidden = x.shape
    if hidden % 16:
        raise WeftValueError(f"{where}: hidden must be a multiple of 16 (16-byte FP8 rows), got {hidden}")
    top_k = experts.shape[1]
    shape = (tokens, int(max_tokens) if max_tokens is not None else tokens, hidden, int(num_experts), top_k,
             int(align), int(torch.is_grad_enabled()), int(bool(low_latency)))
    x = x.contiguous()
    ids = experts.to(torch.int32).contiguous()
    nbytes = _weft.moe_dispatch_fp8_workspace_bytes(c.world_size, shape)
    ws = torch.empty(max(nbytes, 256), dtype=torch.uint8, device=x.device)
    packed, ends, row_of, kept, capacity, _, group_rows = _weft.moe_dispatch_fp8(
        c._c, x.data_ptr(), ids.data_ptr(), shape, ws.data_ptr(), nbytes, DTYPES[x.dtype], _stream(x))

    def slots(ptr):  # [tokens, top_k] int32 at ptr inside ws, copied out (combine needs only these)
        at = ptr - ws.data_ptr()
        return ws[at:at + 4 * tokens * top_k].view(torch.int32).view(tokens, top_k).clone()

    packed = torch.from_dlpack(packed)  # [capacity, row_bytes] uint8: the values, then the scales
    blocks = -(-hidden // 128)
    # (the low-latency group_rows copied out, as moe_dispatch's: the next dispatch rewrites them)
    d = MoeDispatch(c, shape, packed[:, :hidden].view(torch.float8_e4m3fn), torch.from_dlpack(ends), slots(row_of),
                    slots(kept), capacity, out_dtype=x.dtype,
                    group_rows=torch.from_dlpack(group_rows).clone() if group_rows is not None else None)
    d.scales = packed[:, hidden:hidden + 4 * blocks].view(torch.float32)
    return d


def moe_combine_input(dispatched):
    """The buffer weft.moe_combine reads the experts' outputs from: [capacity, hidden] in dispatched.rows'
    layout (write each group's output to the same rows), symmetric so every rank can read it. Writing there
    saves moe_combine a copy; any other [capacity, hidden] tensor works too."""
    if not isinstance(dispatched, MoeDispatch):
        raise WeftTypeError("weft.moe_combine_input: pass what weft.moe_dispatch returned")
    torch = sys.modules["torch"]
    dtype = _dtype_name(dispatched._out_dtype)
    return torch.from_dlpack(_weft.moe_combine_input(dispatched._comm._c, dispatched._shape, dtype))


def moe_combine(expert_out, dispatched, weights):
    """out[t] = sum over j of weights[t, j] * the expert output of token t's j-th slot, in fp32 in slot order
    (deterministic), rounded once. expert_out [capacity, hidden] in dispatched.rows' layout (best:
    weft.moe_combine_input(dispatched), else it is copied there: for a low-latency dispatch only the rows its
    groups received, e.g. weft.grouped_mm(..., group_rows=d.group_rows)'s output as it is); weights [tokens,
    top_k] (fp32). Every rank calls it. Returns out [tokens, hidden]. A torch operator (torch.compile traces it) with autograd:
    expert_out's gradient is weights[t, j] * dout[t] at each slot's row (zeros elsewhere), the weights'
    <dout[t], the slot's expert output> (weft.moe_combine_backward's kernel, rows read and written on the
    experts' ranks). Combines of one team run one dispatch apart: two micro-batches interleaved (dispatch A,
    dispatch B, combine A, combine B) go on two lanes of the team (B's comm=comm.subteam(comm.world_size,
    lane=1)), else B's rows and outputs land on A's."""
    where = "weft.moe_combine"
    if not isinstance(dispatched, MoeDispatch):
        raise WeftTypeError(f"{where}: pass what weft.moe_dispatch returned")
    tokens, _, hidden, _, top_k, _ = dispatched._shape[:6]
    if tuple(weights.shape) != (tokens, top_k):
        raise WeftValueError(f"{where}: weights must be [{tokens}, {top_k}], got {tuple(weights.shape)}")
    rows = dispatched.rows.shape[0]
    if tuple(expert_out.shape) != (rows, hidden) or expert_out.dtype != dispatched._out_dtype:
        raise WeftValueError(f"{where}: expert_out must be [{rows}, {hidden}] of {dispatched._out_dtype} "
                             f"(dispatched.rows' layout), got {tuple(expert_out.shape)} of {expert_out.dtype}")
    w = weights.to(torch.float32).contiguous()
    return _torch_moe_combine(expert_out, dispatched._row_of, dispatched._experts, w, dispatched._shape,
                              dispatched._comm, dispatched.group_rows)


def moe_grouped_mm_combine(a, b, dispatched, weights):
    """The second expert GEMM and the combine in one: weft.moe_combine(weft.grouped_mm(a, b,
    dispatched.group_end), dispatched, weights), with the GEMM's epilogue sending each output row straight to
    the rank of the token it came from (then each rank sums its tokens' rows as moe_combine does: the same
    results). a [rows, inter] bf16 in dispatched.rows' layout (its row count); b [experts per rank, inter,
    hidden] bf16 (torch._grouped_mm's layout; a transposed view of stacked nn.Linear weights is read in place);
    weights [tokens, top_k]. No other dispatch on the team may come between this one's dispatch and it. Every
    rank calls it. With autograd (a, b, weights; the backward computes the GEMM again)."""
    where = "weft.moe_grouped_mm_combine"
    if not isinstance(dispatched, MoeDispatch):
        raise WeftTypeError(f"{where}: pass what weft.moe_dispatch returned")
    if dispatched.scales is not None:
        raise WeftValueError(f"{where}: takes a bf16 dispatch's handle (weft.moe_dispatch), not "
                             "weft.moe_dispatch_fp8's: combine its experts' outputs with weft.moe_combine")
    if not (_torch_tensor(a) and _torch_tensor(b) and _torch_tensor(weights)):
        raise WeftTypeError(f"{where}: a, b and weights must be torch tensors")
    tokens, _, hidden, num_experts, top_k, align = dispatched._shape[:6]
    local = num_experts // dispatched._comm.world_size
    rows = dispatched.rows.shape[0]
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        raise WeftTypeError(f"{where}: a and b must be bf16, got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or a.shape[0] != rows or b.dim() != 3 or tuple(b.shape) != (local, a.shape[1], hidden):
        raise WeftValueError(f"{where}: a must be [{rows} (dispatched.rows' count), inter] and b [{local}, inter, "
                             f"{hidden}], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[1] % 8 or align % 128:
        raise WeftValueError(f"{where}: inter must be a multiple of 8 and the dispatch's align a multiple of 128, "
                             f"got {a.shape[1]} and {align}")
    if tuple(weights.shape) != (tokens, top_k):
        raise WeftValueError(f"{where}: weights must be [{tokens}, {top_k}], got {tuple(weights.shape)}")
    stored, nk = _stored_weights(b)
    w = weights.to(torch.float32).contiguous()
    return _torch_moe_grouped_mm_combine(a.contiguous(), stored, nk, dispatched.group_end, dispatched._row_of,
                                         dispatched._experts, w, dispatched._shape, dispatched._comm)


def _fused_dispatch_faster(c, num_experts, max_tokens, epilogue):
    """moe_layer's rule for fused_dispatch=None (inference): where the dispatch fused with the first GEMM measured
    faster than the unfused pair (4 x H200, SwiGLU in the GEMM's epilogue: 8 and 32 experts from 2048 tokens a
    rank; bench/RESULTS.md). The same on every rank (max_tokens, the weights' shapes and the team's)."""
    return epilogue and c._c.local_ranks == 1 and c.world_size >= 4 and int(num_experts) <= 32 \
        and max_tokens >= 2048


def _activated(h, activation, inter, in_epilogue):
    """The first GEMM's output h after the layer's activation (SwiGLU: silu(gate) * up, gate columns first), or h
    itself where the GEMM's epilogue applied it."""
    if in_epilogue:
        return h
    F = torch.nn.functional
    if activation == "swiglu":
        return F.silu(h[:, :inter]) * h[:, inter:]
    return {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}[activation](h)


def moe_layer(x, experts, weights, w_up, w_down, num_experts, activation="swiglu", max_tokens=None, align=128,
              comm=None, exact=False, swiglu_interleaved=False, fused_combine=None, low_latency=False,
              fused_dispatch=None):
    """The experts of an expert-parallel MoE layer: dispatch, grouped_mm up, activation, grouped_mm down, combine.

    x [tokens, hidden] bf16; experts [tokens, top_k] global expert ids (-1: a dropped slot); weights [tokens,
    top_k] routing weights; w_up: this rank's experts' first weights, [num_experts / world, hidden, 2 * inter]
    for activation "swiglu" (gate columns, then up: silu(gate) * up) or [num_experts / world, hidden, inter]
    for "silu", "gelu", "relu"; w_down [num_experts / world, inter, hidden]; both bf16 in torch._grouped_mm's
    [E, K, N] layout (stacked nn.Linear weights, transposed views, are read in place). Every rank calls it;
    returns [tokens, hidden]. With autograd (x, weights, w_up, w_down). align (a multiple of 128) pads each
    expert's rows for the GEMM tiles. The activation runs over the dispatch's worst-case capacity rows, or with
    exact=True (one synchronisation, see moe_dispatch) over the rows in use only. swiglu_interleaved=True: w_up's
    columns are in weft.swiglu_interleave's order, and the first GEMM's epilogue applies SwiGLU (no
    [rows, 2 inter] intermediate). fused_combine=True: the second GEMM and the combine in one
    (weft.moe_grouped_mm_combine); None (the default) picks it where it measured faster: without gradients
    nor exact, inter <= 4096 and max_tokens >= 2048 (DeepSeek-V3-like layers at 4096 tokens a rank:
    1.14-1.20x the unfused layer at 4 x H200, 1.02-1.08x at 2; at 128 tokens, and with Mixtral-like inter
    14336, no faster or slower: bench/RESULTS.md), else unfused; every rank picks alike (max_tokens and the
    weights' shapes are the same on every rank).
    low_latency=True (decoding, inference: under torch.no_grad()): weft.moe_dispatch's low-latency dispatch, the
    GEMMs over the rows each group received only (group_rows); its fixed groups hold W x max_tokens rows each,
    so use it with swiglu_interleaved=True (the activation in the first GEMM's epilogue, over those rows only;
    another activation runs over every group's whole capacity); the second GEMM writes into the combine's
    area directly. Not with exact or fused_combine.
    fused_dispatch=True: the dispatch and the first GEMM in one kernel (weft.moe_dispatch_grouped_mm; inference,
    not with exact or low_latency); None (the default) picks it where it measured faster: without gradients,
    with swiglu_interleaved=True, on a team of one process a GPU of at least 4 ranks, with at most 32 experts
    and max_tokens >= 2048 (1.09-1.12x the unfused pair at 4 x H200 with 8 or 32 experts; slower with 256
    experts, at 1024 tokens, at 2 GPUs: bench/RESULTS.md), else unfused. Every rank must pass the same
    max_tokens (or as many tokens): the ranks' choices must agree.
    """
    where = "weft.moe_layer"
    if activation not in _ACTIVATIONS:
        raise WeftValueError(f"{where}: activation must be one of {_ACTIVATIONS}, got {activation!r}")
    if int(align) % 128:
        raise WeftValueError(f"{where}: align must be a multiple of 128 (the grouped GEMM's tile rows), got {align}")
    c = _comm(comm)
    if not (_torch_tensor(w_up) and _torch_tensor(w_down)):
        raise WeftTypeError(f"{where}: w_up and w_down must be torch tensors")
    local = int(num_experts) // c.world_size
    hidden = x.shape[-1]
    if w_up.dim() != 3 or w_down.dim() != 3 or w_up.shape[0] != local or w_down.shape[0] != local:
        raise WeftValueError(f"{where}: w_up and w_down must be [{local} experts of this rank, K, N], got "
                             f"{tuple(w_up.shape)} and {tuple(w_down.shape)}")
    inter = w_up.shape[2] // 2 if activation == "swiglu" else w_up.shape[2]
    if w_up.shape[1] != hidden or tuple(w_down.shape[1:]) != (inter, hidden) or (
            activation == "swiglu" and w_up.shape[2] % 2):
        raise WeftValueError(f"{where}: with hidden {hidden} and activation {activation}, w_up must be "
                             f"[{local}, {hidden}, {'2 x ' if activation == 'swiglu' else ''}inter] and w_down "
                             f"[{local}, inter, {hidden}], got {tuple(w_up.shape)} and {tuple(w_down.shape)}")
    if low_latency and (exact or fused_combine):
        raise WeftValueError(f"{where}: low_latency=True takes neither exact=True nor fused_combine=True")
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, weights, w_up, w_down))
    if fused_dispatch and (exact or low_latency or grad):
        raise WeftValueError(f"{where}: fused_dispatch=True is for inference (no gradient: under torch.no_grad()) "
                             "and takes neither exact=True nor low_latency=True; else pass fused_dispatch=False")
    epilogue = activation == "swiglu" and swiglu_interleaved  # SwiGLU in the first GEMM's epilogue
    if fused_dispatch is None:
        fused_dispatch = not (low_latency or exact or grad) and _fused_dispatch_faster(
            c, num_experts, int(max_tokens) if max_tokens is not None else x.shape[0], epilogue)
    if fused_dispatch:
        h, d = moe_dispatch_grouped_mm(x, experts, num_experts, w_up, max_tokens=max_tokens, align=align, comm=comm,
                                       activation="swiglu" if epilogue else None)
        live = None
    else:
        d = moe_dispatch(x, experts, num_experts, max_tokens=max_tokens, align=align, comm=comm, exact=exact,
                         low_latency=low_latency)
        live = d.group_rows  # low latency: the GEMMs walk only the rows each group received
    if d.rows.shape[0] == 0:  # exact counts, no row here: the experts' weights still get (zero) gradients
        a = _activated(d.rows @ w_up[0], activation, inter, False)
        return moe_combine(a @ w_down[0], d, weights)
    # Rows past the last group are never read by combine, nor by any backward: left unwritten.
    if not fused_dispatch:
        h = grouped_mm(d.rows, w_up, d.group_end, validate=False, zero_unused_rows=False,
                       activation="swiglu" if epilogue else None, group_rows=live)
    a = _activated(h, activation, inter, epilogue)
    if fused_combine is None:
        fused_combine = not (low_latency or exact or grad) and inter <= 4096 and d._shape[1] >= 2048
    if fused_combine:
        return moe_grouped_mm_combine(a, w_down, d, weights)
    if low_latency:  # the down GEMM straight into the combine's area (no copy of the worst-case capacity)
        tokens, top_k = d._shape[0], d._shape[4]
        if tuple(weights.shape) != (tokens, top_k):
            raise WeftValueError(f"{where}: weights must be [{tokens}, {top_k}], got {tuple(weights.shape)}")
        if w_down.dtype != torch.bfloat16 or w_down.device != a.device:
            raise WeftTypeError(f"{where}: w_down must be bf16 on the tokens' device, got {w_down.dtype} on "
                                f"{w_down.device}")
        if inter % 8:
            raise WeftValueError(f"{where}: inter must be a multiple of 8 (16-byte rows), got {inter}")
        if torch.is_grad_enabled() and any(t.requires_grad for t in (x, weights, w_up, w_down)):
            raise WeftValueError(f"{where}: low_latency=True is for inference (no gradient): run it under "
                                 "torch.no_grad()")
        stored, nk = _stored_weights(w_down)
        w = weights.to(torch.float32).contiguous()
        return _torch_moe_grouped_mm_then_combine(a.contiguous(), stored, nk, d.group_end, live, d._row_of,
                                                  d._experts, w, d._shape, d._comm)
    y = grouped_mm(a.contiguous(), w_down, d.group_end, validate=False, zero_unused_rows=False, group_rows=live)
    return moe_combine(y, d, weights)


def _fp8_layer_checks(where, x, weights, w_up, w_up_scales, w_down, w_down_scales, local, activation):
    """moe_layer_fp8's arguments, checked before its dispatch (a team collective)."""
    named = (("x", x), ("weights", weights), ("w_up", w_up), ("w_up_scales", w_up_scales), ("w_down", w_down),
             ("w_down_scales", w_down_scales))
    for name, t in named:
        if not _torch_tensor(t):
            raise WeftTypeError(f"{where}: {name} must be a torch tensor")
    if x.dtype != torch.bfloat16:
        raise WeftTypeError(f"{where}: x must be bf16 (the FP8 GEMMs write bf16 rows for the combine), got {x.dtype}")
    hidden = x.shape[-1]
    if w_up.dim() != 3 or w_down.dim() != 3 or w_up.shape[0] != local or w_down.shape[0] != local:
        raise WeftValueError(f"{where}: w_up and w_down must be [{local} experts of this rank, N, K], got "
                             f"{tuple(w_up.shape)} and {tuple(w_down.shape)}")
    inter = w_down.shape[2]
    n_up = 2 * inter if activation == "swiglu" else inter
    if tuple(w_up.shape[1:]) != (n_up, hidden) or w_down.shape[1] != hidden:
        raise WeftValueError(f"{where}: with hidden {hidden} and activation {activation}, w_up must be [{local}, "
                             f"{'2 x ' if activation == 'swiglu' else ''}inter, {hidden}] and w_down [{local}, "
                             f"{hidden}, inter], got {tuple(w_up.shape)} and {tuple(w_down.shape)}")
    if inter % 16 or hidden % 16:
        raise WeftValueError(f"{where}: hidden ({hidden}) and inter ({inter}) must be multiples of 16 (16-byte FP8 "
                             "rows)")
    for name, w, s in (("w_up", w_up, w_up_scales), ("w_down", w_down, w_down_scales)):
        if w.dtype != torch.float8_e4m3fn or not w.is_contiguous():
            raise WeftTypeError(f"{where}: {name} must be a contiguous torch.float8_e4m3fn tensor (the dispatch's "
                                f"rows are e4m3), got {w.dtype}")
        want = (local, -(-w.shape[1] // 128), -(-w.shape[2] // 128))
        if s.dtype != torch.float32 or tuple(s.shape) != want or not s.is_contiguous():
            raise WeftValueError(f"{where}: {name}_scales must be contiguous float32 {list(want)} (128 x 128 "
                                 f"blocks), got {s.dtype} {list(s.shape)}")


def moe_layer_fp8(x, experts, weights, w_up, w_up_scales, w_down, w_down_scales, num_experts, activation="swiglu",
                  max_tokens=None, align=128, comm=None, low_latency=False):
    """weft.moe_layer on FP8 experts (inference; DeepSeek-V3's recipe): the tokens dispatched in FP8 with 1 x 128
    block scales (weft.moe_dispatch_fp8: about half the bytes on the links), the first expert GEMM on them in place
    (weft.grouped_scaled_mm), the activation and the quantization of its output in one pass (weft.quantize_fp8's
    activation) for the second FP8 GEMM, the combine in bf16.

    x [tokens, hidden] bf16 (hidden a multiple of 16); experts, weights, num_experts, max_tokens, align, comm as
    weft.moe_layer's; w_up [num_experts / world, N, hidden] with N = 2 inter for "swiglu" (gate rows, then up) or
    inter, and w_down [num_experts / world, hidden, inter]: float8_e4m3fn, the experts' stacked nn.Linear weights
    ([out, in] each, K-major: what FP8 tensor cores read; inter a multiple of 16), with their 128 x 128 block
    scales w_up_scales [E, ceil(N / 128), ceil(hidden / 128)] and w_down_scales [E, ceil(hidden / 128), ceil(inter
    / 128)], float32 (weft.quantize_fp8(w_e, "block", "b") of each expert's weight). Returns [tokens, hidden]
    bf16. No autograd: x and weights must not need gradients (call it under torch.no_grad()).
    low_latency=True (decoding): the low-latency dispatch, both GEMMs and the activation's quantization over the
    rows each group received only.
    Under Team.warmup it returns zeros (its kernels wait for peers; nothing of it needs loading)."""
    where = "weft.moe_layer_fp8"
    if activation not in _ACTIVATIONS:
        raise WeftValueError(f"{where}: activation must be one of {_ACTIVATIONS}, got {activation!r}")
    if int(align) % 128:  # (the grouped FP8 GEMM's groups are whole 128-row tiles)
        raise WeftValueError(f"{where}: align must be a multiple of 128 (the grouped GEMM's tile rows), got {align}")
    c = _comm(comm)
    _fp8_layer_checks(where, x, weights, w_up, w_up_scales, w_down, w_down_scales, int(num_experts) // c.world_size,
                      activation)
    if torch.is_grad_enabled() and (x.requires_grad or weights.requires_grad):
        raise WeftValueError(f"{where}: no gradient through the FP8 layer (inference): call it under torch.no_grad()")
    if _op_table.EMULATE:
        return torch.zeros_like(x)
    d = moe_dispatch_fp8(x, experts, num_experts, max_tokens=max_tokens, align=align, comm=c, low_latency=low_latency)
    live = d.group_rows  # low latency: the GEMMs walk only the rows each group received
    h = grouped_scaled_mm(d.rows, w_up, d.group_end, d.scales, w_up_scales, group_rows=live)
    # Rows no group holds (and, at low latency, past each group's received rows) were never written: their
    # values, scales and products stay in those rows (1 x 128 scales: a row's own), which combine never reads.
    # The activation and its quantization in one pass (scales M-major: the second GEMM's fastest form); at low
    # latency over the rows each group received only.
    qa, sa = quantize_fp8(h, "block", "a", m_major=True, activation=activation,
                          group_end=None if live is None else d.group_end, group_rows=live)
    y = grouped_scaled_mm(qa, w_down, d.group_end, sa, w_down_scales, group_rows=live)
    return moe_combine(y, d, weights)


# ---- the team's MoE torch operators (weft._op_table) -----------------------------------------------------------
# shape: (tokens, max_tokens, hidden, num_experts, top_k, align), weft::MoeShape's fields.


def _low_latency(shape):
    """Whether a dispatch shape asks for the low-latency dispatch (its 8th entry)."""
    return len(shape) > 7 and bool(shape[7])


def _moe_capacity(shape, world):
    """Rows of the dispatch area: from max_tokens, never this rank's token count (symbolic under torch.compile,
    where passing it to C++ would specialize the graph on it)."""
    return _weft.moe_capacity(world, (1, *(int(v) for v in shape[1:])))


_last_counts = {}  # per communicator id: the counts table of its last dispatch (the exact-count read-back)
_last_row_source = {}  # per communicator id: its last dispatch's row -> source slot map (the fused combine)


def _dispatch_workspace(x, shape, world):
    """The dispatch's caller workspace (its slots' tables, which the handle copies out)."""
    nbytes = _weft.moe_dispatch_workspace_bytes(world, tuple(shape))
    return torch.empty(max(nbytes, 256), dtype=torch.uint8, device=x.device), nbytes


def _dispatch_handle(ws, shape, comm, rows, ends, row_of, kept, counts, row_source):
    """(rows, group_end, row_of, kept) of a dispatch that just ran: rows a view of the team's dispatch area
    (valid until the next dispatch); group_end copied out (the expert GEMMs keep it for their backward, and
    the next layer's dispatch rewrites the area's ends); each slot's row and expert copied out of `ws`
    (combine needs only these). Records the counts table and row map of the team's last dispatch."""
    _last_counts[comm] = counts
    _last_row_source[comm] = row_source
    tokens, top_k = shape[0], shape[4]

    def slots(ptr):  # [tokens, top_k] int32 at ptr inside ws
        at = ptr - ws.data_ptr()
        return ws[at:at + 4 * tokens * top_k].view(torch.int32).view(tokens, top_k).clone()

    return torch.from_dlpack(rows), torch.from_dlpack(ends).clone(), slots(row_of), slots(kept)


def _emulated_handle(x, shape, world):
    """What the emulated dispatch (EMULATE) returns: zero rows, empty groups, every slot dropped."""
    tokens, top_k = shape[0], shape[4]
    slots = torch.full((tokens, top_k), -1, dtype=torch.int32, device=x.device)
    ends = x.new_zeros((shape[3] // world,), dtype=torch.int32)
    return x.new_zeros((_moe_capacity(shape, world), shape[2])), ends, slots, slots.clone()


@declare("weft::moe_dispatch")
def _moe_dispatch(x: Tensor, experts: Tensor, shape: list[int], world: int,
                  comm: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    if _op_table.EMULATE:
        rows, ends, row_of, kept = _emulated_handle(x, shape, world)
        return rows, ends, row_of, kept, ends.clone() if _low_latency(shape) else ends.new_empty((0,))
    ws, nbytes = _dispatch_workspace(x, shape, world)
    rows, ends, row_of, kept, _, counts, row_source, group_rows = _weft.moe_dispatch(
        _native(comm), x.data_ptr(), experts.data_ptr(), tuple(shape), ws.data_ptr(), nbytes, DTYPES[x.dtype],
        _stream(x))
    # The low-latency dispatch's rows per group copied out as group_end (the record dispatch's: empty).
    group_rows = None if group_rows is None else torch.from_dlpack(group_rows).clone()
    handle = _dispatch_handle(ws, shape, comm, rows, ends, row_of, kept, counts, row_source)
    return (*handle, handle[1].new_empty((0,)) if group_rows is None else group_rows)


@_moe_dispatch.register_fake
def _(x, experts, shape, world, comm):
    tokens, top_k = shape[0], shape[4]
    capacity = _moe_capacity(shape, world)
    slots = experts.new_empty((tokens, top_k), dtype=torch.int32)
    per = shape[3] // world
    return (x.new_empty((capacity, shape[2])), x.new_empty((per,), dtype=torch.int32), slots,
            slots.new_empty((tokens, top_k)), x.new_empty((per if _low_latency(shape) else 0,), dtype=torch.int32))


@declare("weft::moe_combine")
def _moe_combine(expert_out: Tensor, row_of: Tensor, kept: Tensor, weights: Tensor, shape: list[int],
                 comm: int, group_rows: Tensor) -> Tensor:
    out = expert_out.new_empty((shape[0], shape[2]))
    if _op_table.EMULATE:
        return out.zero_()
    native = _native(comm)
    dtype = DTYPES[expert_out.dtype]
    # The outputs are read by the ranks that sent the tokens: from the team's symmetric combine area. A
    # low-latency handle's are copied there by the op (the rows its groups received, not the capacity).
    src = expert_out.data_ptr()
    if not group_rows.numel():
        area = torch.from_dlpack(_weft.moe_combine_input(native, tuple(shape), dtype))
        if src != area.data_ptr():
            area[:expert_out.shape[0]].copy_(expert_out)  # exact-count rows: the used rows only
        src = area.data_ptr()
    _weft.moe_combine(native, src, row_of.data_ptr(), kept.data_ptr(), weights.data_ptr(),
                      out.data_ptr(), tuple(shape), dtype, _stream(expert_out),
                      group_rows.data_ptr() if group_rows.numel() else 0)
    return out


@_moe_combine.register_fake
def _(expert_out, row_of, kept, weights, shape, comm, group_rows):
    return expert_out.new_empty((shape[0], shape[2]))


# Autograd. The dispatch's backward is a combine of the rows' gradient with weights 1 (a token's gradient is
# the sum over its slots' rows); the combine's backward gives the expert outputs' gradient (weights[t, j] *
# dout[t] at each slot's row on its expert's rank, zeros elsewhere) and the weights' (<dout[t], the slot's
# expert output>).
def _moe_dispatch_setup(ctx, inputs, output):
    _, _, shape, _, comm = inputs
    ctx.save_for_backward(output[2], output[3])
    ctx.shape, ctx.comm = shape, comm


def _moe_dispatch_backward(ctx, grad_rows, _grad_ends, _grad_row_of, _grad_kept, _grad_group_rows):
    row_of, kept = ctx.saved_tensors
    if grad_rows is None:
        return None, None, None, None, None
    if _low_latency(ctx.shape):
        raise WeftValueError("weft.moe_dispatch: the low-latency dispatch has no backward: run it under "
                             "torch.no_grad() (inference)")
    ones = torch.ones((ctx.shape[0], ctx.shape[4]), dtype=torch.float32, device=grad_rows.device)
    none = row_of.new_empty((0,))
    d_x = _moe_combine.op(grad_rows.contiguous(), row_of, kept, ones, ctx.shape, ctx.comm, none)
    return d_x, None, None, None, None


_moe_dispatch.register_autograd(_moe_dispatch_backward, setup_context=_moe_dispatch_setup)


@declare("weft::moe_combine_backward")
def _moe_combine_backward(dout: Tensor, expert_out: Tensor, row_of: Tensor, kept: Tensor, weights: Tensor,
                          shape: list[int], comm: int) -> tuple[Tensor, Tensor]:
    tokens, top_k = shape[0], shape[4]
    if _op_table.EMULATE:
        return expert_out.new_zeros(expert_out.shape), weights.new_zeros((tokens, top_k))
    native = _native(comm)
    dtype = DTYPES[expert_out.dtype]
    # expert_out is copied where the peers read it (the team's combine area) by the op itself, after a meeting:
    # a copy here could land while a peer's earlier combine (e.g. the next layer's dispatch backward) still
    # reads that area.
    expert_out = expert_out.contiguous()
    grad = torch.from_dlpack(_weft.moe_combine_grad_input(native, tuple(shape), dtype))
    d_weights = weights.new_empty((tokens, top_k))
    _weft.moe_combine_backward(native, expert_out.data_ptr(), expert_out.shape[0], row_of.data_ptr(),
                               kept.data_ptr(), weights.data_ptr(), dout.data_ptr(), grad.data_ptr(),
                               d_weights.data_ptr(), tuple(shape), dtype, _stream(dout))
    # The gradient buffer is the team's (peers write it again in the next combine backward): a copy of its own.
    return grad[:expert_out.shape[0]].clone(), d_weights


@_moe_combine_backward.register_fake
def _(dout, expert_out, row_of, kept, weights, shape, comm):
    return expert_out.new_empty(expert_out.shape), weights.new_empty((shape[0], shape[4]))


def _moe_combine_setup(ctx, inputs, output):
    expert_out, row_of, kept, weights, shape, comm, _ = inputs
    if _low_latency(shape):
        raise WeftValueError("weft.moe_combine: no gradient through a low-latency dispatch's combine: run it "
                             "under torch.no_grad() (inference)")
    # The team's combine area is overwritten by the next combine: outputs written there are kept as a copy
    # (under torch.compile, where pointers are not known, always).
    if torch.compiler.is_compiling():
        expert_out = expert_out.clone()
    elif not _op_table.EMULATE:
        area = _weft.moe_combine_input(_native(comm), tuple(shape), DTYPES[expert_out.dtype])
        if expert_out.data_ptr() == area.data_ptr:
            expert_out = expert_out.clone()
    ctx.save_for_backward(expert_out, row_of, kept, weights)
    ctx.shape, ctx.comm = shape, comm


def _moe_combine_backward_fn(ctx, grad):
    expert_out, row_of, kept, weights = ctx.saved_tensors
    d_out, d_weights = _moe_combine_backward.op(grad.to(expert_out.dtype).contiguous(), expert_out, row_of, kept,
                                                weights, ctx.shape, ctx.comm)
    return d_out, None, None, d_weights, None, None, None


_moe_combine.register_autograd(_moe_combine_backward_fn, setup_context=_moe_combine_setup)


# The second expert GEMM fused with the combine (weft::moe_grouped_gemm_combine), on the rows of the team's
# last dispatch. Its backward computes the GEMM's output again (one more GEMM), then the combine's backward
# and the GEMM's.
@declare("weft::moe_grouped_mm_combine")
def _moe_grouped_mm_combine(a: Tensor, b: Tensor, b_nk: bool, group_end: Tensor, row_of: Tensor, kept: Tensor,
                            weights: Tensor, shape: list[int], comm: int) -> Tensor:
    out = a.new_empty((shape[0], shape[2]))
    if _op_table.EMULATE:
        return out.zero_()
    inter = b.shape[2] if b_nk else b.shape[1]
    capacity = _moe_capacity(shape, _world(comm))
    _weft.moe_grouped_gemm_combine(_native(comm), a.data_ptr(), b.data_ptr(), b_nk, a.shape[0], inter,
                                   _last_row_source[comm], row_of.data_ptr(), kept.data_ptr(), group_end.data_ptr(),
                                   capacity, weights.data_ptr(), out.data_ptr(), tuple(shape), _stream(a))
    return out


@_moe_grouped_mm_combine.register_fake
def _(a, b, b_nk, group_end, row_of, kept, weights, shape, comm):
    return a.new_empty((shape[0], shape[2]))


def _moe_grouped_mm_combine_setup(ctx, inputs, output):
    a, b, b_nk, group_end, row_of, kept, weights, shape, comm = inputs
    ctx.save_for_backward(a, b, group_end, row_of, kept, weights)
    ctx.b_nk, ctx.shape, ctx.comm = b_nk, shape, comm


def _moe_grouped_mm_combine_backward(ctx, grad):
    a, b, group_end, row_of, kept, weights = ctx.saved_tensors
    y = _grouped_mm.op(a, b, group_end, ctx.b_nk, a.dtype, False, "")
    d_y, d_weights = _moe_combine_backward.op(grad.to(a.dtype).contiguous(), y, row_of, kept, weights, ctx.shape,
                                              ctx.comm)
    da = _grouped_mm.op(d_y, b, group_end, not ctx.b_nk, a.dtype, False, "")
    dkn = _grouped_weight_grad(a, d_y, group_end).to(b.dtype)
    db = dkn.transpose(1, 2).contiguous() if ctx.b_nk else dkn
    return da, db, None, None, None, None, d_weights, None, None


_moe_grouped_mm_combine.register_autograd(_moe_grouped_mm_combine_backward,
                                          setup_context=_moe_grouped_mm_combine_setup)


def _torch_moe_grouped_mm_combine(a, b, b_nk, group_end, row_of, kept, weights, shape, comm):
    """Arguments checked by the caller; b as stored."""
    return _moe_grouped_mm_combine.op(a, b, b_nk, group_end, row_of, kept, weights, list(shape), comm._id)


def _torch_moe_dispatch(x, ids, shape, comm, exact=False):
    """x, ids (int32, contiguous) checked by the caller; returns (rows, group_end, row_of, kept, counts,
    group_rows: the low-latency dispatch's rows per group, else an empty tensor). exact:
    the counts are read back (a synchronisation) as (rows per local expert, group ends, rows in use) and rows
    is cut to the rows in use; else counts is None. Under autograd rows is a copy of the team's dispatch area
    (which the next dispatch overwrites), since what consumes it (e.g. grouped_mm, for its weights' gradient
    even where x needs none) may keep it for its backward."""
    rows, ends, row_of, kept, group_rows = _moe_dispatch.op(x, ids, list(shape), comm.world_size, comm._id)
    counts = None
    if exact:
        per = shape[3] // comm.world_size
        counts = (([0] * per, [0] * per, 0) if _op_table.EMULATE else
                  _weft.moe_counts(comm._c, _last_counts[comm._id], ends.data_ptr(), tuple(shape), _stream(x)))
        rows = rows[:counts[2]]
    if torch.is_grad_enabled() and not _low_latency(shape):  # (the low-latency dispatch has no backward)
        rows = rows.clone()
    return rows, ends, row_of, kept, counts, group_rows


# The dispatch and the first expert GEMM in one kernel (inference: no autograd): c [capacity, n] (or n / 2
# with SwiGLU in the epilogue) = each group's rows . its expert's b, and the dispatch's handle as
# _moe_dispatch returns it.
@declare("weft::moe_dispatch_grouped_mm")
def _moe_dispatch_grouped_mm(x: Tensor, experts: Tensor, b: Tensor, b_nk: bool, swiglu: bool, shape: list[int],
                             world: int, comm: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    n = b.shape[1] if b_nk else b.shape[2]
    out = x.new_empty((_moe_capacity(shape, world), n // 2 if swiglu else n))
    if _op_table.EMULATE:
        return (out.zero_(), *_emulated_handle(x, shape, world))
    ws, nbytes = _dispatch_workspace(x, shape, world)
    rows, ends, row_of, kept, _, counts, row_source, _ = _weft.moe_dispatch_grouped_gemm(
        _native(comm), x.data_ptr(), experts.data_ptr(), tuple(shape), ws.data_ptr(), nbytes, b.data_ptr(), b_nk,
        n, swiglu, out.data_ptr(), _stream(x))
    return (out, *_dispatch_handle(ws, shape, comm, rows, ends, row_of, kept, counts, row_source))


@_moe_dispatch_grouped_mm.register_fake
def _(x, experts, b, b_nk, swiglu, shape, world, comm):
    tokens, top_k = shape[0], shape[4]
    n = b.shape[1] if b_nk else b.shape[2]
    capacity = _moe_capacity(shape, world)
    slots = experts.new_empty((tokens, top_k), dtype=torch.int32)
    return (x.new_empty((capacity, n // 2 if swiglu else n)), x.new_empty((capacity, shape[2])),
            x.new_empty((shape[3] // world,), dtype=torch.int32), slots, slots.new_empty((tokens, top_k)))


def _torch_moe_dispatch_grouped_mm(x, ids, b, b_nk, swiglu, shape, comm):
    """x, ids (int32, contiguous), b (as stored) checked by the caller; returns (c, rows, group_end, row_of,
    kept)."""
    return _moe_dispatch_grouped_mm.op(x, ids, b, b_nk, swiglu, list(shape), comm.world_size, comm._id)


def _torch_moe_combine(expert_out, row_of, kept, weights, shape, comm, group_rows=None):
    if group_rows is None:
        group_rows = row_of.new_empty((0,))
    return _moe_combine.op(expert_out.contiguous(), row_of, kept, weights, list(shape), comm._id, group_rows)


# The low-latency layer's down GEMM and combine (inference, no autograd): the GEMM writes straight into the
# team's combine area (the rows the peers read), so no copy comes between the two (moe_combine given the
# GEMM's output elsewhere copies the rows the groups received into the area first).
@declare("weft::moe_grouped_mm_then_combine")
def _moe_grouped_mm_then_combine(a: Tensor, b: Tensor, b_nk: bool, group_end: Tensor, group_rows: Tensor,
                                 row_of: Tensor, kept: Tensor, weights: Tensor, shape: list[int],
                                 comm: int) -> Tensor:
    out = a.new_empty((shape[0], shape[2]))
    if _op_table.EMULATE:
        return out.zero_()
    native = _native(comm)
    area = torch.from_dlpack(_weft.moe_combine_input(native, tuple(shape), "bf16"))
    stream = _stream(a)
    _weft.grouped_gemm(a.get_device(), a.data_ptr(), b.data_ptr(), area.data_ptr(), group_end.data_ptr(),
                       group_end.shape[0], a.shape[0], shape[2], a.shape[1], "nk" if b_nk else "kn", "bf16",
                       False, "", stream, group_rows.data_ptr())
    _weft.moe_combine(native, area.data_ptr(), row_of.data_ptr(), kept.data_ptr(), weights.data_ptr(),
                      out.data_ptr(), tuple(shape), "bf16", stream, group_rows.data_ptr())
    return out


@_moe_grouped_mm_then_combine.register_fake
def _(a, b, b_nk, group_end, group_rows, row_of, kept, weights, shape, comm):
    return a.new_empty((shape[0], shape[2]))


def _torch_moe_grouped_mm_then_combine(a, b, b_nk, group_end, group_rows, row_of, kept, weights, shape, comm):
    return _moe_grouped_mm_then_combine.op(a, b, b_nk, group_end, group_rows, row_of, kept, weights, list(shape),
                                           comm._id)
