"""Fused tensor-parallel ops (bf16): all_gather_matmul, matmul_reduce_scatter, matmul_all_reduce."""
from __future__ import annotations

from . import _op_table, _weft
from ._args import _arg, _comm, _output, _prepare, _torch_tensor
from ._collectives import _all_gather, _all_reduce
from ._errors import WeftTypeError, WeftValueError
from ._op_table import DTYPES, Tensor, _check, _native, _stream, _world, declare, torch

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
        return _torch_all_gather_matmul(a, b, comm)
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
        return _torch_matmul_reduce_scatter(a, b, comm)
    return _summed_matmul(_weft.matmul_reduce_scatter, a, b, out, comm, scatter=True)


def matmul_all_reduce(a, b, out=None, comm=None):
    """The [M, N] product a @ b summed over ranks, on every rank. Fastest with out= a symmetric tensor
    (torch.from_dlpack(comm.empty((M, N), "bf16")), the same on every rank): the kernel then stores each summed
    tile into every rank's out while the GEMM runs; any other out (or none) takes the staged kernel and a local
    copy of [M, N] at the end (2 x H200, M = 2048, N = 8192: 250 against 277 us)."""
    if out is None and _torch_tensor(a):
        return _torch_matmul_all_reduce(a, b, comm)
    return _summed_matmul(_weft.matmul_all_reduce, a, b, out, comm, scatter=False)


# ---- the torch operators (weft._op_table) -------------------------------------------------------------------
# Their torch paths (_torch_all_gather_matmul, ...: what the functions above call on torch tensors without out=)
# check with traceable tensor attributes only, then call the operator.


def _layout(a, b):
    """(layout, n, k) of torch tensors A [rows, K] and B [K, N] (_matmul_layout's checks on tensor attributes)."""
    return _matmul_layout(tuple(a.shape), DTYPES.get(a.dtype, str(a.dtype)), tuple(b.shape),
                          DTYPES.get(b.dtype, str(b.dtype)), b.is_contiguous(), tuple(b.stride()))


@declare("weft::all_gather_matmul")
def _all_gather_matmul(a: Tensor, b: Tensor, gather: bool, world: int, comm: int) -> tuple[Tensor, Tensor]:
    if _op_table.EMULATE:
        gathered = torch.cat([a] * world)
        return gathered @ b, gathered if gather else a.new_empty((0,))
    layout, n, k = _layout(a, b)
    m = a.shape[0] * world
    out = a.new_empty((m, n))
    gathered = a.new_empty((m, k) if gather else (0,))
    _weft.all_gather_matmul(_native(comm), a.data_ptr(), b.data_ptr(), out.data_ptr(),
                            gathered.data_ptr() if gather else 0, m, n, k, layout, _stream(a))
    return out, gathered


@_all_gather_matmul.register_fake
def _(a, b, gather, world, comm):
    m, k = a.shape[0] * world, a.shape[1]
    return a.new_empty((m, b.shape[1])), a.new_empty((m, k) if gather else (0,))


@declare("weft::matmul_reduce_scatter")
def _matmul_reduce_scatter(a: Tensor, b: Tensor, world: int, comm: int) -> Tensor:
    if _op_table.EMULATE:
        return (a @ b).chunk(world)[0] * world
    layout, n, k = _layout(a, b)
    m = a.shape[0]
    out = a.new_empty((m // world, n))
    _weft.matmul_reduce_scatter(_native(comm), a.data_ptr(), b.data_ptr(), out.data_ptr(), m, n, k, layout,
                                _stream(a))
    return out


@_matmul_reduce_scatter.register_fake
def _(a, b, world, comm):
    return a.new_empty((a.shape[0] // world, b.shape[1]))


@declare("weft::matmul_all_reduce")
def _matmul_all_reduce(a: Tensor, b: Tensor, comm: int) -> Tensor:
    if _op_table.EMULATE:
        return (a @ b) * _world(comm)
    layout, n, k = _layout(a, b)
    out = a.new_empty((a.shape[0], n))
    _weft.matmul_all_reduce(_native(comm), a.data_ptr(), b.data_ptr(), out.data_ptr(), a.shape[0], n, k, layout,
                            _stream(a))
    return out


@_matmul_all_reduce.register_fake
def _(a, b, comm):
    return a.new_empty((a.shape[0], b.shape[1]))


# B^T of an accepted B is accepted too: [K, N] contiguous <-> the .t() view of a contiguous weight.
def _all_gather_matmul_setup(ctx, inputs, output):
    a, b, gather, ctx.world, ctx.comm = inputs
    ctx.save_for_backward(b, output[1] if gather else None)


def _all_gather_matmul_backward(ctx, grad, _grad_gathered):
    b, gathered = ctx.saved_tensors
    grad = grad.contiguous()
    db = gathered.t() @ grad if ctx.needs_input_grad[1] else None  # torch's work before weft's (Team.run)
    da = _matmul_reduce_scatter.op(grad, b.t(), ctx.world, ctx.comm) if ctx.needs_input_grad[0] else None
    return da, db, None, None, None


def _matmul_reduce_scatter_setup(ctx, inputs, output):
    a, b, ctx.world, ctx.comm = inputs
    ctx.save_for_backward(a, b)


def _matmul_reduce_scatter_backward(ctx, grad):
    a, b = ctx.saved_tensors
    grad = grad.contiguous()
    need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    da = db = None
    if need_a:
        da, gathered = _all_gather_matmul.op(grad, b.t(), need_b, ctx.world, ctx.comm)
    elif need_b:
        gathered = _all_gather.op(grad, 0, ctx.world, ctx.comm)
    if need_b:
        db = a.t() @ gathered
    return da, db, None, None


def _matmul_all_reduce_setup(ctx, inputs, output):
    a, b, ctx.comm = inputs
    ctx.save_for_backward(a, b)


def _matmul_all_reduce_backward(ctx, grad):
    a, b = ctx.saved_tensors
    summed = _all_reduce.op(grad.contiguous(), "sum", ctx.comm)
    da = summed @ b.t() if ctx.needs_input_grad[0] else None
    db = a.t() @ summed if ctx.needs_input_grad[1] else None
    return da, db, None


_all_gather_matmul.register_autograd(_all_gather_matmul_backward, setup_context=_all_gather_matmul_setup)
_matmul_reduce_scatter.register_autograd(_matmul_reduce_scatter_backward, setup_context=_matmul_reduce_scatter_setup)
_matmul_all_reduce.register_autograd(_matmul_all_reduce_backward, setup_context=_matmul_all_reduce_setup)


def _torch_matmul_operands(a, b, comm):
    """The communicator of a matmul on torch tensors, after the checks of A [rows, K] (bf16, contiguous) and B."""
    c = _comm(comm)
    _check(c, a, "a", (torch.bfloat16,))
    if not isinstance(b, Tensor):  # b may be a transposed view: _layout checks its strides and dtype
        raise WeftTypeError(f"weft: b must be a torch tensor, got {type(b).__name__}")
    if not b.is_cuda or b.device.index != c.device:
        raise WeftValueError(f"weft: b is on {b.device} but this rank uses cuda:{c.device}")
    _layout(a, b)
    return c


def _torch_all_gather_matmul(a, b, comm):
    c = _torch_matmul_operands(a, b, comm)
    gather = torch.is_grad_enabled() and b.requires_grad
    return _all_gather_matmul.op(a, b, gather, c.world_size, c._id)[0]


def _torch_matmul_reduce_scatter(a, b, comm):
    c = _torch_matmul_operands(a, b, comm)
    if a.shape[0] % c.world_size:
        raise WeftValueError(f"weft: a has {a.shape[0]} rows, not divisible by the world size {c.world_size}")
    return _matmul_reduce_scatter.op(a, b, c.world_size, c._id)


def _torch_matmul_all_reduce(a, b, comm):
    c = _torch_matmul_operands(a, b, comm)
    return _matmul_all_reduce.op(a, b, c._id)
