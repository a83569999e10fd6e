"""The argument handling every op shares: torch or DLPack tensors reduced to what the kernels need (_Arg),
the communicator and stream of a call, output tensors, and the lazy hand-over to weft._torch_ops once torch
is imported."""
from __future__ import annotations

import math
import sys

import weft as _w
from . import _weft
from ._errors import WeftError, WeftTypeError, WeftValueError

# The package's mutable state (_default, _communicators, _ops, _torch, _inits) lives in weft/__init__.py
# alone and is read there at call time (`_w._default`, not a copy bound at import), so that
# mock.patch.object(weft, "_default", ...) and weft._torch_api() reach every module.

# DLPack device types (dlpack.h DLDeviceType) for messages.
_DLPACK_DEVICES = {1: "CPU", 2: "CUDA", 3: "CUDA pinned host", 4: "OpenCL", 7: "Vulkan", 8: "Metal", 9: "VPI",
                   10: "ROCm", 11: "ROCm host", 13: "CUDA managed", 14: "oneAPI"}

_DTYPES = ("bf16", "fp16", "fp32")
_OPS = ("sum", "max", "min")


class _Arg:
    """A tensor argument reduced to what the kernels need."""

    __slots__ = ("ptr", "shape", "dtype", "device", "contiguous", "torch", "strides")

    def __init__(self, ptr, shape, dtype, device, contiguous, torch, strides=None):
        self.ptr, self.shape, self.dtype = ptr, tuple(shape), dtype
        self.device, self.contiguous, self.torch = device, contiguous, torch
        self.strides = tuple(strides) if strides is not None else None  # in elements; None: compact

    @property
    def numel(self):
        return math.prod(self.shape)


def _torch_api():
    """torch, once the caller has imported it (weft never imports it first): its Tensor type, dtype names and
    the raw current-stream getter, looked up once into weft._torch (and weft._ops: weft._torch_ops). Per-call
    cost matters: the ops are called every layer."""
    if _w._torch is None and "torch" in sys.modules:
        t = sys.modules["torch"]

        class _T:
            Tensor = t.Tensor
            raw_stream = getattr(t._C, "_cuda_getCurrentRawStream", None)
            current_stream = t.cuda.current_stream
            empty = t.empty

        _w._torch = _T
        from . import _torch_ops
        _w._ops = _torch_ops
        from . import _torch_backend  # dist.init_process_group("weft")
        _torch_backend.register()
    return _w._torch


def _torch_tensor(x):
    """Whether x is a torch tensor (then the op runs as a torch operator). Traceable by torch.compile."""
    return (_w._ops is not None or _torch_api() is not None) and isinstance(x, _w._ops.Tensor)


def _is_torch(x):
    t = _torch_api()
    return t is not None and isinstance(x, t.Tensor)


def _dtype_name(dtype):
    if isinstance(dtype, str) and dtype in _DTYPES:
        return dtype
    ops = _w._ops
    if ops is not None and dtype in ops.DTYPES:
        return ops.DTYPES[dtype]
    raise WeftTypeError(f"weft: unsupported dtype {dtype!r}: use bf16, fp16 or fp32")


def _shape_tuple(shape):
    if isinstance(shape, int):
        shape = (shape,)
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise WeftValueError(f"weft: negative dimension in shape {shape}")
    return shape


def _arg(x, name, stream):
    if _is_torch(x):
        if not x.is_cuda:
            raise WeftValueError(f"weft: {name} must be a CUDA tensor, got one on {x.device}")
        contiguous = x.is_contiguous()  # x.stride() only for a strided x: host time on every op call
        return _Arg(x.data_ptr(), x.shape, _dtype_name(x.dtype), x.get_device(), contiguous, True,
                    None if contiguous else x.stride())
    if hasattr(x, "__dlpack__"):
        ptr, shape, strides, dtype, dev_type, dev_id = _weft.dlpack_info(x.__dlpack__(stream=stream or None))
        if dev_type not in (2, 13):
            kind = _DLPACK_DEVICES.get(dev_type, "unknown")
            raise WeftValueError(f"weft: {name} must be in CUDA device memory, got {kind} memory "
                                 f"(DLPack device type {dev_type})")
        if dtype not in _DTYPES:
            raise WeftTypeError(f"weft: {name} has an unsupported dtype: use bf16, fp16 or fp32")
        contiguous = strides is None or _compact(shape, strides)
        return _Arg(ptr, shape, dtype, dev_id, contiguous, False, strides)
    raise WeftTypeError(f"weft: {name} must be a torch tensor or support DLPack (__dlpack__), got {type(x).__name__}")


def _compact(shape, strides):
    expect = 1
    for d, s in zip(reversed(shape), reversed(strides)):
        if d != 1 and s != expect:
            return False
        expect *= d
    return True


def _comm(comm):
    """The Communicator of a call: comm itself, the default one (None), or the default one's sub-team that a
    torch.distributed ProcessGroup spans (comm=group)."""
    if comm is None:
        if _w._default is None:
            if _w._default_multi_node is not None:
                raise WeftError("weft: a multi-node job has no default team for the module's ops: pass "
                                "comm=team.node (inside the node), or call the team's own collectives")
            raise WeftError("weft: call weft.init() first (or pass comm=)")
        return _w._default
    if hasattr(comm, "_c"):
        return comm
    dist = getattr(sys.modules.get("torch"), "distributed", None)
    if dist is None or not isinstance(comm, dist.ProcessGroup):
        raise WeftTypeError(f"weft: comm must be a weft.Communicator or a torch ProcessGroup, got "
                            f"{type(comm).__name__}")
    if _w._default is None:
        raise WeftError("weft: comm=<ProcessGroup> maps onto weft.init()'s team: call weft.init() first")
    return _w._default.group(comm)


def _stream(c, x):
    if _is_torch(x):
        t = _torch_api()
        if t.raw_stream is not None:  # an int, without building a torch.cuda.Stream object
            return t.raw_stream(c.device)
        return t.current_stream(c.device).cuda_stream
    return c._c.stream


def _check_input(c, a, name):
    if a.device != c.device:
        raise WeftValueError(f"weft: {name} is on cuda:{a.device} but this rank uses cuda:{c.device}")
    if not a.contiguous:
        raise WeftValueError(f"weft: {name} must be contiguous (call .contiguous() first)")


def _output(c, s, like, a, shape, out, name="out"):
    """The given out (checked) or a new tensor: torch.empty when torch is the caller, else symmetric."""
    if out is None:
        if a.torch:
            out = _torch_api().empty(shape, dtype=like.dtype, device=like.device)
        else:
            out = c.empty(shape, a.dtype)
    o = _arg(out, name, s)
    _check_input(c, o, name)
    if o.shape != tuple(shape):
        raise WeftValueError(f"weft: {name} has shape {o.shape}, expected {tuple(shape)}")
    if o.dtype != a.dtype:
        raise WeftTypeError(f"weft: {name} has dtype {o.dtype}, the input {a.dtype}")
    return out, o


def _dim(dim, ndim):
    if ndim == 0:
        raise WeftValueError("weft: a 0-d tensor has no dimension to gather or scatter")
    d = dim + ndim if dim < 0 else dim
    if not 0 <= d < ndim:
        raise WeftValueError(f"weft: dim {dim} is out of range for a {ndim}-d tensor")
    return d


def _prepare(x, comm, op=None, name="x"):
    """Communicator, stream and checked input (called `name` in messages) of an op call."""
    c = _comm(comm)
    if op is not None and op not in _OPS:
        raise WeftValueError(f"weft: unsupported reduction op {op!r}: use sum, max or min")
    s = _stream(c, x)
    a = _arg(x, name, s)
    _check_input(c, a, name)
    return c, s, a
