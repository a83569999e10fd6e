"""weft's ops as torch operators (torch.library): what weft's functions call on torch tensors.

Each op is a `torch.ops.weft.*` operator with a fake (meta) implementation, so torch.compile traces it
without a graph break and CUDA graphs capture it, and with autograd:

    all_gather (dim d)        <->  reduce_scatter (sum, dim d)
    all_reduce (sum)          ->   all_reduce of the gradient
    all_to_all                ->   all_to_all of the gradient
    all_gather_matmul         ->   dA = matmul_reduce_scatter(dOut, B^T), dB = gathered(A)^T dOut
    matmul_reduce_scatter     ->   dA = all_gather_matmul(dOut, B^T),    dB = A^T all_gather(dOut)
    matmul_all_reduce         ->   dA = all_reduce(dOut) B^T,             dB = A^T all_reduce(dOut)

Gradients are those of the sum of every rank's loss (as torch.distributed.nn.functional's): a value that
all_reduce replicates and every rank then counts in its loss gets its gradient once per rank.

The functions here check their arguments with traceable tensor attributes only (no data pointers, no
streams), then call the operator; the operators' implementations launch on torch's current stream.
A communicator crosses the operator boundary as its integer id (weft's registry of communicators).
The id is only read by the implementations (at run time): under torch.compile it may be symbolic (one
graph serves every rank of a virtual team), so the fake implementations take shapes from a `world` argument.
Imported by weft once torch is imported; weft itself never imports torch.
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
from torch import Tensor

import weft as _w
from . import _weft
from ._args import _OPS, _comm, _dim
from ._tensor_parallel import _matmul_layout

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# Team.warmup's emulation: the operators compute with torch on this rank alone, as if every rank held this
# rank's input (right shapes and dtypes, no peers, no weft kernel), so that the torch work around them
# loads its kernels and libraries while no weft kernel waits for a peer. Set by `with emulated():` only; every
# op reads it when it runs.
EMULATE = False


@contextlib.contextmanager
def emulated():
    """The ops emulated (EMULATE) inside the with block; the previous setting is back after it, error or not."""
    global EMULATE
    before, EMULATE = EMULATE, True
    try:
        yield
    finally:
        EMULATE = before


# Eager calls skip torch's operator dispatch. A call through a custom op costs 30-60 us of host time more than
# its implementation (torch.library's schema handling, the autograd and Python dispatch keys): the whole cost
# of a decode-sized kernel. Where nothing needs the operator (not tracing or compiling, no dispatch or
# function mode, no functorch transform, no tensor subclass, no CPU / meta tensor, nothing to record for
# autograd) the implementation runs directly: the same code, launches and result as through the operator.
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None)
_function_modes = getattr(torch._C, "_len_torch_function_stack", None)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", None)
_jit_tracing = getattr(torch._C, "_get_tracing_state", None)
_profiling = getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", None)
_FAST_PATH = None not in (_dispatch_modes, _function_modes, _functorch_active, _jit_tracing)
_PLAIN = (Tensor, torch.nn.Parameter)  # (Parameter's __torch_function__ is torch's own)


def _plain_tensor(t, grad):
    return type(t) in _PLAIN and t.is_cuda and not (grad and t.requires_grad)


def _plain_eager(args):
    """True where calling an operator's implementation directly does what the operator call would (not under
    torch.jit.trace, which records operators, nor while the profiler records them by name)."""
    if not _FAST_PATH or torch.compiler.is_compiling() or _dispatch_modes() or _function_modes() \
            or _functorch_active() or _jit_tracing() is not None or (_profiling is not None and _profiling()):
        return False
    grad = torch.is_grad_enabled()
    for a in args:
        if isinstance(a, Tensor):
            if not _plain_tensor(a, grad):
                return False
        elif isinstance(a, (list, tuple)):
            if not all(_plain_tensor(t, grad) for t in a if isinstance(t, Tensor)):
                return False
    return True


class _Operator:
    """A torch operator (torch.library.custom_op) called as one: eagerly through its implementation where
    _plain_eager allows, else through torch. register_fake / register_autograd / ... are the operator's."""

    def __init__(self, op, impl):
        self._op, self._impl = op, impl

    def __getattr__(self, name):
        return getattr(self._op, name)

    def __call__(self, *args, **kwargs):
        if _plain_eager(args) and (not kwargs or _plain_eager(tuple(kwargs.values()))):
            return self._impl(*args, **kwargs)
        return self._op(*args, **kwargs)


def _operator(name):
    """@_operator("weft::x") on an implementation: torch.library.custom_op(name, mutates_args=()) with the eager
    fast path (every weft operator is functional: it writes only the tensors it returns)."""
    def make(impl):
        return _Operator(torch.library.custom_op(name, mutates_args=())(impl), impl)
    return make


_ANY = (torch.bfloat16, torch.float16, torch.float32)
_HALF = (torch.bfloat16, torch.float16)


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream(x):
    """torch's current stream on x's GPU, as an int (without building a torch.cuda.Stream: every op call)."""
    if _raw_stream is not None:
        return _raw_stream(x.device.index)
    return torch.cuda.current_stream(x.device).cuda_stream


def _native(comm_id):
    return _w._communicators[comm_id]._c


def _world(comm_id):
    return _w._communicators[comm_id].world_size


def _check(c, x, name, dtypes=_ANY, where="weft"):
    """x: a contiguous CUDA tensor on c's GPU of one of `dtypes` (traceable attributes only)."""
    if not isinstance(x, Tensor):
        raise _w.WeftTypeError(f"{where}: {name} must be a torch tensor, got {type(x).__name__}")
    if not x.is_cuda:
        raise _w.WeftValueError(f"{where}: {name} must be a CUDA tensor, got one on {x.device}")
    if x.device.index != c.device:
        raise _w.WeftValueError(f"{where}: {name} is on {x.device} but this rank uses cuda:{c.device}")
    if x.dtype not in dtypes:
        names = ", ".join(DTYPES[d] for d in dtypes)
        raise _w.WeftTypeError(f"{where}: {name} has an unsupported dtype {x.dtype}: use {names}")
    if not x.is_contiguous():
        raise _w.WeftValueError(f"{where}: {name} must be contiguous (call .contiguous() first)")


def _flat_shape(shape, d):
    """(rows, cols) of a gather / scatter along d as the C++ ops see it (d = 0: one row)."""
    return math.prod(shape[:d]), math.prod(shape[d:])


# ---- collectives --------------------------------------------------------------------------------------


@_operator("weft::all_reduce")
def _all_reduce(x: Tensor, op: str, comm: int) -> Tensor:
    if EMULATE:
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
        raise _w.WeftValueError(f"weft.all_reduce: no gradient for op={ctx.op!r} (only for 'sum')")
    return _all_reduce(grad.contiguous(), "sum", ctx.comm), None, None


_all_reduce.register_autograd(_all_reduce_backward, setup_context=_all_reduce_setup)


@_operator("weft::all_gather")
def _all_gather(x: Tensor, dim: int, world: int, comm: int) -> Tensor:
    if EMULATE:
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


@_operator("weft::reduce_scatter")
def _reduce_scatter(x: Tensor, dim: int, op: str, world: int, comm: int) -> Tensor:
    if EMULATE:
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
    return _reduce_scatter(grad.contiguous(), ctx.dim, "sum", ctx.world, ctx.comm), None, None, None


def _reduce_scatter_setup(ctx, inputs, output):
    _, ctx.dim, ctx.op, ctx.world, ctx.comm = inputs


def _reduce_scatter_backward(ctx, grad):
    if ctx.op != "sum":
        raise _w.WeftValueError(f"weft.reduce_scatter: no gradient for op={ctx.op!r} (only for 'sum')")
    return _all_gather(grad.contiguous(), ctx.dim, ctx.world, ctx.comm), None, None, None, None


_all_gather.register_autograd(_all_gather_backward, setup_context=_all_gather_setup)
_reduce_scatter.register_autograd(_reduce_scatter_backward, setup_context=_reduce_scatter_setup)


@_operator("weft::all_to_all")
def _all_to_all(x: Tensor, comm: int) -> Tensor:
    if EMULATE:
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
    return _all_to_all(grad.contiguous(), ctx.comm), None


_all_to_all.register_autograd(_all_to_all_backward, setup_context=_all_to_all_setup)


def all_reduce(x, op, comm):
    c = _comm(comm)
    if op not in _OPS:
        raise _w.WeftValueError(f"weft: unsupported reduction op {op!r}: use sum, max or min")
    _check(c, x, "x")
    return _all_reduce(x, op, c._id)


def all_gather(x, dim, comm):
    c = _comm(comm)
    _check(c, x, "x")
    return _all_gather(x, _dim(dim, x.dim()), c.world_size, c._id)


def reduce_scatter(x, dim, op, comm):
    c = _comm(comm)
    if op not in _OPS:
        raise _w.WeftValueError(f"weft: unsupported reduction op {op!r}: use sum, max or min")
    _check(c, x, "x")
    d = _dim(dim, x.dim())
    if x.shape[d] % c.world_size:
        raise _w.WeftValueError(f"weft: dim {dim} has size {x.shape[d]}, not divisible by the world size "
                                f"{c.world_size}")
    return _reduce_scatter(x, d, op, c.world_size, c._id)


def all_to_all(x, comm):
    c = _comm(comm)
    _check(c, x, "x")
    if x.numel() % c.world_size:
        raise _w.WeftValueError(f"weft: x has {x.numel()} elements, not divisible by the world size "
                                f"{c.world_size}")
    return _all_to_all(x, c._id)


# ---- fused tensor-parallel matmuls (bf16) ---------------------------------------------------------------


def _layout(a, b):
    """(layout, n, k) of A [rows, K] and B [K, N] (_tensor_parallel._matmul_layout's checks on tensor attributes)."""
    return _matmul_layout(tuple(a.shape), DTYPES.get(a.dtype, str(a.dtype)), tuple(b.shape),
                             DTYPES.get(b.dtype, str(b.dtype)), b.is_contiguous(), tuple(b.stride()))


@_operator("weft::all_gather_matmul")
def _all_gather_matmul(a: Tensor, b: Tensor, gather: bool, world: int, comm: int) -> tuple[Tensor, Tensor]:
    if EMULATE:
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


@_operator("weft::matmul_reduce_scatter")
def _matmul_reduce_scatter(a: Tensor, b: Tensor, world: int, comm: int) -> Tensor:
    if EMULATE:
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


@_operator("weft::matmul_all_reduce")
def _matmul_all_reduce(a: Tensor, b: Tensor, comm: int) -> Tensor:
    if EMULATE:
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
    da = _matmul_reduce_scatter(grad, b.t(), ctx.world, ctx.comm) if ctx.needs_input_grad[0] else None
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
        da, gathered = _all_gather_matmul(grad, b.t(), need_b, ctx.world, ctx.comm)
    elif need_b:
        gathered = _all_gather(grad, 0, ctx.world, ctx.comm)
    if need_b:
        db = a.t() @ gathered
    return da, db, None, None


def _matmul_all_reduce_setup(ctx, inputs, output):
    a, b, ctx.comm = inputs
    ctx.save_for_backward(a, b)


def _matmul_all_reduce_backward(ctx, grad):
    a, b = ctx.saved_tensors
    summed = _all_reduce(grad.contiguous(), "sum", ctx.comm)
    da = summed @ b.t() if ctx.needs_input_grad[0] else None
    db = a.t() @ summed if ctx.needs_input_grad[1] else None
    return da, db, None


_all_gather_matmul.register_autograd(_all_gather_matmul_backward, setup_context=_all_gather_matmul_setup)
_matmul_reduce_scatter.register_autograd(_matmul_reduce_scatter_backward, setup_context=_matmul_reduce_scatter_setup)
_matmul_all_reduce.register_autograd(_matmul_all_reduce_backward, setup_context=_matmul_all_reduce_setup)


def _matmul_operands(a, b, comm):
    c = _comm(comm)
    _check(c, a, "a", (torch.bfloat16,))
    if not isinstance(b, Tensor):  # b may be a transposed view: _layout checks its strides and dtype
        raise _w.WeftTypeError(f"weft: b must be a torch tensor, got {type(b).__name__}")
    if not b.is_cuda or b.device.index != c.device:
        raise _w.WeftValueError(f"weft: b is on {b.device} but this rank uses cuda:{c.device}")
    _layout(a, b)
    return c


def all_gather_matmul(a, b, comm):
    c = _matmul_operands(a, b, comm)
    gather = torch.is_grad_enabled() and b.requires_grad
    return _all_gather_matmul(a, b, gather, c.world_size, c._id)[0]


def matmul_reduce_scatter(a, b, comm):
    c = _matmul_operands(a, b, comm)
    if a.shape[0] % c.world_size:
        raise _w.WeftValueError(f"weft: a has {a.shape[0]} rows, not divisible by the world size {c.world_size}")
    return _matmul_reduce_scatter(a, b, c.world_size, c._id)


def matmul_all_reduce(a, b, comm):
    c = _matmul_operands(a, b, comm)
    return _matmul_all_reduce(a, b, c._id)


# ---- flash attention (one GPU) ----------------------------------------------------------------------------


def _attention_call(q, k, cu_q, cu_k, max_q, max_k):
    """(shape, lse shape, segments) of a dense [batch, seq, heads, dim] call (cu_q None) or a packed one."""
    if cu_q is None:
        shape = (q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3])
        return shape, (q.shape[0], q.shape[2], q.shape[1]), ()
    shape = (cu_q.shape[0] - 1, max_q, max_k, q.shape[1], k.shape[1], q.shape[2])
    segments = (cu_q.data_ptr(), cu_q.data_ptr() + 4, cu_k.data_ptr(), cu_k.data_ptr() + 4, q.shape[0], k.shape[0])
    return shape, (q.shape[1], q.shape[0]), segments


def _lse_shape(q, cu_q):
    return (q.shape[0], q.shape[2], q.shape[1]) if cu_q is None else (q.shape[1], q.shape[0])


@_operator("weft::flash_attention")
def _flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, cu_seqlens_q: Optional[Tensor],
                     cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
                     deterministic: bool) -> tuple[Tensor, Tensor]:
    shape, lse_shape, segments = _attention_call(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    out = torch.empty_like(q)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    _weft.flash_attention_forward(q.get_device(), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                  lse.data_ptr(), shape, causal, scale, _stream(q), segments, (), DTYPES[q.dtype])
    return out, lse


@_flash_attention.register_fake
def _(q, k, v, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, deterministic):
    return torch.empty_like(q), q.new_empty(_lse_shape(q, cu_seqlens_q), dtype=torch.float32)


@_operator("weft::flash_attention_backward")
def _flash_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                              causal: bool, scale: float, cu_seqlens_q: Optional[Tensor],
                              cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
                              deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    shape, _, segments = _attention_call(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    nbytes = _weft.flash_attention_backward_workspace_bytes(shape, segments, deterministic)
    ws = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=q.device)
    _weft.flash_attention_backward(q.get_device(), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                   dout.data_ptr(), lse.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
                                   ws.data_ptr(), nbytes, shape, causal, scale, _stream(q), segments,
                                   DTYPES[q.dtype], deterministic)
    return dq, dk, dv


@_flash_attention_backward.register_fake
def _(dout, q, k, v, out, lse, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _flash_attention_setup(ctx, inputs, output):
    q, k, v, causal, scale, cu_q, cu_k, max_q, max_k, deterministic = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_q, cu_k)
    ctx.args = (causal, scale, max_q, max_k, deterministic)


def _flash_attention_backward_fn(ctx, dout, _dlse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    causal, scale, max_q, max_k, deterministic = ctx.args
    dq, dk, dv = _flash_attention_backward(dout.contiguous().to(q.dtype), q, k, v, out, lse, causal, scale, cu_q,
                                           cu_k, max_q, max_k, deterministic)
    return dq, dk, dv, None, None, None, None, None, None, None


_flash_attention.register_autograd(_flash_attention_backward_fn, setup_context=_flash_attention_setup)


def flash_attention(q, k, v, causal, scale, packed, deterministic):
    """packed: None, or (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k). Checked by the caller."""
    cu_q, cu_k, max_q, max_k = packed if packed is not None else (None, None, 0, 0)
    out, lse = _flash_attention(q.contiguous(), k.contiguous(), v.contiguous(), causal, scale, cu_q, cu_k, max_q,
                                max_k, deterministic)
    return out, lse.detach()


# ---- grouped GEMM (one GPU) -------------------------------------------------------------------------------
# b is passed as stored: [E, N, K] (b_nk: nn.Linear weights) or [E, K, N]. activation "swiglu": b's columns
# are gate / up in blocks of 128 (swiglu_interleave) and the output has N / 2 columns.


@_operator("weft::grouped_mm")
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
        raise _w.WeftValueError("weft.grouped_mm: no gradient over a low-latency dispatch's groups (group_rows): "
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
        h = _grouped_mm(a, b, group_end, ctx.b_nk, torch.float32, ctx.zero_unused_rows, "")
        g = _swiglu_grad(h, grad).to(a.dtype).contiguous()
    else:
        g = grad.to(a.dtype).contiguous()
    da = db = None
    if ctx.needs_input_grad[0]:  # dA = dC B_e^T: the same stored B read the other way round
        da = _grouped_mm(g, b, group_end, not ctx.b_nk, a.dtype, ctx.zero_unused_rows, "")
    if ctx.needs_input_grad[1]:
        dkn = _grouped_weight_grad(a, g, group_end).to(b.dtype)
        db = dkn.transpose(1, 2).contiguous() if ctx.b_nk else dkn
    return da, db, None, None, None, None, None, None


_grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def grouped_mm(a, b, group_end, b_nk, out_dtype, zero_unused_rows, activation="", group_rows=None):
    """Arguments checked by the caller; b as stored (see above)."""
    return _grouped_mm(a, b, group_end, b_nk, out_dtype, zero_unused_rows, activation, group_rows)


# ---- sequence-parallel attention (a team) ----------------------------------------------------------------


def _context_rows_check(q, method, docs, causal, comm):
    c = _w._communicators[comm]
    rows = _weft.context_attention_local_rows(c.world_size, c.rank, list(docs), causal,
                                              method.endswith("/contiguous"))
    if q.shape[0] != rows:
        raise _w.WeftValueError(f"weft.context_attention: rank {c.rank} of {c.world_size} holds {rows} rows of "
                                f"that layout, q has {q.shape[0]} (pass seq_len= when the global length is not "
                                "local_seq x world)")


@_operator("weft::context_attention")
def _context_attention(q: Tensor, k: Tensor, v: Tensor, method: str, docs: list[int], causal: bool, scale: float,
                       comm: int) -> tuple[Tensor, Tensor]:
    _context_rows_check(q, method, docs, causal, comm)
    if EMULATE:
        return torch.zeros_like(q), q.new_zeros((q.shape[1], q.shape[0]), dtype=torch.float32)
    native = _native(comm)
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty((heads, q.shape[0]), dtype=torch.float32, device=q.device)
    nbytes = _weft.context_attention_workspace_bytes(method, native.world_size, docs, causal, heads, kv_heads, dim,
                                                     False)
    ws = torch.empty(max(nbytes, 256), dtype=torch.uint8, device=q.device)
    _weft.context_attention_forward(native, method, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                    lse.data_ptr(), docs, heads, kv_heads, dim, ws.data_ptr(), nbytes,
                                    DTYPES[q.dtype], _stream(q), causal, scale)
    return out, lse


@_context_attention.register_fake
def _(q, k, v, method, docs, causal, scale, comm):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@_operator("weft::context_attention_backward")
def _context_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                method: str, docs: list[int], causal: bool, scale: float,
                                comm: int) -> tuple[Tensor, Tensor, Tensor]:
    if EMULATE:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    native = _native(comm)
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    nbytes = _weft.context_attention_workspace_bytes(method, native.world_size, docs, causal, heads, kv_heads, dim,
                                                     True)
    ws = torch.empty(max(nbytes, 256), dtype=torch.uint8, device=q.device)
    _weft.context_attention_backward(native, method, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                     dout.data_ptr(), lse.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
                                     docs, heads, kv_heads, dim, ws.data_ptr(), nbytes, DTYPES[q.dtype], _stream(q),
                                     causal, scale)
    return dq, dk, dv


@_context_attention_backward.register_fake
def _(dout, q, k, v, out, lse, method, docs, causal, scale, comm):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _context_attention_setup(ctx, inputs, output):
    q, k, v, *ctx.args = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1])


def _context_attention_backward_fn(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _context_attention_backward(dout.contiguous().to(q.dtype), q, k, v, out, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None, None


_context_attention.register_autograd(_context_attention_backward_fn, setup_context=_context_attention_setup)


def context_attention(q, k, v, method, docs, causal, scale, comm):
    """q, k, v [rows, heads, dim] (checked by the caller); returns (out, lse), lse not differentiable."""
    out, lse = _context_attention(q.contiguous(), k.contiguous(), v.contiguous(), method, list(docs), causal,
                                  scale, comm._id)
    return out, lse.detach()


# ---- expert parallelism (MoE) ------------------------------------------------------------------------------
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
    """What EMULATE's dispatch returns: zero rows, empty groups, every slot dropped."""
    tokens, top_k = shape[0], shape[4]
    slots = torch.full((tokens, top_k), -1, dtype=torch.int32, device=x.device)
    ends = x.new_zeros((shape[3] // world,), dtype=torch.int32)
    return x.new_zeros((_moe_capacity(shape, world), shape[2])), ends, slots, slots.clone()


@_operator("weft::moe_dispatch")
def _moe_dispatch(x: Tensor, experts: Tensor, shape: list[int], world: int,
                  comm: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    if EMULATE:
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


@_operator("weft::moe_combine")
def _moe_combine(expert_out: Tensor, row_of: Tensor, kept: Tensor, weights: Tensor, shape: list[int],
                 comm: int, group_rows: Tensor) -> Tensor:
    out = expert_out.new_empty((shape[0], shape[2]))
    if EMULATE:
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
        raise _w.WeftValueError("weft.moe_dispatch: the low-latency dispatch has no backward: run it under "
                                "torch.no_grad() (inference)")
    ones = torch.ones((ctx.shape[0], ctx.shape[4]), dtype=torch.float32, device=grad_rows.device)
    none = row_of.new_empty((0,))
    return _moe_combine(grad_rows.contiguous(), row_of, kept, ones, ctx.shape, ctx.comm, none), None, None, None, None


_moe_dispatch.register_autograd(_moe_dispatch_backward, setup_context=_moe_dispatch_setup)


@_operator("weft::moe_combine_backward")
def _moe_combine_backward(dout: Tensor, expert_out: Tensor, row_of: Tensor, kept: Tensor, weights: Tensor,
                          shape: list[int], comm: int) -> tuple[Tensor, Tensor]:
    tokens, top_k = shape[0], shape[4]
    if EMULATE:
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
        raise _w.WeftValueError("weft.moe_combine: no gradient through a low-latency dispatch's combine: run it "
                                "under torch.no_grad() (inference)")
    # The team's combine area is overwritten by the next combine: outputs written there are kept as a copy
    # (under torch.compile, where pointers are not known, always).
    if torch.compiler.is_compiling():
        expert_out = expert_out.clone()
    elif not EMULATE:
        area = _weft.moe_combine_input(_native(comm), tuple(shape), DTYPES[expert_out.dtype])
        if expert_out.data_ptr() == area.data_ptr:
            expert_out = expert_out.clone()
    ctx.save_for_backward(expert_out, row_of, kept, weights)
    ctx.shape, ctx.comm = shape, comm


def _moe_combine_backward_fn(ctx, grad):
    expert_out, row_of, kept, weights = ctx.saved_tensors
    d_out, d_weights = _moe_combine_backward(grad.to(expert_out.dtype).contiguous(), expert_out, row_of, kept,
                                             weights, ctx.shape, ctx.comm)
    return d_out, None, None, d_weights, None, None, None


_moe_combine.register_autograd(_moe_combine_backward_fn, setup_context=_moe_combine_setup)


# The second expert GEMM fused with the combine (weft::moe_grouped_gemm_combine), on the rows of the team's
# last dispatch. Its backward computes the GEMM's output again (one more GEMM), then the combine's backward
# and the GEMM's.
@_operator("weft::moe_grouped_mm_combine")
def _moe_grouped_mm_combine(a: Tensor, b: Tensor, b_nk: bool, group_end: Tensor, row_of: Tensor, kept: Tensor,
                            weights: Tensor, shape: list[int], comm: int) -> Tensor:
    out = a.new_empty((shape[0], shape[2]))
    if EMULATE:
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
    y = _grouped_mm(a, b, group_end, ctx.b_nk, a.dtype, False, "")
    d_y, d_weights = _moe_combine_backward(grad.to(a.dtype).contiguous(), y, row_of, kept, weights, ctx.shape,
                                           ctx.comm)
    da = _grouped_mm(d_y, b, group_end, not ctx.b_nk, a.dtype, False, "")
    dkn = _grouped_weight_grad(a, d_y, group_end).to(b.dtype)
    db = dkn.transpose(1, 2).contiguous() if ctx.b_nk else dkn
    return da, db, None, None, None, None, d_weights, None, None


_moe_grouped_mm_combine.register_autograd(_moe_grouped_mm_combine_backward,
                                          setup_context=_moe_grouped_mm_combine_setup)


def moe_grouped_mm_combine(a, b, b_nk, group_end, row_of, kept, weights, shape, comm):
    """Arguments checked by the caller; b as stored."""
    return _moe_grouped_mm_combine(a, b, b_nk, group_end, row_of, kept, weights, list(shape), comm._id)


def moe_dispatch(x, ids, shape, comm, exact=False):
    """x, ids (int32, contiguous) checked by the caller; returns (rows, group_end, row_of, kept, counts,
    group_rows: the low-latency dispatch's rows per group, else an empty tensor). exact:
    the counts are read back (a synchronisation) as (rows per local expert, group ends, rows in use) and rows
    is cut to the rows in use; else counts is None. Under autograd rows is a copy of the team's dispatch area
    (which the next dispatch overwrites), since what consumes it (e.g. grouped_mm, for its weights' gradient
    even where x needs none) may keep it for its backward."""
    rows, ends, row_of, kept, group_rows = _moe_dispatch(x, ids, list(shape), comm.world_size, comm._id)
    counts = None
    if exact:
        per = shape[3] // comm.world_size
        counts = (([0] * per, [0] * per, 0) if EMULATE else
                  _weft.moe_counts(comm._c, _last_counts[comm._id], ends.data_ptr(), tuple(shape), _stream(x)))
        rows = rows[:counts[2]]
    if torch.is_grad_enabled() and not _low_latency(shape):  # (the low-latency dispatch has no backward)
        rows = rows.clone()
    return rows, ends, row_of, kept, counts, group_rows


# The dispatch and the first expert GEMM in one kernel (inference: no autograd): c [capacity, n] (or n / 2
# with SwiGLU in the epilogue) = each group's rows . its expert's b, and the dispatch's handle as
# _moe_dispatch returns it.
@_operator("weft::moe_dispatch_grouped_mm")
def _moe_dispatch_grouped_mm(x: Tensor, experts: Tensor, b: Tensor, b_nk: bool, swiglu: bool, shape: list[int],
                             world: int, comm: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    n = b.shape[1] if b_nk else b.shape[2]
    out = x.new_empty((_moe_capacity(shape, world), n // 2 if swiglu else n))
    if EMULATE:
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


def moe_dispatch_grouped_mm(x, ids, b, b_nk, swiglu, shape, comm):
    """x, ids (int32, contiguous), b (as stored) checked by the caller; returns (c, rows, group_end, row_of,
    kept)."""
    return _moe_dispatch_grouped_mm(x, ids, b, b_nk, swiglu, list(shape), comm.world_size, comm._id)


def moe_combine(expert_out, row_of, kept, weights, shape, comm, group_rows=None):
    if group_rows is None:
        group_rows = row_of.new_empty((0,))
    return _moe_combine(expert_out.contiguous(), row_of, kept, weights, list(shape), comm._id, group_rows)


# The low-latency layer's down GEMM and combine (inference, no autograd): the GEMM writes straight into the
# team's combine area (the rows the peers read), so no copy comes between the two (moe_combine given the
# GEMM's output elsewhere copies the rows the groups received into the area first).
@_operator("weft::moe_grouped_mm_then_combine")
def _moe_grouped_mm_then_combine(a: Tensor, b: Tensor, b_nk: bool, group_end: Tensor, group_rows: Tensor,
                                 row_of: Tensor, kept: Tensor, weights: Tensor, shape: list[int],
                                 comm: int) -> Tensor:
    out = a.new_empty((shape[0], shape[2]))
    if EMULATE:
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


def moe_grouped_mm_then_combine(a, b, b_nk, group_end, group_rows, row_of, kept, weights, shape, comm):
    return _moe_grouped_mm_then_combine(a, b, b_nk, group_end, group_rows, row_of, kept, weights, list(shape),
                                        comm._id)


# ---- distributed flash-decode (inference: no autograd) ------------------------------------------------------
# The cache tensors pass as they are; block_table / offsets / seq_total may be absent (None).


@_operator("weft::flash_decode")
def _flash_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, seqlens: Tensor, block_table: Optional[Tensor],
                  offsets: Optional[Tensor], seq_total: Optional[Tensor], max_local: int, causal: bool, scale: float,
                  comm: int, out_rank: int) -> tuple[Tensor, Tensor]:
    batch, q_len, heads, dim = q.shape
    out = torch.empty_like(q)
    lse = q.new_empty((batch, q_len, heads), dtype=torch.float32)
    if EMULATE:
        return out.zero_(), lse.zero_()
    paged = block_table is not None
    ptr = (lambda t: 0 if t is None else t.data_ptr())
    _weft.flash_decode(_native(comm), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), ptr(block_table),
                       k_cache.shape[1] if paged else 0, block_table.shape[1] if paged else 0,
                       k_cache.shape[0] if paged else 0, seqlens.data_ptr(), ptr(offsets), ptr(seq_total),
                       out.data_ptr(), lse.data_ptr(), (batch, q_len, heads, k_cache.shape[2], dim, max_local),
                       DTYPES[q.dtype], _stream(q), causal, scale, out_rank)
    return out, lse


@_flash_decode.register_fake
def _(q, k_cache, v_cache, seqlens, block_table, offsets, seq_total, max_local, causal, scale, comm, out_rank):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


def flash_decode(q, k_cache, v_cache, seqlens, block_table, offsets, seq_total, max_local, causal, scale, comm,
                 out_rank=-1):
    """Arguments checked by the caller (weft.flash_decode). out_rank >= 0: out and lse written on that rank only
    (elsewhere their contents are undefined)."""
    return _flash_decode(q, k_cache, v_cache, seqlens, block_table, offsets, seq_total, max_local, causal, scale,
                         comm, out_rank)


# ---- FP8 (weft._fp8): operators with fake implementations, no autograd ---------------------------------------
# Arguments checked by weft._fp8's functions; ab: the FP8 type's name ("e4m3" / "e5m2"), kind: the scaling's
# ("tensor", "rowcol", "block"). b is the .t() view of a contiguous [N, K] weight (its data pointer is the
# weight's).
@_operator("weft::scaled_mm")
def _scaled_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, ab: str, kind: str, out_bf16: bool) -> Tensor:
    (m, k), n = a.shape, b.shape[1]
    out = a.new_empty((m, n), dtype=torch.bfloat16 if out_bf16 else torch.float32)
    if EMULATE:
        return out.zero_()
    _weft.gemm_fp8(a.get_device(), a.data_ptr(), b.data_ptr(), out.data_ptr(), m, n, k, ab, kind, scale_a.data_ptr(),
                   scale_b.data_ptr(), "bf16" if out_bf16 else "fp32", _stream(a))
    return out


@_scaled_mm.register_fake
def _(a, b, scale_a, scale_b, ab, kind, out_bf16):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16 if out_bf16 else torch.float32)


def scaled_mm(a, b, scale_a, scale_b, ab, kind, out_bf16):
    return _scaled_mm(a, b, scale_a, scale_b, ab, kind, out_bf16)


@_operator("weft::grouped_scaled_mm")
def _grouped_scaled_mm(a: Tensor, b: Tensor, group_end: Tensor, scale_a: Tensor, scale_b: Tensor, ab: str,
                       out_bf16: bool, group_rows: Optional[Tensor]) -> Tensor:
    # a and scale_a may be row-strided views (weft.moe_dispatch_fp8's packed rows): their row strides pass on.
    rows, k = a.shape
    groups, n = b.shape[0], b.shape[1]
    out = a.new_empty((rows, n), dtype=torch.bfloat16 if out_bf16 else torch.float32)
    if EMULATE:
        return out.zero_()
    _weft.grouped_gemm_fp8(a.get_device(), a.data_ptr(), b.data_ptr(), out.data_ptr(), group_end.data_ptr(), groups,
                           rows, n, k, ab, scale_a.data_ptr(), scale_b.data_ptr(), "bf16" if out_bf16 else "fp32",
                           _stream(a), a.stride(0), scale_a.stride(0),
                           0 if group_rows is None else group_rows.data_ptr())
    return out


@_grouped_scaled_mm.register_fake
def _(a, b, group_end, scale_a, scale_b, ab, out_bf16, group_rows):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16 if out_bf16 else torch.float32)


def grouped_scaled_mm(a, b, group_end, scale_a, scale_b, ab, out_bf16, group_rows=None):
    return _grouped_scaled_mm(a, b, group_end, scale_a, scale_b, ab, out_bf16, group_rows)


@_operator("weft::all_gather_scaled_matmul")
def _all_gather_scaled_matmul(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, ab: str, kind: str, world: int,
                              comm: int) -> Tensor:
    m, k, n = a.shape[0] * world, a.shape[1], b.shape[1]
    out = a.new_empty((m, n), dtype=torch.bfloat16)
    if EMULATE:
        return out.zero_()
    _weft.all_gather_scaled_matmul(_native(comm), a.data_ptr(), scale_a.data_ptr(), b.data_ptr(), scale_b.data_ptr(),
                                   out.data_ptr(), m, n, k, ab, kind, _stream(a))
    return out


@_all_gather_scaled_matmul.register_fake
def _(a, b, scale_a, scale_b, ab, kind, world, comm):
    return a.new_empty((a.shape[0] * world, b.shape[1]), dtype=torch.bfloat16)


def all_gather_scaled_matmul(a, b, scale_a, scale_b, ab, kind, comm):
    return _all_gather_scaled_matmul(a, b, scale_a, scale_b, ab, kind, comm.world_size, comm._id)


@_operator("weft::scaled_matmul_reduce")
def _scaled_matmul_reduce(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, ab: str, kind: str,
                          all_reduce: bool, world: int, comm: int) -> Tensor:
    (m, k), n = a.shape, b.shape[1]
    out = a.new_empty((m if all_reduce else m // world, n), dtype=torch.bfloat16)
    if EMULATE:
        return out.zero_()
    _weft.scaled_matmul_reduce(_native(comm), a.data_ptr(), scale_a.data_ptr(), b.data_ptr(), scale_b.data_ptr(),
                               out.data_ptr(), m, n, k, ab, kind, all_reduce, _stream(a))
    return out


@_scaled_matmul_reduce.register_fake
def _(a, b, scale_a, scale_b, ab, kind, all_reduce, world, comm):
    rows = a.shape[0] if all_reduce else a.shape[0] // world
    return a.new_empty((rows, b.shape[1]), dtype=torch.bfloat16)


def scaled_matmul_reduce(a, b, scale_a, scale_b, ab, kind, all_reduce, comm):
    return _scaled_matmul_reduce(a, b, scale_a, scale_b, ab, kind, all_reduce, comm.world_size, comm._id)


@_operator("weft::quantize_fp8")
def _quantize_fp8(x: Tensor, fp8: str, scaling: str, operand: str, scale_shape: list[int]) -> tuple[Tensor, Tensor]:
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=torch.float8_e5m2 if fp8 == "e5m2" else torch.float8_e4m3fn,
                    device=x.device)
    scales = torch.empty(scale_shape, dtype=torch.float32, device=x.device)
    if EMULATE:
        return q.zero_(), scales.fill_(1.0)
    _weft.quantize_fp8(x.get_device(), x.data_ptr(), DTYPES[x.dtype], q.data_ptr(), fp8, scales.data_ptr(), rows,
                       cols, scaling, operand, _stream(x))
    return q, scales


@_quantize_fp8.register_fake
def _(x, fp8, scaling, operand, scale_shape):
    dtype = torch.float8_e5m2 if fp8 == "e5m2" else torch.float8_e4m3fn
    return x.new_empty(x.shape, dtype=dtype), x.new_empty(scale_shape, dtype=torch.float32)


def quantize_fp8(x, fp8, scaling, operand, scale_shape):
    return _quantize_fp8(x, fp8, scaling, operand, list(scale_shape))
