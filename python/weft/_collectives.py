"""Collectives: all_reduce, all_gather, reduce_scatter, all_to_all, all_to_all_v (any dtype weft supports, torch or
DLPack; all_to_all_v torch only); the rooted broadcast, scatter, gather and reduce (eager)."""
from __future__ import annotations

import math
import sys

from . import _op_table, _weft
from ._args import _OPS, _comm, _dim, _output, _prepare, _torch_tensor
from ._errors import WeftTypeError, WeftValueError
from ._op_table import DTYPES, Tensor, _check, _native, _stream, _world, declare, torch

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_v", "broadcast", "scatter", "gather", "reduce"]


def all_reduce(x, op="sum", out=None, comm=None):
    """Elementwise reduction over ranks (sum, max or min); returns out (new tensor if not given)."""
    if out is None and _torch_tensor(x):
        return _torch_all_reduce(x, op, comm)
    c, s, a = _prepare(x, comm, op)
    out, o = _output(c, s, x, a, a.shape, out)
    _weft.all_reduce(c._c, a.ptr, o.ptr, a.numel, a.dtype, op, s)
    return out


def all_gather(x, dim=0, out=None, comm=None):
    """Concatenates every rank's x along dim (any dim: no extra copies for inner ones)."""
    if out is None and _torch_tensor(x):
        return _torch_all_gather(x, dim, comm)
    c, s, a = _prepare(x, comm)
    d = _dim(dim, len(a.shape))
    shape = list(a.shape)
    shape[d] *= c.world_size
    out, o = _output(c, s, x, a, shape, out)
    rows = math.prod(a.shape[:d])
    cols = math.prod(a.shape[d:])
    _weft.all_gather(c._c, a.ptr, o.ptr, rows, cols, 0 if d == 0 else 1, a.dtype, s)
    return out


def reduce_scatter(x, dim=0, op="sum", out=None, comm=None):
    """Reduces over ranks, then rank r keeps the r-th of world_size equal slices along dim."""
    if out is None and _torch_tensor(x):
        return _torch_reduce_scatter(x, dim, op, comm)
    c, s, a = _prepare(x, comm, op)
    d = _dim(dim, len(a.shape))
    w = c.world_size
    if a.shape[d] % w:
        raise WeftValueError(f"weft: dim {dim} has size {a.shape[d]}, not divisible by the world size {w}")
    shape = list(a.shape)
    shape[d] //= w
    out, o = _output(c, s, x, a, shape, out)
    rows = math.prod(shape[:d])
    cols = math.prod(shape[d:])
    _weft.reduce_scatter(c._c, a.ptr, o.ptr, rows, cols, 0 if d == 0 else 1, a.dtype, op, s)
    return out


def all_to_all(x, out=None, comm=None):
    """Equal splits: x holds world_size blocks; block p goes to rank p, and out block q comes from rank q."""
    if out is None and _torch_tensor(x):
        return _torch_all_to_all(x, comm)
    c, s, a = _prepare(x, comm)
    w = c.world_size
    if a.numel % w:
        raise WeftValueError(f"weft: x has {a.numel} elements, not divisible by the world size {w}")
    out, o = _output(c, s, x, a, a.shape, out)
    _weft.all_to_all(c._c, a.ptr, o.ptr, a.numel // w, a.dtype, s)
    return out


# ---- the torch operators (weft._op_table) of all_reduce, all_gather, reduce_scatter, all_to_all ----------
# Their torch paths (_torch_all_reduce, ...: what the functions above call on torch tensors without out=) check
# with traceable tensor attributes only, then call the operator.


def _flat_shape(shape, d):
    """(rows, cols) of a gather / scatter along d as the C++ ops see it (d = 0: one row)."""
    return math.prod(shape[:d]), math.prod(shape[d:])


@declare("weft::all_reduce")
def _all_reduce(x: Tensor, op: str, comm: int) -> Tensor:
    if _op_table.EMULATE:
        return x * _world(comm) if op == "sum" else x.clone()
    out = torch.empty_like(x)
    _weft.all_reduce(_native(comm), x.data_ptr(), out.data_ptr(), x.numel(), DTYPES[x.dtype], op, _stream(x))
    return out


@_all_reduce.register_fake
def _(x, op, comm):
    return torch.empty_like(x)


def _all_reduce_setup(ctx, inputs, output):
    _, ctx.op, ctx.comm = inputs


def _all_reduce_backward(ctx, grad):
    if ctx.op != "sum":
        raise WeftValueError(f"weft.all_reduce: no gradient for op={ctx.op!r} (only for 'sum')")
    return _all_reduce.op(grad.contiguous(), "sum", ctx.comm), None, None


_all_reduce.register_autograd(_all_reduce_backward, setup_context=_all_reduce_setup)


@declare("weft::all_gather")
def _all_gather(x: Tensor, dim: int, world: int, comm: int) -> Tensor:
    if _op_table.EMULATE:
        return torch.cat([x] * world, dim)
    shape = list(x.shape)
    shape[dim] *= world
    out = x.new_empty(shape)
    rows, cols = _flat_shape(x.shape, dim)
    _weft.all_gather(_native(comm), x.data_ptr(), out.data_ptr(), rows, cols, 0 if dim == 0 else 1,
                     DTYPES[x.dtype], _stream(x))
    return out


@_all_gather.register_fake
def _(x, dim, world, comm):
    shape = list(x.shape)
    shape[dim] *= world
    return x.new_empty(shape)


@declare("weft::reduce_scatter")
def _reduce_scatter(x: Tensor, dim: int, op: str, world: int, comm: int) -> Tensor:
    if _op_table.EMULATE:
        return (x.chunk(world, dim)[0] * (world if op == "sum" else 1)).contiguous()
    shape = list(x.shape)
    shape[dim] //= world
    out = x.new_empty(shape)
    rows, cols = _flat_shape(shape, dim)
    _weft.reduce_scatter(_native(comm), x.data_ptr(), out.data_ptr(), rows, cols, 0 if dim == 0 else 1,
                         DTYPES[x.dtype], op, _stream(x))
    return out


@_reduce_scatter.register_fake
def _(x, dim, op, world, comm):
    shape = list(x.shape)
    shape[dim] //= world
    return x.new_empty(shape)


def _all_gather_setup(ctx, inputs, output):
    _, ctx.dim, ctx.world, ctx.comm = inputs


def _all_gather_backward(ctx, grad):
    return _reduce_scatter.op(grad.contiguous(), ctx.dim, "sum", ctx.world, ctx.comm), None, None, None


def _reduce_scatter_setup(ctx, inputs, output):
    _, ctx.dim, ctx.op, ctx.world, ctx.comm = inputs


def _reduce_scatter_backward(ctx, grad):
    if ctx.op != "sum":
        raise WeftValueError(f"weft.reduce_scatter: no gradient for op={ctx.op!r} (only for 'sum')")
    return _all_gather.op(grad.contiguous(), ctx.dim, ctx.world, ctx.comm), None, None, None, None


_all_gather.register_autograd(_all_gather_backward, setup_context=_all_gather_setup)
_reduce_scatter.register_autograd(_reduce_scatter_backward, setup_context=_reduce_scatter_setup)


@declare("weft::all_to_all")
def _all_to_all(x: Tensor, comm: int) -> Tensor:
    if _op_table.EMULATE:
        return x.clone()
    out = torch.empty_like(x)
    _weft.all_to_all(_native(comm), x.data_ptr(), out.data_ptr(), x.numel() // _world(comm), DTYPES[x.dtype],
                     _stream(x))
    return out


@_all_to_all.register_fake
def _(x, comm):
    return torch.empty_like(x)


def _all_to_all_setup(ctx, inputs, output):
    ctx.comm = inputs[1]


def _all_to_all_backward(ctx, grad):
    # out block q of rank r is rank q's input block r, so the gradient goes back the same way.
    return _all_to_all.op(grad.contiguous(), ctx.comm), None


_all_to_all.register_autograd(_all_to_all_backward, setup_context=_all_to_all_setup)


def _torch_all_reduce(x, op, comm):
    c = _comm(comm)
    if op not in _OPS:
        raise WeftValueError(f"weft: unsupported reduction op {op!r}: use sum, max or min")
    _check(c, x, "x")
    return _all_reduce.op(x, op, c._id)


def _torch_all_gather(x, dim, comm):
    c = _comm(comm)
    _check(c, x, "x")
    return _all_gather.op(x, _dim(dim, x.dim()), c.world_size, c._id)


def _torch_reduce_scatter(x, dim, op, comm):
    c = _comm(comm)
    if op not in _OPS:
        raise WeftValueError(f"weft: unsupported reduction op {op!r}: use sum, max or min")
    _check(c, x, "x")
    d = _dim(dim, x.dim())
    if x.shape[d] % c.world_size:
        raise WeftValueError(f"weft: dim {dim} has size {x.shape[d]}, not divisible by the world size "
                             f"{c.world_size}")
    return _reduce_scatter.op(x, d, op, c.world_size, c._id)


def _torch_all_to_all(x, comm):
    c = _comm(comm)
    _check(c, x, "x")
    if x.numel() % c.world_size:
        raise WeftValueError(f"weft: x has {x.numel()} elements, not divisible by the world size "
                             f"{c.world_size}")
    return _all_to_all.op(x, c._id)


def all_to_all_v(x, send_counts, out_rows, out=None, recv_counts=None, comm=None):
    """Variable splits along dim 0 (torch's all_to_all_single with split sizes; MoE token routing), the sizes
    staying on the GPU (no host synchronisation; CUDA-graph capturable). x's rows are this rank's parts for
    ranks 0..W-1 back to back, send_counts[q] rows for rank q (an int64 CUDA tensor of W). Returns (out,
    recv_counts): out has out_rows rows (the same on every rank) holding the parts from ranks 0..W-1 back to
    back (rows past them untouched), recv_counts (int64, W) their sizes. Counts that do not fit (negative, past
    x, past out_rows) or unequal out_rows are refused on every rank before anything moves (recv_counts zero):
    the next synchronize raises, and the team's later device waits fail (a refusal ends the team, as a
    timeout does). Torch tensors only; eager (not a torch operator)."""
    c, s, a = _prepare(x, comm)
    torch = sys.modules.get("torch")
    if not a.torch:
        raise WeftTypeError("weft.all_to_all_v takes torch tensors (its counts are int64 tensors)")
    w = c.world_size
    if send_counts is None:
        raise WeftValueError("weft: all_to_all_v needs send_counts (an int64 tensor of the world size)")
    for name, t in (("send_counts", send_counts), ("recv_counts", recv_counts)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.numel() != w or not t.is_cuda \
                or t.get_device() != c.device or not t.is_contiguous():
            raise WeftValueError(f"weft: {name} must be a contiguous int64 tensor of {w} elements on cuda:{c.device}")
    if not isinstance(out_rows, int) or out_rows < 0:
        raise WeftValueError(f"weft: out_rows must be an int >= 0, got {out_rows!r}")
    if not a.shape:
        raise WeftValueError("weft: all_to_all_v splits dim 0; x is 0-d")
    row = math.prod(a.shape[1:])
    out, o = _output(c, s, x, a, (out_rows,) + tuple(a.shape[1:]), out)
    if recv_counts is None:
        recv_counts = torch.empty(w, dtype=torch.int64, device=x.device)
    _weft.all_to_all_v(c._c, a.ptr, send_counts.data_ptr(), a.shape[0], o.ptr, recv_counts.data_ptr(), out_rows,
                       row, a.dtype, s)
    return out, recv_counts


# ---- rooted collectives: eager calls (not torch operators: no autograd, no torch.compile tracing) ----------
# root is a rank of the call's team: with comm= a ProcessGroup, a rank of that group (torch's group_src /
# group_dst), not a global rank.
def _root(root, c):
    if not isinstance(root, int) or not 0 <= root < c.world_size:
        raise WeftValueError(f"weft: root must be a rank of the team (0..{c.world_size - 1}), got {root!r}")
    return root


def broadcast(x, root=0, out=None, comm=None):
    """Every rank gets the root's x: returns out (new if not given), x's shape and dtype on every rank (the
    other ranks' x gives the shape only). out=x broadcasts in place."""
    c, s, a = _prepare(x, comm)
    _root(root, c)
    out, o = _output(c, s, x, a, a.shape, out)
    _weft.broadcast(c._c, a.ptr, o.ptr, a.numel, a.dtype, root, s)
    return out


def scatter(x, root=0, out=None, comm=None):
    """Rank p gets block p of the root's x split into world_size equal blocks along dim 0 (every rank passes
    an x of that shape; only the root's data is read); returns out (new if not given)."""
    c, s, a = _prepare(x, comm)
    _root(root, c)
    w = c.world_size
    if not a.shape or a.shape[0] % w:
        raise WeftValueError(f"weft: scatter splits dim 0 into {w} blocks; x has shape {a.shape}")
    shape = (a.shape[0] // w,) + tuple(a.shape[1:])
    out, o = _output(c, s, x, a, shape, out)
    _weft.scatter(c._c, a.ptr, o.ptr, a.numel // w, a.dtype, root, s)
    return out


def gather(x, root=0, out=None, comm=None):
    """The root gets every rank's x stacked along dim 0 (rank q's at block q): returns out at the root (new
    if not given), None on the other ranks."""
    c, s, a = _prepare(x, comm)
    _root(root, c)
    shape = (a.shape[0] * c.world_size if a.shape else c.world_size,) + tuple(a.shape[1:])
    o_ptr = 0
    if c.rank == root:
        out, o = _output(c, s, x, a, shape, out)
        o_ptr = o.ptr
    _weft.gather(c._c, a.ptr, o_ptr, a.numel, a.dtype, root, s)
    return out if c.rank == root else None


def reduce(x, root=0, op="sum", out=None, comm=None):
    """The root gets the elementwise reduction over ranks (sum, max or min) of x: returns out at the root (new
    if not given), None on the other ranks."""
    c, s, a = _prepare(x, comm, op)
    _root(root, c)
    o_ptr = 0
    if c.rank == root:
        out, o = _output(c, s, x, a, a.shape, out)
        o_ptr = o.ptr
    _weft.reduce(c._c, a.ptr, o_ptr, a.numel, a.dtype, op, root, s)
    return out if c.rank == root else None
