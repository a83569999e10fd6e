"""Collectives: all_reduce, all_gather, reduce_scatter, all_to_all (any dtype weft supports, torch or DLPack)."""
from __future__ import annotations

import math

import weft as _w
from . import _weft
from ._args import _dim, _output, _prepare, _torch_tensor
from ._errors import WeftValueError


def all_reduce(x, op="sum", out=None, comm=None):
    """Elementwise reduction over ranks (sum, max or min); returns out (new tensor if not given)."""
    if out is None and _torch_tensor(x):
        return _w._ops.all_reduce(x, op, comm)
    c, s, a = _prepare(x, comm, op)
    out, o = _output(c, s, x, a, a.shape, out)
    _weft.all_reduce(c._c, a.ptr, o.ptr, a.numel, a.dtype, op, s)
    return out


def all_gather(x, dim=0, out=None, comm=None):
    """Concatenates every rank's x along dim (any dim: no extra copies for inner ones)."""
    if out is None and _torch_tensor(x):
        return _w._ops.all_gather(x, dim, comm)
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
        return _w._ops.reduce_scatter(x, dim, op, comm)
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
        return _w._ops.all_to_all(x, comm)
    c, s, a = _prepare(x, comm)
    w = c.world_size
    if a.numel % w:
        raise WeftValueError(f"weft: x has {a.numel} elements, not divisible by the world size {w}")
    out, o = _output(c, s, x, a, a.shape, out)
    _weft.all_to_all(c._c, a.ptr, o.ptr, a.numel // w, a.dtype, s)
    return out

