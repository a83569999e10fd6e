"""weft's ops as torch operators (torch.library): the operators made of the op table's declarations
(weft._op_table), which each area module (weft._collectives, _tensor_parallel, _attention, _moe, _fp8) makes
beside the public functions that call them on torch tensors.

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

The area modules' torch paths check their arguments with traceable tensor attributes only (no data pointers,
no streams), then call the operator; the operators' implementations launch on torch's current stream.
A communicator crosses the operator boundary as its integer id (weft's registry of communicators).
The id is only read by the implementations (at run time): under torch.compile it may be symbolic (one
graph serves every rank of a virtual team), so the fake implementations take shapes from a `world` argument.
Imported by weft once torch is imported (weft._args._torch_api), which makes the operators; weft itself never
imports torch.
"""
from __future__ import annotations

import inspect

import torch
from torch import Tensor

from . import _op_table
from ._op_table import DTYPES, emulated  # noqa: F401 (weft._args reads DTYPES here, Team.warmup emulated())

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


# How an eager call runs (_eager_route): the operator itself, its implementation directly, or the implementation
# under the declaration's own autograd node (_eager_function).
_OPERATOR, _IMPL, _FUNCTION = 0, 1, 2


def _eager_route(args):
    """_IMPL where calling an operator's implementation directly does what the operator call would; _FUNCTION
    where so but an input requires grad (the caller then records the autograd node itself); _OPERATOR under
    torch.jit.trace (which records operators), while the profiler records them by name, when compiling, in a
    mode or a functorch transform, or with a tensor subclass, a CPU / meta tensor, or a tensor that requires
    grad inside a list. args: the call's arguments."""
    if not _FAST_PATH or torch.compiler.is_compiling() or _dispatch_modes() or _function_modes() \
            or _functorch_active() or _jit_tracing() is not None or (_profiling is not None and _profiling()):
        return _OPERATOR
    grad = torch.is_grad_enabled()
    needs_grad = False
    for a in args:
        if isinstance(a, Tensor):
            if type(a) not in _PLAIN or not a.is_cuda:
                return _OPERATOR
            needs_grad = needs_grad or (grad and a.requires_grad)
        elif isinstance(a, (list, tuple)):
            for t in a:  # (an autograd.Function does not see tensors inside a list: those take the operator)
                if isinstance(t, Tensor) and (type(t) not in _PLAIN or not t.is_cuda or (grad and t.requires_grad)):
                    return _OPERATOR
    return _FUNCTION if needs_grad else _IMPL


def _plain_eager(args):
    """True where the implementation runs directly (no autograd node needed): _eager_route's _IMPL."""
    return _eager_route(args) == _IMPL


def _eager_function(decl):
    """A differentiable declaration's autograd node for eager calls: a torch.autograd.Function running the
    implementation, the declaration's setup_context and its backward, as the operator's autograd does, without
    torch's operator dispatch around it (through the operator, a training step's attention forward and backward
    cost ~0.3 ms of host time each beside the implementation's ~0.1 / 0.27 ms: the whole budget of a 2k-token
    sequence-parallel step)."""
    impl, setup_context, backward = decl.impl, decl.setup_context, decl.backward

    class EagerFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            out = impl(*args)
            setup_context(ctx, args, out)
            return out

        @staticmethod
        def backward(ctx, *grads):
            return backward(ctx, *grads)

    EagerFunction.__name__ = EagerFunction.__qualname__ = decl.name.replace("::", "_") + "_eager"
    return EagerFunction


class _Operator:
    """A torch operator (torch.library.custom_op) called as one: eagerly through its implementation where
    _eager_route allows (through its _eager_function where inputs require grad and every argument is given
    by position), else through torch. register_fake / register_autograd / ... are the operator's."""

    def __init__(self, op, impl, function=None, arity=0):
        self._op, self._impl, self._function, self._arity = op, impl, function, arity

    def __getattr__(self, name):
        return getattr(self._op, name)

    def __call__(self, *args, **kwargs):
        route = _eager_route(args + tuple(kwargs.values()) if kwargs else args)
        if route == _IMPL:
            return self._impl(*args, **kwargs)
        if route == _FUNCTION and self._function is not None and not kwargs and len(args) == self._arity:
            return self._function.apply(*args)
        return self._op(*args, **kwargs)


def make_operators():
    """Every declaration of the op table made into its operator: torch.library.custom_op(name, mutates_args=())
    of the implementation, with its fake and autograd, called through _Operator (the eager fast path); the
    declaration's `op` is then that operator. torch is bound into the declaring modules first (their
    annotations give the schemas). Declarations made already are left as they are."""
    _op_table.bind_torch(torch)
    for decl in _op_table.DECLARATIONS:
        if decl.op is not None:
            continue
        op = torch.library.custom_op(decl.name, mutates_args=())(decl.impl)
        if decl.fake is not None:
            op.register_fake(decl.fake)
        function = None
        if decl.backward is not None:
            op.register_autograd(decl.backward, setup_context=decl.setup_context)
            function = _eager_function(decl)
        decl.op = _Operator(op, decl.impl, function, len(inspect.signature(decl.impl).parameters))


make_operators()


def __getattr__(name):
    """EMULATE (the op table's, read when asked) and each operator under its implementation's name
    (weft._torch_ops._all_reduce: the _Operator that weft.all_reduce calls)."""
    if name == "EMULATE":
        return _op_table.EMULATE
    for decl in _op_table.DECLARATIONS:
        if decl.impl.__name__ == name and decl.op is not None:
            return decl.op
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
