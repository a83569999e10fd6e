"""FP8 on one GPU (torch tensors): weft.scaled_mm, weft's FP8 GEMM with torch._scaled_mm's operand layout
(per-tensor and per-row / column scales as torch's; DeepSeek-V3's block scales row-major and contiguous,
which is not torch's layout for them), and weft.quantize_fp8, which makes its operands. Eager (no autograd); queued on
torch's current stream."""
from __future__ import annotations

import weft as _w
from . import _weft
from ._args import _torch_tensor
from ._errors import WeftTypeError, WeftValueError

__all__ = ["scaled_mm", "quantize_fp8"]

_BLOCK = 128


def _fp8_name(torch, dtype, where):
    names = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
    if dtype not in names:
        raise WeftTypeError(f"{where}: FP8 tensors must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    return names[dtype]


def _scaling(torch, scale_a, scale_b, m, n, k, where):
    """The scaling kind the scales' shapes give (see scaled_mm)."""
    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if not _torch_tensor(s) or s.dtype != torch.float32 or not s.is_contiguous():
            raise WeftTypeError(f"{where}: {name} must be a contiguous float32 torch tensor")
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
    the weight 128 x 128). K a multiple of 16. out_dtype torch.bfloat16 (default) or torch.float32.
    """
    where = "weft.scaled_mm"
    if not all(_torch_tensor(x) for x in (a, b, scale_a, scale_b)):
        raise WeftTypeError(f"{where}: a, b, scale_a and scale_b must be torch tensors")
    torch = _w._ops.torch
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
    kind = _scaling(torch, scale_a, scale_b, m, n, k, where)
    out = a.new_empty((m, n), dtype=out_dtype)
    stream = torch.cuda.current_stream(a.device).cuda_stream
    _weft.gemm_fp8(a.get_device(), a.data_ptr(), b.data_ptr(), out.data_ptr(), m, n, k, ab, kind,
                   scale_a.data_ptr(), scale_b.data_ptr(), "bf16" if out_dtype == torch.bfloat16 else "fp32", stream)
    return out


def quantize_fp8(x, scaling="block", operand="a", dtype=None):
    """(q, scales): x [rows, cols] (bf16 / fp16, contiguous) in FP8 with the scales weft.scaled_mm reads.

    operand "a": x is the left operand [M, K]; "b": the weight [N, K] (pass q.t() to scaled_mm). scaling
    "tensor" (scales [1]), "rowcol" (one per row: [M, 1] for a, [1, N] for b) or "block" (a: [M, ceil(K/128)],
    b: [ceil(N/128), ceil(K/128)]). Each scale is amax / the format's largest value (448 e4m3, 57344 e5m2) over
    what it covers. dtype torch.float8_e4m3fn (default) or torch.float8_e5m2.
    """
    where = "weft.quantize_fp8"
    if not _torch_tensor(x):
        raise WeftTypeError(f"{where}: x must be a torch tensor")
    torch = _w._ops.torch
    if not x.is_cuda or x.dim() != 2 or not x.is_contiguous():
        raise WeftValueError(f"{where}: x must be a contiguous 2-D CUDA tensor, got {tuple(x.shape)} on {x.device}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise WeftTypeError(f"{where}: x must be bf16 or fp16, got {x.dtype}")
    if scaling not in ("tensor", "rowcol", "block") or operand not in ("a", "b"):
        raise WeftValueError(f"{where}: scaling must be 'tensor', 'rowcol' or 'block' and operand 'a' or 'b', got "
                             f"{scaling!r}, {operand!r}")
    dtype = torch.float8_e4m3fn if dtype is None else dtype
    kind = _fp8_name(torch, dtype, where)
    rows, cols = x.shape
    groups = -(-cols // _BLOCK)
    if scaling == "tensor":
        shape = (1,)
    elif scaling == "rowcol":
        shape = (rows, 1) if operand == "a" else (1, rows)
    else:
        shape = (rows, groups) if operand == "a" else (-(-rows // _BLOCK), groups)
    q = torch.empty((rows, cols), dtype=dtype, device=x.device)
    scales = torch.empty(shape, dtype=torch.float32, device=x.device)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    _weft.quantize_fp8(x.get_device(), x.data_ptr(), "bf16" if x.dtype == torch.bfloat16 else "fp16", q.data_ptr(),
                       kind, scales.data_ptr(), rows, cols, scaling, operand, stream)
    return q, scales
