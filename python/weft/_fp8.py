"""FP8 (torch tensors): on a team weft.all_gather_scaled_matmul, weft.scaled_matmul_reduce_scatter and
weft.scaled_matmul_all_reduce; on one GPU weft.scaled_mm, weft's FP8 GEMM with torch._scaled_mm's operand layout
(per-tensor and per-row / column scales as torch's; DeepSeek-V3's block scales row-major and contiguous, or
for A also M-major, torch's layout for them), and weft.quantize_fp8, which makes its operands. These are torch
operators (torch.ops.weft.*, fake implementations: torch.compile traces them, CUDA graphs capture them), with no
autograd; queued on torch's current stream."""
from __future__ import annotations

from typing import Optional

from . import _op_table, _weft
from ._args import _comm, _torch_tensor
from ._errors import WeftTypeError, WeftValueError
from ._op_table import DTYPES, Tensor, _native, _stream, declare, torch

__all__ = ["scaled_mm", "grouped_scaled_mm", "quantize_fp8", "all_gather_scaled_matmul",
           "scaled_matmul_reduce_scatter", "scaled_matmul_all_reduce"]

_BLOCK = 128


def _fp8_name(torch, dtype, where):
    names = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
    if dtype not in names:
        raise WeftTypeError(f"{where}: FP8 tensors must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    return names[dtype]


def _scale_a_layout(s):
    """How A's block scales s [M, G] lie: ("m", ld) M-major, strides (1, ld) with ld >= M (torch's layout of 1 x
    128 blockwise scales; with ld a multiple of 4 the fastest, bench/RESULTS.md 2026-11-29), or ("row", stride)
    rows of contiguous scales stride floats apart; None for anything else. One k-block (G == 1) is read as rows
    (either layout holds row i's scale at i times its first stride)."""
    if s.dim() != 2:
        return None
    rows, groups = s.shape
    if groups > 1 and s.stride(0) == 1 and s.stride(1) >= rows:
        return ("m", s.stride(1))
    if groups == 1 or s.stride(1) == 1:
        return ("row", s.stride(0) if rows > 1 else groups)
    return None


def _scaling(torch, scale_a, scale_b, m, n, k, where, m_major_a=False):
    """The scaling kind the scales' shapes give (see scaled_mm); m_major_a: block scales of A may be M-major."""
    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if not _torch_tensor(s) or s.dtype != torch.float32:
            raise WeftTypeError(f"{where}: {name} must be a float32 torch tensor")
        m_major = m_major_a and name == "scale_a" and (_scale_a_layout(s) or ("",))[0] == "m"
        if not s.is_contiguous() and not m_major:
            also = ""
            if m_major_a and name == "scale_a":
                also = " (or, for block scales, M-major: strides (1, ld), ld >= M)"
            raise WeftTypeError(f"{where}: {name} must be a contiguous float32 torch tensor{also}")
    groups = -(-k // _BLOCK)
    shapes = {
        "tensor": ((1,), (1,)),
        "rowcol": ((m, 1), (1, n)),
        "block": ((m, groups), (-(-n // _BLOCK), groups)),
    }
    def fits(s, shape):  # that shape, or one element where the shape holds one
        size = 1
        for d in shape:
            size *= d
        return tuple(s.shape) == shape or (s.numel() == 1 and size == 1)

    for kind, (sa, sb) in shapes.items():  # where several fit (one element each), they mean the same
        if fits(scale_a, sa) and fits(scale_b, sb):
            if kind != "block" and not scale_a.is_contiguous():
                raise WeftValueError(f"{where}: an M-major scale_a is for block scales only ({kind} scales here)")
            return kind
    raise WeftValueError(f"{where}: scales of shapes {tuple(scale_a.shape)} and {tuple(scale_b.shape)} match no "
                         f"scaling for M={m}, N={n}, K={k}: per tensor (one element each), per row [M, 1] and "
                         f"column [1, N], or blocks [M, ceil(K/128)] and [ceil(N/128), ceil(K/128)]")


def scaled_mm(a, b, scale_a, scale_b, out_dtype=None):
    """out [M, N] = (a @ b) scaled, in fp32 with the accumulation promoted every 128 of K.

    a [M, K] FP8 (torch.float8_e4m3fn or float8_e5m2), contiguous; b [K, N] of the same type, the .t() view of a
    contiguous [N, K] weight (torch._scaled_mm's layout). Scales float32, their shapes saying how they apply:
    one element each (per tensor: out = sa sb (a @ b)); scale_a [M, 1] and scale_b [1, N] (per row and column);
    scale_a [M, ceil(K/128)] and scale_b [ceil(N/128), ceil(K/128)] (DeepSeek-V3's blocks: A 1 x 128 along K,
    the weight 128 x 128); block scales of A contiguous or M-major (strides (1, ld), ld >= M: torch._scaled_mm's
    layout for them, e.g. `s.t().contiguous().t()`; with ld a multiple of 4 and a 16-byte aligned base the
    GEMM's pipeline copies them beside the operands, measured 1.01-1.06x contiguous ones, which its
    threads read themselves). K a multiple of 16.
    out_dtype torch.bfloat16 (default) or torch.float32.
    """
    where = "weft.scaled_mm"
    if not all(_torch_tensor(x) for x in (a, b, scale_a, scale_b)):
        raise WeftTypeError(f"{where}: a, b, scale_a and scale_b must be torch tensors")
    for name, x in (("a", a), ("b", b), ("scale_a", scale_a), ("scale_b", scale_b)):
        if not x.is_cuda or x.device != a.device:
            raise WeftValueError(f"{where}: {name} must be a CUDA tensor on a's device, got one on {x.device}")
    ab = _fp8_name(torch, a.dtype, where)
    if b.dtype != a.dtype:
        raise WeftTypeError(f"{where}: a and b must have one FP8 type, got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise WeftValueError(f"{where}: a must be [M, K] and b [K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    if not a.is_contiguous():
        raise WeftValueError(f"{where}: a must be contiguous")
    if not b.t().is_contiguous():
        raise WeftValueError(f"{where}: b must be the .t() view of a contiguous [N, K] weight (8-bit tensor-core "
                             "operands are read K-major)")
    m, k = a.shape
    n = b.shape[1]
    if k % 16:
        raise WeftValueError(f"{where}: K = {k} must be a multiple of 16 (16-byte rows for TMA)")
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise WeftTypeError(f"{where}: out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    if n % (8 if out_dtype == torch.bfloat16 else 4):
        raise WeftValueError(f"{where}: N = {n} must be a multiple of 8 (bf16 out) or 4 (float32 out)")
    kind = _scaling(torch, scale_a, scale_b, m, n, k, where, m_major_a=True)
    return _torch_scaled_mm(a, b, scale_a, scale_b, ab, kind, out_dtype == torch.bfloat16)


def grouped_scaled_mm(a, b, group_end, scale_a, scale_b, out_dtype=None, group_rows=None):
    """An MoE layer's experts on FP8 rows (DeepSeek-V3's recipe): out [rows, N], whose rows of group e are a's
    rows of group e times b[e]^T, with block scales.

    a [rows, K] FP8 (float8_e4m3fn / e5m2), rows contiguous (their stride a multiple of 16), in groups back to back: group e is rows
    [group_end[e - 1], group_end[e]) (group_end int32 on the GPU, ascending, every end a multiple of 128, e.g.
    weft.moe_dispatch's with align=128); rows a multiple of 128 (rows past the last end are left unwritten).
    b [groups, N, K] of the same FP8 type, contiguous (each expert's K-major weight). scale_a [rows,
    ceil(K/128)] and scale_b [groups, ceil(N/128), ceil(K/128)] float32 (weft.quantize_fp8's block scales of a,
    and of each b[e] stacked; scale_a's rows may be strided too, or scale_a M-major, strides (1, ld) with ld >=
    rows: quantize_fp8(..., m_major=True)'s, the faster form). K a multiple of 16. out_dtype torch.bfloat16
    (default) or torch.float32. weft.moe_dispatch_fp8's rows and scales go in as they are.
    group_rows (int32 [groups] on a's device, e.g. a low-latency dispatch's d.group_rows): group e holds only its
    first group_rows[e] rows: only the tiles holding them are computed (the rest of each group's output rows are
    left unwritten).
    """
    where = "weft.grouped_scaled_mm"
    if not all(_torch_tensor(x) for x in (a, b, group_end, scale_a, scale_b)):
        raise WeftTypeError(f"{where}: a, b, group_end, scale_a and scale_b must be torch tensors")
    layout = _scale_a_layout(scale_a)
    for name, x in (("a", a), ("b", b), ("group_end", group_end), ("scale_a", scale_a), ("scale_b", scale_b)):
        if not x.is_cuda or x.device != a.device:
            raise WeftValueError(f"{where}: {name} must be a CUDA tensor on a's device")
        # a: rows may be strided (weft.moe_dispatch_fp8's packed rows); scale_a: any layout _scale_a_layout
        # names (strided rows, M-major); the rest contiguous.
        strided_rows = name == "a" and x.dim() == 2 and x.stride(1) == 1
        if not (x.is_contiguous() or strided_rows or (name == "scale_a" and layout)):
            raise WeftValueError(f"{where}: {name} must be contiguous" +
                                 {"a": " or have contiguous rows",
                                  "scale_a": ", have contiguous rows or be M-major (strides (1, ld), ld >= rows)"}
                                 .get(name, ""))
    ab = _fp8_name(torch, a.dtype, where)
    if b.dtype != a.dtype:
        raise WeftTypeError(f"{where}: a and b must have one FP8 type, got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[2]:
        raise WeftValueError(f"{where}: a must be [rows, K] and b [groups, N, K], got {tuple(a.shape)} and "
                             f"{tuple(b.shape)}")
    rows, k = a.shape
    groups, n = b.shape[0], b.shape[1]
    if group_end.dtype != torch.int32 or tuple(group_end.shape) != (groups,):
        raise WeftValueError(f"{where}: group_end must be int32 [{groups}], got {group_end.dtype} "
                             f"{tuple(group_end.shape)}")
    if rows % 128 or k % 16:
        raise WeftValueError(f"{where}: rows ({rows}) must be a multiple of 128 and K ({k}) of 16")
    if a.stride(0) < k or a.stride(0) % 16:
        raise WeftValueError(f"{where}: a's row stride ({a.stride(0)} bytes) must be at least K and a multiple of 16")
    blocks = -(-k // _BLOCK)
    if scale_a.dtype != torch.float32 or tuple(scale_a.shape) != (rows, blocks) or \
            scale_b.dtype != torch.float32 or tuple(scale_b.shape) != (groups, -(-n // _BLOCK), blocks):
        raise WeftValueError(f"{where}: scale_a must be float32 [{rows}, {blocks}] and scale_b float32 [{groups}, "
                             f"{-(-n // _BLOCK)}, {blocks}], got {tuple(scale_a.shape)} and {tuple(scale_b.shape)}")
    if layout[0] == "row" and layout[1] < blocks:
        raise WeftValueError(f"{where}: scale_a's row stride ({scale_a.stride(0)} floats) must be at least "
                             f"ceil(K / 128) = {blocks}")
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise WeftTypeError(f"{where}: out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    if n % (8 if out_dtype == torch.bfloat16 else 4):
        raise WeftValueError(f"{where}: N = {n} must be a multiple of 8 (bf16 out) or 4 (float32 out)")
    if group_rows is not None:
        if not _torch_tensor(group_rows) or group_rows.dtype != torch.int32 or \
                tuple(group_rows.shape) != (groups,) or group_rows.device != a.device:
            raise WeftValueError(f"{where}: group_rows must be an int32 tensor of {groups} on a's device")
        group_rows = group_rows.contiguous()
    return _torch_grouped_scaled_mm(a, b, group_end, scale_a, scale_b, ab, out_dtype == torch.bfloat16,
                                    group_rows)


_ACTIVATIONS = ("swiglu", "silu", "gelu", "relu")


def quantize_fp8(x, scaling="block", operand="a", dtype=None, m_major=False, activation=None, group_end=None,
                 group_rows=None):
    """(q, scales): x [rows, cols] (bf16 / fp16, contiguous) in FP8 with the scales weft.scaled_mm reads.

    operand "a": x is the left operand [M, K]; "b": the weight [N, K] (pass q.t() to scaled_mm). scaling
    "tensor" (scales [1]), "rowcol" (one per row: [M, 1] for a, [1, N] for b) or "block" (a: [M, ceil(K/128)],
    b: [ceil(N/128), ceil(K/128)]). Each scale is amax / the format's largest value (448 e4m3, 57344 e5m2) over
    what it covers. dtype torch.float8_e4m3fn (default) or torch.float8_e5m2. m_major (block scales of a only):
    the scales M-major, strides (1, ld) with ld M rounded up to 4 (torch._scaled_mm's layout; the one
    scaled_mm's pipeline copies, bench/RESULTS.md 2026-11-29), written so by the quantization itself; the
    team ops (all_gather_scaled_matmul, the MoE dispatch) take contiguous ones.
    activation (block scales of a only): "swiglu" (x [rows, 2 cols] as [gate | up]: silu(gate) * up), "silu",
    "gelu" (erf form) or "relu", applied in fp32 in the same pass (no bf16 intermediate; cols a multiple of 4).
    group_end and group_rows (int32 [groups] on x's device, with an activation or without): only the first
    group_rows[e] rows of each group e, rows [group_end[e - 1], group_end[e]), are quantized, as a low-latency
    dispatch fills its groups; the other rows of q and scales are left unwritten (undefined).
    """
    where = "weft.quantize_fp8"
    if not _torch_tensor(x):
        raise WeftTypeError(f"{where}: x must be a torch tensor")
    if not x.is_cuda or x.dim() != 2 or not x.is_contiguous():
        raise WeftValueError(f"{where}: x must be a contiguous 2-D CUDA tensor, got {tuple(x.shape)} on {x.device}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise WeftTypeError(f"{where}: x must be bf16 or fp16, got {x.dtype}")
    if scaling not in ("tensor", "rowcol", "block") or operand not in ("a", "b"):
        raise WeftValueError(f"{where}: scaling must be 'tensor', 'rowcol' or 'block' and operand 'a' or 'b', got "
                             f"{scaling!r}, {operand!r}")
    if m_major and (scaling, operand) != ("block", "a"):
        raise WeftValueError(f"{where}: m_major is for block scales of operand 'a', got {scaling!r}, {operand!r}")
    dtype = torch.float8_e4m3fn if dtype is None else dtype
    kind = _fp8_name(torch, dtype, where)
    if activation is not None or group_rows is not None:
        return _activate_quantize(x, kind, activation, m_major, group_end, group_rows, scaling, operand, where)
    rows, cols = x.shape
    groups = -(-cols // _BLOCK)
    if scaling == "tensor":
        shape = (1,)
    elif scaling == "rowcol":
        shape = (rows, 1) if operand == "a" else (1, rows)
    else:
        shape = (rows, groups) if operand == "a" else (-(-rows // _BLOCK), groups)
    if not m_major:
        return _torch_quantize_fp8(x, kind, scaling, operand, shape, 0)
    shape, ld = _m_major_layout(rows, groups)
    q, strided = _torch_quantize_fp8(x, kind, scaling, operand, shape, ld)
    return q, strided[:, :rows].t()


def _m_major_layout(rows, groups):
    """The buffer A's M-major block scales are written into, [groups, ld], and ld: rows rounded up to 4 (whole
    16 bytes between k-blocks, so TMA can copy them); the scales are its [:, :rows].t() view."""
    ld = -(-rows // 4) * 4
    return [groups, ld], ld


def _activate_quantize(x, kind, activation, m_major, group_end, group_rows, scaling, operand, where):
    """quantize_fp8 with an activation or counted rows (weft::activate_quantize_fp8): A's block scales."""
    if (scaling, operand) != ("block", "a"):
        raise WeftValueError(f"{where}: an activation or group_rows is for block scales of operand 'a', got "
                             f"{scaling!r}, {operand!r}")
    if activation is not None and activation not in _ACTIVATIONS:
        raise WeftValueError(f"{where}: activation must be None or one of {_ACTIVATIONS}, got {activation!r}")
    rows, in_cols = x.shape
    cols = in_cols // 2 if activation == "swiglu" else in_cols
    if cols % 4 or (activation == "swiglu" and in_cols % 2):
        raise WeftValueError(f"{where}: the output's columns ({cols}) must be a multiple of 4"
                             + (" and x's even (gate | up)" if activation == "swiglu" else ""))
    if (group_end is None) != (group_rows is None):
        raise WeftValueError(f"{where}: group_end and group_rows go together")
    if group_rows is not None:
        for name, t in (("group_end", group_end), ("group_rows", group_rows)):
            if not _torch_tensor(t) or t.dtype != torch.int32 or t.dim() != 1 or t.device != x.device:
                raise WeftValueError(f"{where}: {name} must be a 1-D int32 tensor on x's device")
        if group_end.shape != group_rows.shape or group_end.numel() < 1:
            raise WeftValueError(f"{where}: group_end and group_rows must have one (and the same) length, got "
                                 f"{tuple(group_end.shape)} and {tuple(group_rows.shape)}")
        group_end, group_rows = group_end.contiguous(), group_rows.contiguous()
    groups = -(-cols // _BLOCK)
    shape, ld = _m_major_layout(rows, groups) if m_major else ([rows, groups], 0)
    q, scales = _activate_quantize_fp8.op(x, kind, activation or "none", cols, shape, ld, group_end, group_rows)
    return q, scales[:, :rows].t() if m_major else scales


def _fp8_team_operands(torch, c, a, b, scale_a, scale_b, where):
    """(rows, N, K, FP8 type name, scaling kind) of a team op's a [rows, K] and b [K, N] (the .t() view of a
    contiguous [N, K] weight) on this rank's GPU, K a multiple of 16 and N of 8, scales as scaled_mm's."""
    for name, x in (("a", a), ("b", b), ("scale_a", scale_a), ("scale_b", scale_b)):
        if not x.is_cuda or x.get_device() != c.device:
            raise WeftValueError(f"{where}: {name} must be a CUDA tensor on this rank's cuda:{c.device}, got one "
                                 f"on {x.device}")
    ab = _fp8_name(torch, a.dtype, where)
    if b.dtype != a.dtype:
        raise WeftTypeError(f"{where}: a and b must have one FP8 type, got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise WeftValueError(f"{where}: a must be [rows, K] and b [K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    if not a.is_contiguous() or not b.t().is_contiguous():
        raise WeftValueError(f"{where}: a must be contiguous and b the .t() view of a contiguous [N, K] weight")
    rows, k = a.shape
    n = b.shape[1]
    if k % 16 or n % 8:
        raise WeftValueError(f"{where}: K = {k} must be a multiple of 16 and N = {n} of 8 (16-byte rows for TMA)")
    return rows, n, k, ab, _scaling(torch, scale_a, scale_b, rows, n, k, where)


def all_gather_scaled_matmul(a, b, scale_a, scale_b, comm=None):
    """out [M, N] bf16 = (all_gather(a, dim 0) @ b) scaled, a [M / world, K] FP8 on each rank; b [K, N] the .t()
    view of this rank's contiguous [N, K] FP8 weight, as weft.scaled_mm takes it.

    Scales float32, contiguous, as weft.quantize_fp8 makes them: per row (scale_a [M / world, 1], scale_b
    [1, N]) or per block (scale_a [M / world, ceil(K/128)], scale_b [ceil(N/128), ceil(K/128)]); a's scales are
    gathered with its rows. Per-tensor scales are refused (each rank's shard would bring its own). K a multiple
    of 16, N of 8. A torch operator (no autograd); the fused kernel where it fits, else all_gather then the FP8 GEMM.
    """
    where = "weft.all_gather_scaled_matmul"
    if not all(_torch_tensor(x) for x in (a, b, scale_a, scale_b)):
        raise WeftTypeError(f"{where}: a, b, scale_a and scale_b must be torch tensors")
    c = _comm(comm)
    rows, n, k, ab, kind = _fp8_team_operands(torch, c, a, b, scale_a, scale_b, where)
    if kind == "tensor":
        raise WeftValueError(f"{where}: per-tensor scales are refused: each rank's shard would bring its own; "
                             "quantize a per row (scaling='rowcol') or per block (scaling='block')")
    return _torch_all_gather_scaled_matmul(a, b, scale_a, scale_b, ab, kind, c)


def _scaled_reduce(a, b, scale_a, scale_b, comm, all_reduce, where):
    """scaled_matmul_reduce_scatter / all_reduce: checks, then the op; this rank's rows or all of them."""
    if not all(_torch_tensor(x) for x in (a, b, scale_a, scale_b)):
        raise WeftTypeError(f"{where}: a, b, scale_a and scale_b must be torch tensors")
    c = _comm(comm)
    m, n, k, ab, kind = _fp8_team_operands(torch, c, a, b, scale_a, scale_b, where)
    if not all_reduce and m % c.world_size:
        raise WeftValueError(f"{where}: a has {m} rows, not divisible by the world size {c.world_size}")
    return _torch_scaled_matmul_reduce(a, b, scale_a, scale_b, ab, kind, all_reduce, c)


def scaled_matmul_reduce_scatter(a, b, scale_a, scale_b, comm=None):
    """The [M, N] bf16 sum over ranks of each rank's (a @ b) scaled by its own scales; this rank gets rows
    rank * M / world .. (rank + 1) * M / world. a [M, K] and b [K, N] (the .t() view of a [N, K] weight) FP8,
    scales as weft.scaled_mm takes them (per tensor, per row and column, or blocks). A torch operator (no autograd)."""
    return _scaled_reduce(a, b, scale_a, scale_b, comm, False, "weft.scaled_matmul_reduce_scatter")


def scaled_matmul_all_reduce(a, b, scale_a, scale_b, comm=None):
    """The [M, N] bf16 sum over ranks of each rank's (a @ b) scaled by its own scales, on every rank; any M.
    Operands and scales as scaled_matmul_reduce_scatter's. A torch operator (no autograd)."""
    return _scaled_reduce(a, b, scale_a, scale_b, comm, True, "weft.scaled_matmul_all_reduce")


# ---- the torch operators (weft._op_table): fake implementations, no autograd ------------------------------------
# Arguments checked by the functions above; ab: the FP8 type's name ("e4m3" / "e5m2"), kind: the scaling's
# ("tensor", "rowcol", "block"). b is the .t() view of a contiguous [N, K] weight (its data pointer is the
# weight's).
@declare("weft::scaled_mm")
def _scaled_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, ab: str, kind: str, out_bf16: bool) -> Tensor:
    (m, k), n = a.shape, b.shape[1]
    out = a.new_empty((m, n), dtype=torch.bfloat16 if out_bf16 else torch.float32)
    if _op_table.EMULATE:
        return out.zero_()
    # block scales of A row-major (contiguous) or M-major (strides (1, ld)); scaled_mm checked which on the
    # tensor it traced, this is the one the call got
    layout = _scale_a_layout(scale_a) if kind == "block" else ("row", 0)
    if not scale_a.is_contiguous() and (layout is None or layout[0] != "m"):
        raise WeftValueError(f"weft.scaled_mm: scale_a has strides {tuple(scale_a.stride())}: neither contiguous nor "
                             "M-major (1, ld)")
    m_stride = layout[1] if layout[0] == "m" else 0
    _weft.gemm_fp8(a.get_device(), a.data_ptr(), b.data_ptr(), out.data_ptr(), m, n, k, ab, kind, scale_a.data_ptr(),
                   scale_b.data_ptr(), "bf16" if out_bf16 else "fp32", _stream(a), m_stride)
    return out


@_scaled_mm.register_fake
def _(a, b, scale_a, scale_b, ab, kind, out_bf16):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16 if out_bf16 else torch.float32)


def _torch_scaled_mm(a, b, scale_a, scale_b, ab, kind, out_bf16):
    return _scaled_mm.op(a, b, scale_a, scale_b, ab, kind, out_bf16)


@declare("weft::grouped_scaled_mm")
def _grouped_scaled_mm(a: Tensor, b: Tensor, group_end: Tensor, scale_a: Tensor, scale_b: Tensor, ab: str,
                       out_bf16: bool, group_rows: Optional[Tensor]) -> Tensor:
    # a and scale_a may be row-strided views (weft.moe_dispatch_fp8's packed rows): their row strides pass on;
    # scale_a may be M-major: its stride between k-blocks passes on.
    rows, k = a.shape
    groups, n = b.shape[0], b.shape[1]
    out = a.new_empty((rows, n), dtype=torch.bfloat16 if out_bf16 else torch.float32)
    if _op_table.EMULATE:
        return out.zero_()
    layout = _scale_a_layout(scale_a)
    if layout is None:
        raise WeftValueError(f"weft.grouped_scaled_mm: scale_a has strides {tuple(scale_a.stride())}: neither rows of "
                             "contiguous scales nor M-major (1, ld)")
    m_major = layout[0] == "m"
    _weft.grouped_gemm_fp8(a.get_device(), a.data_ptr(), b.data_ptr(), out.data_ptr(), group_end.data_ptr(), groups,
                           rows, n, k, ab, scale_a.data_ptr(), scale_b.data_ptr(), "bf16" if out_bf16 else "fp32",
                           _stream(a), a.stride(0), 0 if m_major else layout[1],
                           0 if group_rows is None else group_rows.data_ptr(), layout[1] if m_major else 0)
    return out


@_grouped_scaled_mm.register_fake
def _(a, b, group_end, scale_a, scale_b, ab, out_bf16, group_rows):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16 if out_bf16 else torch.float32)


def _torch_grouped_scaled_mm(a, b, group_end, scale_a, scale_b, ab, out_bf16, group_rows=None):
    return _grouped_scaled_mm.op(a, b, group_end, scale_a, scale_b, ab, out_bf16, group_rows)


@declare("weft::all_gather_scaled_matmul")
def _all_gather_scaled_matmul(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, ab: str, kind: str, world: int,
                              comm: int) -> Tensor:
    m, k, n = a.shape[0] * world, a.shape[1], b.shape[1]
    out = a.new_empty((m, n), dtype=torch.bfloat16)
    if _op_table.EMULATE:
        return out.zero_()
    _weft.all_gather_scaled_matmul(_native(comm), a.data_ptr(), scale_a.data_ptr(), b.data_ptr(), scale_b.data_ptr(),
                                   out.data_ptr(), m, n, k, ab, kind, _stream(a))
    return out


@_all_gather_scaled_matmul.register_fake
def _(a, b, scale_a, scale_b, ab, kind, world, comm):
    return a.new_empty((a.shape[0] * world, b.shape[1]), dtype=torch.bfloat16)


def _torch_all_gather_scaled_matmul(a, b, scale_a, scale_b, ab, kind, comm):
    return _all_gather_scaled_matmul.op(a, b, scale_a, scale_b, ab, kind, comm.world_size, comm._id)


@declare("weft::scaled_matmul_reduce")
def _scaled_matmul_reduce(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, ab: str, kind: str,
                          all_reduce: bool, world: int, comm: int) -> Tensor:
    (m, k), n = a.shape, b.shape[1]
    out = a.new_empty((m if all_reduce else m // world, n), dtype=torch.bfloat16)
    if _op_table.EMULATE:
        return out.zero_()
    _weft.scaled_matmul_reduce(_native(comm), a.data_ptr(), scale_a.data_ptr(), b.data_ptr(), scale_b.data_ptr(),
                               out.data_ptr(), m, n, k, ab, kind, all_reduce, _stream(a))
    return out


@_scaled_matmul_reduce.register_fake
def _(a, b, scale_a, scale_b, ab, kind, all_reduce, world, comm):
    rows = a.shape[0] if all_reduce else a.shape[0] // world
    return a.new_empty((rows, b.shape[1]), dtype=torch.bfloat16)


def _torch_scaled_matmul_reduce(a, b, scale_a, scale_b, ab, kind, all_reduce, comm):
    return _scaled_matmul_reduce.op(a, b, scale_a, scale_b, ab, kind, all_reduce, comm.world_size, comm._id)


@declare("weft::quantize_fp8")
def _quantize_fp8(x: Tensor, fp8: str, scaling: str, operand: str, scale_shape: list[int],
                  scale_m_stride: int) -> tuple[Tensor, Tensor]:
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=torch.float8_e5m2 if fp8 == "e5m2" else torch.float8_e4m3fn,
                    device=x.device)
    scales = torch.empty(scale_shape, dtype=torch.float32, device=x.device)
    if _op_table.EMULATE:
        return q.zero_(), scales.fill_(1.0)
    _weft.quantize_fp8(x.get_device(), x.data_ptr(), DTYPES[x.dtype], q.data_ptr(), fp8, scales.data_ptr(), rows,
                       cols, scaling, operand, _stream(x), scale_m_stride)
    return q, scales


@_quantize_fp8.register_fake
def _(x, fp8, scaling, operand, scale_shape, scale_m_stride):
    dtype = torch.float8_e5m2 if fp8 == "e5m2" else torch.float8_e4m3fn
    return x.new_empty(x.shape, dtype=dtype), x.new_empty(scale_shape, dtype=torch.float32)


@declare("weft::activate_quantize_fp8")
def _activate_quantize_fp8(x: Tensor, fp8: str, activation: str, cols: int, scale_shape: list[int], scale_m_stride: int,
                           group_end: Optional[Tensor], group_rows: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    rows = x.shape[0]
    q = torch.empty((rows, cols), dtype=torch.float8_e5m2 if fp8 == "e5m2" else torch.float8_e4m3fn,
                    device=x.device)
    scales = torch.empty(scale_shape, dtype=torch.float32, device=x.device)
    if _op_table.EMULATE:
        return q.zero_(), scales.fill_(1.0)
    _weft.activate_quantize_fp8(x.get_device(), x.data_ptr(), DTYPES[x.dtype], activation, q.data_ptr(), fp8,
                                scales.data_ptr(), rows, cols, _stream(x), scale_m_stride,
                                0 if group_end is None else group_end.data_ptr(),
                                0 if group_rows is None else group_rows.data_ptr(),
                                0 if group_rows is None else group_rows.numel())
    return q, scales


@_activate_quantize_fp8.register_fake
def _(x, fp8, activation, cols, scale_shape, scale_m_stride, group_end, group_rows):
    dtype = torch.float8_e5m2 if fp8 == "e5m2" else torch.float8_e4m3fn
    return x.new_empty((x.shape[0], cols), dtype=dtype), x.new_empty(scale_shape, dtype=torch.float32)


def _torch_quantize_fp8(x, fp8, scaling, operand, scale_shape, scale_m_stride):
    """scale_m_stride > 0: A's block scales M-major in a [groups, scale_m_stride] buffer (scale_shape)."""
    return _quantize_fp8.op(x, fp8, scaling, operand, list(scale_shape), scale_m_stride)
