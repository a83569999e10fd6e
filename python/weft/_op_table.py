"""The op table: weft's torch operators (torch.ops.weft.*) declared without torch, each in the area module of the
public function that calls it (weft never imports torch: the area modules load without it).

A declaration holds what torch.library needs of an op, in the form of torch's own CustomOpDef:

    @declare("weft::all_reduce")
    def _all_reduce(x: Tensor, op: str, comm: int) -> Tensor:   # the implementation: the operator's schema
        ...                                                      # comes from its annotations

    @_all_reduce.register_fake
    def _(x, op, comm):                                          # the fake: output shapes from the arguments
        return torch.empty_like(x)

    _all_reduce.register_autograd(_all_reduce_backward, setup_context=_all_reduce_setup)   # where differentiable

The area module's torch path checks its arguments, then calls the operator made of the declaration,
`_all_reduce.op(x, op, c._id)`; backward formulas call other ops' operators the same way, at run time.
weft._torch_ops, loaded once the caller has imported torch (weft._args._torch_api), binds torch here
(bind_torch) and makes every declaration into its operator (make_operators) before a torch tensor reaches an op.

Beside the table, what the implementations share: DTYPES, Team.warmup's emulation (EMULATE, emulated), torch's
current stream (_stream), a communicator id's native communicator and world size, and the torch path's argument
check (_check). This module and the area modules read torch as the module attribute `torch` and torch.Tensor as
`Tensor`: stand-ins until bind_torch puts torch's own in their place.
"""
from __future__ import annotations

import contextlib
import sys

import weft as _w
from ._errors import WeftError, WeftTypeError, WeftValueError


class _TorchStandIn:
    """Stands for the torch module where torch is read at call time only (on torch tensors: torch is imported
    by then): each attribute is the imported torch's."""

    def __getattr__(self, name):
        t = sys.modules.get("torch")
        if t is None:
            raise AttributeError(f"weft: torch.{name} read before torch was imported")
        return getattr(t, name)

    def __repr__(self):
        return "<torch, looked up when read (weft._op_table)>"


class Tensor:
    """torch.Tensor's stand-in until torch is imported: the implementations' annotations name it (the operators'
    schemas) and the torch-path checks test against it; bind_torch puts torch.Tensor in its place."""


torch = _TorchStandIn()
_TORCH_STAND_IN, _TENSOR_STAND_IN = torch, Tensor


# ---- the declarations -------------------------------------------------------------------------------------


class OpDecl:
    """One torch operator's declaration: its name ("weft::x"), its implementation (a function whose annotations
    give the schema: Tensor, Optional[Tensor], list[int], tuple[Tensor, ...], torch.dtype, bool, int, float, str),
    its fake implementation, and its autograd (backward and setup_context; None: not differentiable).
    `op`: the operator made of it (weft._torch_ops.make_operators; None before torch is imported)."""

    def __init__(self, name, impl):
        self.name, self.impl = name, impl
        self.fake = self.backward = self.setup_context = None
        self.op = None

    def register_fake(self, fake):
        """@decl.register_fake on the fake implementation (torch's CustomOpDef.register_fake)."""
        self.fake = fake
        return fake

    def register_autograd(self, backward, *, setup_context):
        """The op's backward and setup_context (torch's CustomOpDef.register_autograd)."""
        self.backward, self.setup_context = backward, setup_context

    def __repr__(self):
        return f"<weft op {self.name}{'' if self.op is None else ' (made)'}>"


# Every declaration, in declaration order (the area modules' import order). Each is made into its operator
# once torch is imported; the area modules are imported (and declare their ops) before weft looks for torch.
DECLARATIONS = []


def declare(name):
    """@declare("weft::x") on an op's implementation: its declaration (an OpDecl, added to DECLARATIONS). Every
    weft operator is functional (it writes only the tensors it returns): made with mutates_args=()."""
    def make(impl):
        if any(d.name == name for d in DECLARATIONS):
            raise WeftError(f"weft: the operator {name} is declared twice")
        decl = OpDecl(name, impl)
        DECLARATIONS.append(decl)
        return decl
    return make


def bind_torch(t):
    """torch (the imported module t) put where the ops read it: DTYPES, the dtypes _check accepts, the raw
    current-stream getter, and torch / Tensor in place of their stand-ins, here and in every module that
    declares ops. Their code then reads torch itself as a plain module global (no lookup per call; what
    torch.compile traces is torch), and custom_op, which evaluates an implementation's string annotations in
    its module, finds Tensor there. Called by weft._torch_ops before it makes the operators."""
    global _ANY, _raw_stream
    DTYPES.update({t.bfloat16: "bf16", t.float16: "fp16", t.float32: "fp32"})
    _ANY = (t.bfloat16, t.float16, t.float32)
    _raw_stream = getattr(t._C, "_cuda_getCurrentRawStream", None)
    namespaces = {id(globals()): globals()}
    namespaces.update((id(d.impl.__globals__), d.impl.__globals__) for d in DECLARATIONS)
    for namespace in namespaces.values():
        if namespace.get("torch") is _TORCH_STAND_IN:
            namespace["torch"] = t
        if namespace.get("Tensor") is _TENSOR_STAND_IN:
            namespace["Tensor"] = t.Tensor


# ---- what the implementations share ----------------------------------------------------------------------


# torch's dtypes by weft's names ("bf16", "fp16", "fp32"); filled by bind_torch (weft._torch_ops.DTYPES is it).
DTYPES = {}
_ANY = ()  # DTYPES's dtypes (bind_torch): what _check accepts unless told
_raw_stream = None  # torch._C._cuda_getCurrentRawStream (bind_torch), where torch has it

# Team.warmup's emulation: the operators compute with torch on this rank alone, as if every rank held this
# rank's input (right shapes and dtypes, no peers, no weft kernel), so that the torch work around them
# loads its kernels and libraries while no weft kernel waits for a peer. Set by `with emulated():` only; every
# op reads it (_op_table.EMULATE) when it runs.
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


def _stream(x):
    """torch's current stream on x's GPU, as an int (without building a torch.cuda.Stream: every op call)."""
    if _raw_stream is not None:
        return _raw_stream(x.device.index)
    return torch.cuda.current_stream(x.device).cuda_stream


def _native(comm_id):
    return _w._communicators[comm_id]._c


def _world(comm_id):
    return _w._communicators[comm_id].world_size


def _check(c, x, name, dtypes=None, where="weft"):
    """x: a contiguous CUDA tensor on c's GPU of one of `dtypes` (default: bf16, fp16, fp32) (traceable
    attributes only)."""
    if dtypes is None:
        dtypes = _ANY
    if not isinstance(x, Tensor):
        raise WeftTypeError(f"{where}: {name} must be a torch tensor, got {type(x).__name__}")
    if not x.is_cuda:
        raise WeftValueError(f"{where}: {name} must be a CUDA tensor, got one on {x.device}")
    if x.device.index != c.device:
        raise WeftValueError(f"{where}: {name} is on {x.device} but this rank uses cuda:{c.device}")
    if x.dtype not in dtypes:
        names = ", ".join(DTYPES[d] for d in dtypes)
        raise WeftTypeError(f"{where}: {name} has an unsupported dtype {x.dtype}: use {names}")
    if not x.is_contiguous():
        raise WeftValueError(f"{where}: {name} must be contiguous (call .contiguous() first)")
