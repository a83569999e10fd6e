"""Fused tensor-parallel ops (bf16): all_gather_matmul, matmul_reduce_scatter, matmul_all_reduce."""
from __future__ import annotations

import weft as _w
from . import _weft
from ._args import _arg, _output, _prepare, _torch_tensor
from ._errors import WeftTypeError, WeftValueError

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"]


def _matmul_layout(a_shape, a_dtype, b_shape, b_dtype, b_contiguous, b_strides):
    """(layout, N, K) of A [rows, K] and B: [K, N] contiguous ("kn") or the .t() view of a contiguous [N, K]
    weight ("nk"); both bf16, K and N multiples of 8."""
    for name, shape, dtype in (("a", a_shape, a_dtype), ("b", b_shape, b_dtype)):
        if dtype != "bf16":
            raise WeftTypeError(f"weft: {name} must be bf16 for the matmul ops, got {dtype}")
        if len(shape) != 2:
            raise WeftValueError(f"weft: {name} must be 2-D, got shape {tuple(shape)}")
    k, n = b_shape
    if a_shape[1] != k:
        raise WeftValueError(f"weft: a is {tuple(a_shape)} and b is {tuple(b_shape)}: the inner dimensions differ")
    if b_contiguous:
        layout = "kn"
    elif tuple(b_strides) == (1, k) or (n == 1 and b_strides[0] == 1):
        layout = "nk"  # b = weight.t() of a contiguous [N, K] weight
    else:
        raise WeftValueError("weft: b must be a contiguous [K, N] tensor or the .t() view of a contiguous [N, K] "
                             f"weight (got strides {tuple(b_strides)})")
    if n % 8 or k % 8:
        raise WeftValueError(f"weft: K = {k} and N = {n} must be multiples of 8 (TMA needs 16-byte rows)")
    return layout, n, k


def _matmul_operands(a, b, comm):
    """Checks A [rows, K] and B ([K, N] contiguous, or the .t() view of a contiguous [N, K] weight)."""
    c, s, x = _prepare(a, comm, name="a")
    w = _arg(b, "b", s)
    if w.device != c.device:
        raise WeftValueError(f"weft: b is on cuda:{w.device} but this rank uses cuda:{c.device}")
    layout, n, k = _matmul_layout(x.shape, x.dtype, w.shape, w.dtype, w.contiguous, w.strides)
    return c, s, x, w, layout, n, k


def all_gather_matmul(a, b, out=None, gathered_a=None, comm=None):
    """out [M, N] = all_gather(a, dim 0) @ b, with a [M / world, K] on each rank; also fills gathered_a
    ([M, K]) when given."""
    if out is None and gathered_a is None and _torch_tensor(a):
        return _w._ops.all_gather_matmul(a, b, comm)
    c, s, x, w, layout, n, k = _matmul_operands(a, b, comm)
    m = x.shape[0] * c.world_size
    out, o = _output(c, s, a, x, (m, n), out)
    g = 0
    if gathered_a is not None:
        _, ga = _output(c, s, a, x, (m, k), gathered_a, "gathered_a")
        g = ga.ptr
    _weft.all_gather_matmul(c._c, x.ptr, w.ptr, o.ptr, g, m, n, k, layout, s)
    return out


def _summed_matmul(native_op, a, b, out, comm, scatter):
    """matmul_reduce_scatter / matmul_all_reduce: the [M, N] product summed over ranks, scattered or not."""
    c, s, x, w, layout, n, k = _matmul_operands(a, b, comm)
    m = x.shape[0]
    if scatter and m % c.world_size:
        raise WeftValueError(f"weft: a has {m} rows, not divisible by the world size {c.world_size}")
    out, o = _output(c, s, a, x, (m // c.world_size if scatter else m, n), out)
    native_op(c._c, x.ptr, w.ptr, o.ptr, m, n, k, layout, s)
    return out


def matmul_reduce_scatter(a, b, out=None, comm=None):
    """The [M, N] product a @ b summed over ranks; this rank gets rows rank * M / world .. (rank + 1) * M / world."""
    if out is None and _torch_tensor(a):
        return _w._ops.matmul_reduce_scatter(a, b, comm)
    return _summed_matmul(_weft.matmul_reduce_scatter, a, b, out, comm, scatter=True)


def matmul_all_reduce(a, b, out=None, comm=None):
    """The [M, N] product a @ b summed over ranks, on every rank. Fastest with out= a symmetric tensor
    (torch.from_dlpack(comm.empty((M, N), "bf16")), the same on every rank): the kernel then stores each summed
    tile into every rank's out while the GEMM runs; any other out (or none) takes the staged kernel and a local
    copy of [M, N] at the end (2 x H200, M = 2048, N = 8192: 250 against 277 us)."""
    if out is None and _torch_tensor(a):
        return _w._ops.matmul_all_reduce(a, b, comm)
    return _summed_matmul(_weft.matmul_all_reduce, a, b, out, comm, scatter=False)
