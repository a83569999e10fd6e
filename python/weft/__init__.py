"""weft: overlapped multi-GPU kernels for PyTorch and any DLPack framework.

One process per GPU, started by torchrun, mpirun or weft-launch:

    import torch, weft
    comm = weft.init()                        # rendezvous with the other processes
    x = torch.randn(1 << 20, device="cuda", dtype=torch.bfloat16)
    y = weft.all_reduce(x)                    # queued on torch's current stream
    z = comm.empty((1 << 20,), "bf16")        # symmetric tensor: zero-copy input/output (DLPack)

Torch tensors in, torch tensors out when torch is the caller; other frameworks pass anything with
__dlpack__ and get symmetric tensors back (wrap them with their from_dlpack). On torch tensors every op is a
torch operator (torch.ops.weft.*: torch.compile traces it, CUDA graphs capture it) with autograd; ops given
out= run eagerly and are not differentiable.

A team on one GPU, for developing and testing multi-rank code without several GPUs (no launcher):

    team = weft.virtual_team(4)               # 4 ranks on this GPU, each with its own stream
    ys = team.run(lambda comm, x: weft.all_reduce(x, comm=comm), xs)   # xs[r]: rank r's input

Errors: everything weft raises is a WeftError (a RuntimeError): environment and GPU problems as WeftError
itself, bad arguments as WeftValueError / WeftTypeError, which are also ValueError / TypeError. Bad input is
refused with the reason before anything reaches the GPU.
"""
from __future__ import annotations

import math
import os
import secrets
import sys

from . import _weft

WeftError = _weft.WeftError
WeftError.__doc__ = "Everything weft raises: environment and GPU problems, failed device waits (a RuntimeError)."
__version__ = _weft.__version__


class WeftValueError(WeftError, ValueError):
    """An argument with a bad value (shape, size, device, layout, alignment, world-size divisibility)."""


class WeftTypeError(WeftError, TypeError):
    """An argument of the wrong kind or dtype."""


__all__ = ["init", "virtual_team", "Team", "Communicator", "WeftError", "WeftValueError", "WeftTypeError", "__version__", "all_reduce",
           "all_gather", "reduce_scatter", "all_to_all", "all_gather_matmul", "matmul_reduce_scatter",
           "matmul_all_reduce", "flash_attention", "flash_attention_varlen", "grouped_mm", "swiglu_interleave", "ring_shard_indices", "ring_shard",
           "ring_unshard", "context_attention", "ring_attention", "ulysses_attention", "hybrid_attention", "MoeDispatch",
           "moe_dispatch", "moe_combine_input", "moe_combine", "moe_grouped_mm_combine", "moe_layer"]

# DLPack device types (dlpack.h DLDeviceType) for messages.
_DLPACK_DEVICES = {1: "CPU", 2: "CUDA", 3: "CUDA pinned host", 4: "OpenCL", 7: "Vulkan", 8: "Metal", 9: "VPI",
                   10: "ROCm", 11: "ROCm host", 13: "CUDA managed", 14: "oneAPI"}

_DTYPES = ("bf16", "fp16", "fp32")
_OPS = ("sum", "max", "min")
_default = None
# Every Communicator by id: torch operators name their communicator by this integer.
_communicators = {}
# weft._torch_ops once torch is imported (the ops on torch tensors), else None.
_ops = None


def init(timeout_ms: int = 0) -> "Communicator":
    """Joins this process's GPU to the team described by the launcher's environment.

    The processes meet on a local socket that only this user's processes can use, and authenticate with a
    job secret: WEFT_JOB_SECRET when set (weft-launch sets one; set your own, 16 characters or more, under
    mpirun), else, under torchrun or once torch.distributed is initialized, a random one that rank 0 shares
    through torch's store. The returned communicator's `job_secret_from` says which (None: no secret, the
    user check alone). It also becomes the default communicator of the module-level ops.
    """
    global _default
    t = _torch_api()
    secret, source = "", None
    if os.environ.get("WEFT_JOB_SECRET"):
        source = "WEFT_JOB_SECRET"
    else:
        store = _launcher_store(sys.modules["torch"]) if t is not None else None
        if store is not None:
            secret, source = _shared_secret(store, int(os.environ.get("RANK", "0")), _secret_key()), "torch store"
    comm = Communicator(_weft.Comm.from_env(timeout_ms, secret))
    comm.job_secret_from = source
    _default = comm
    return _default


# init() calls so far in this process: every rank makes them in the same order, so the n-th call of each
# rank reads the n-th secret.
_inits = 0


def _secret_key():
    global _inits
    _inits += 1
    return f"weft/job_secret/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_inits}"


def _launcher_store(torch):
    """The key-value store torch gives this job's processes: torch.distributed's default store once a
    process group exists, else torchrun's agent store (MASTER_ADDR:MASTER_PORT); None without either."""
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available():
        return None
    if dist.is_initialized():
        get = getattr(dist.distributed_c10d, "_get_default_store", None)
        if get is not None:
            return get()
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true" and addr and port:
        import datetime
        return dist.TCPStore(addr, int(port), is_master=False, timeout=datetime.timedelta(seconds=300))
    return None


def _shared_secret(store, rank, key):
    """Rank 0 draws a 128-bit secret and puts it in the store under key; the other ranks wait for it there."""
    if rank == 0:
        secret = secrets.token_hex(16)
        store.set(key, secret)
        return secret
    value = store.get(key)
    return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)


def virtual_team(world: int, device=None, sm_budget: int = 0, timeout_ms: int = 0) -> "Team":
    """A team of `world` ranks on one GPU, driven from this process (no launcher): every multi-rank op runs
    on one GPU, for development and tests. Not a performance setup: the ranks share the GPU's SMs (each
    rank's kernels get sm_budget SMs, default SMs / world), its memory bandwidth and its L2, so they
    catch protocol and indexing bugs, not a missing system-scope fence.

    Each rank has its own stream; Team.run(fn, ...) calls fn(comm_r, ...) for every rank on that stream.
    Needs CUDA_DEVICE_MAX_CONNECTIONS=32 before CUDA starts (the ranks' streams must not share hardware
    queues): set here when CUDA has not started yet, else refused with the reason.
    device: the GPU (default torch's current device, else 0).
    """
    if not isinstance(world, int) or world < 2:
        raise WeftValueError(f"weft.virtual_team: world must be an int >= 2, got {world!r}")
    queues = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "")
    if not (queues.isdigit() and int(queues) >= 32):
        t = sys.modules.get("torch")
        if t is not None and t.cuda.is_initialized():
            raise WeftError("weft.virtual_team: needs CUDA_DEVICE_MAX_CONNECTIONS=32 in the environment before "
                            f"CUDA starts (it is {queues or 'unset, i.e. 8'}) and torch has started CUDA already: "
                            "a rank's stream waiting for a peer blocks the hardware queue it shares. Export it "
                            "before starting Python, or call weft.virtual_team before torch uses the GPU")
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "32"
    t = _torch_api()
    if device is None:
        device = sys.modules["torch"].cuda.current_device() if t is not None else 0
    natives = _weft.Comm.virtual_team(world, int(device), int(sm_budget), int(timeout_ms))
    return Team([Communicator(n) for n in natives])


def _detached_copy(x, torch):
    """x with its tensors (x itself, or those of a list / tuple) replaced by detached copies."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone().requires_grad_(x.requires_grad)
    if isinstance(x, (list, tuple)):
        return type(x)(_detached_copy(v, torch) for v in x)
    return x


class Team:
    """The ranks of weft.virtual_team: team[r] is rank r's Communicator, team.streams[r] its torch stream."""

    def __init__(self, comms):
        self.comms = list(comms)
        self.world_size = len(self.comms)
        self.device = self.comms[0].device
        torch = sys.modules.get("torch")
        self.streams = [torch.cuda.Stream(device=self.device) for _ in self.comms] if torch else None
        if torch is not None:
            # One thread drives every rank, so a rank's kernel may wait on the GPU for a peer this thread
            # launches later. A thread's first GEMM in torch makes its cuBLAS handle, which waits for the
            # GPU's running work: between two ranks' launches, for ever. Make the handles (this thread's, and
            # the autograd engine's, which runs the backward) and every stream's workspace now.
            for s in self.streams:
                with torch.cuda.stream(s):
                    for dtype in (torch.float32, torch.bfloat16):
                        x = torch.ones(16, 16, device=f"cuda:{self.device}", dtype=dtype, requires_grad=True)
                        torch.addmm(x, x, x.t()).sum().backward()
            torch.cuda.synchronize(self.device)

    def __len__(self):
        return self.world_size

    def __getitem__(self, r):
        return self.comms[r]

    def __iter__(self):
        return iter(self.comms)

    def run(self, fn, *per_rank):
        """[fn(team[r], a[r], b[r], ...) for every rank r], each call on rank r's stream.

        Every rank's work starts after the work already queued on the current stream and the current stream
        waits for all of it, so the results can be used right away. With torch each result tensor (or
        tuple / list of them) is also marked as used by the current stream, for the caching allocator.
        Calls run in rank order on this thread; an op's kernels wait on the GPU for their peers, so every
        rank must make the same op calls in the same order, as processes do. Autograd's backward of the
        results runs each rank's part on the stream of its forward.
        One thread drives every rank, so a host call that waits for the GPU's running work (a library's
        first use on a thread: cuBLAS handles, cuDNN) would wait for a kernel that waits for a rank not yet
        launched; such a wait ends at the device-wait timeout with an error. The team makes torch's cuBLAS
        handles up front (the main thread's and autograd's); Team.warmup(fn, ...) loads the rest of a step's
        torch work (a GEMM shape's first cuBLAS kernel waits like that too).
        """
        for a in per_rank:
            if len(a) != self.world_size:
                raise WeftValueError(f"Team.run: every per-rank argument needs {self.world_size} entries, got {len(a)}")
        torch = sys.modules.get("torch")
        if torch is None:
            return [fn(c, *(a[r] for a in per_rank)) for r, c in enumerate(self.comms)]
        current = torch.cuda.current_stream(self.device)
        outs = []
        for r, (c, s) in enumerate(zip(self.comms, self.streams)):
            s.wait_stream(current)
            with torch.cuda.stream(s):
                outs.append(fn(c, *(a[r] for a in per_rank)))
        for s in self.streams:
            current.wait_stream(s)
        for o in outs:
            for t in (o if isinstance(o, (tuple, list)) else (o,)):
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(current)
        return outs

    def warmup(self, fn, *per_rank):
        """Runs fn(team[r], a[r], ...) once for every rank with weft's ops emulated (computed with torch on
        this GPU alone, as if every rank held rank r's input), then the backward of every output that
        requires grad: the torch work of a team step (GEMM shapes, elementwise and compiled kernels,
        torch.compile's per-rank graphs) loads its kernels and libraries now, while no weft kernel waits for a
        peer. Call it once before Team.run of a step that mixes torch and weft ops (Team.run explains why).
        Tensor arguments (and those in list / tuple arguments) are passed as detached copies, so their
        gradients land there; parameters fn reaches
        otherwise (a module's) get warm-up gradients: zero them afterwards."""
        torch = sys.modules["torch"]
        _ops.EMULATE = True
        try:
            for r, (c, s) in enumerate(zip(self.comms, self.streams)):
                args = [_detached_copy(a[r], torch) for a in per_rank]
                with torch.cuda.stream(s):
                    out = fn(c, *args)
                    outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,))
                            if isinstance(t, torch.Tensor) and t.requires_grad]
                    if outs:
                        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        finally:
            _ops.EMULATE = False
        self.synchronize()

    def empty(self, shape, dtype="bf16"):
        """One symmetric tensor per rank (team[r].empty for every r)."""
        return [c.empty(shape, dtype) for c in self.comms]

    def synchronize(self):
        """Waits for the GPU, then raises WeftError if a rank's device wait failed."""
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.cuda.synchronize(self.device)
        self.comms[0].synchronize()


class Communicator:
    """This process's rank of a weft team (one GPU)."""

    def __init__(self, native):
        self._c = native
        # Plain attributes: every op call reads them (a native property costs a pybind11 round trip).
        self.rank, self.world_size, self.device = native.rank, native.world_size, native.device
        # What authenticated this process's rendezvous (set by weft.init; None: no job secret).
        self.job_secret_from = None
        self._id = len(_communicators)
        _communicators[self._id] = self

    def empty(self, shape, dtype="bf16"):
        """A symmetric tensor (collective: every rank must call it with the same shape and dtype)."""
        shape = _shape_tuple(shape)
        return self._c.empty(list(shape), _dtype_name(dtype))

    def barrier(self):
        """Host-side barrier of the team's processes (returns once every rank called it)."""
        self._c.barrier()

    def synchronize(self):
        """Waits for this rank's queued weft work; raises WeftError if a device wait failed."""
        self._c.synchronize()

    def reserve_workspace(self, nbytes: int):
        """Sizes the scratch memory up front (needed before capturing ops in a CUDA graph)."""
        self._c.reserve_workspace(int(nbytes))

    # The ops, bound to this communicator.
    def all_reduce(self, x, op="sum", out=None):
        return all_reduce(x, op=op, out=out, comm=self)

    def all_gather(self, x, dim=0, out=None):
        return all_gather(x, dim=dim, out=out, comm=self)

    def reduce_scatter(self, x, dim=0, op="sum", out=None):
        return reduce_scatter(x, dim=dim, op=op, out=out, comm=self)

    def all_to_all(self, x, out=None):
        return all_to_all(x, out=out, comm=self)

    def all_gather_matmul(self, a, b, out=None, gathered_a=None):
        return all_gather_matmul(a, b, out=out, gathered_a=gathered_a, comm=self)

    def matmul_reduce_scatter(self, a, b, out=None):
        return matmul_reduce_scatter(a, b, out=out, comm=self)

    def matmul_all_reduce(self, a, b, out=None):
        return matmul_all_reduce(a, b, out=out, comm=self)


# ---- argument handling --------------------------------------------------------------------------------


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


# torch, once the caller has imported it (weft never imports it first): its Tensor type, dtype names and
# the raw current-stream getter, looked up once. Per-call cost matters: the ops are called every layer.
_torch = None


def _torch_api():
    global _torch, _ops
    if _torch is None and "torch" in sys.modules:
        t = sys.modules["torch"]

        class _T:
            Tensor = t.Tensor
            raw_stream = getattr(t._C, "_cuda_getCurrentRawStream", None)
            current_stream = t.cuda.current_stream
            empty = t.empty

        _torch = _T
        from . import _torch_ops
        _ops = _torch_ops
    return _torch


def _torch_tensor(x):
    """Whether x is a torch tensor (then the op runs as a torch operator). Traceable by torch.compile."""
    return (_ops is not None or _torch_api() is not None) and isinstance(x, _ops.Tensor)


def _is_torch(x):
    t = _torch_api()
    return t is not None and isinstance(x, t.Tensor)


def _dtype_name(dtype):
    if isinstance(dtype, str) and dtype in _DTYPES:
        return dtype
    if _ops is not None and dtype in _ops.DTYPES:
        return _ops.DTYPES[dtype]
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
        return _Arg(x.data_ptr(), x.shape, _dtype_name(x.dtype), x.get_device(), x.is_contiguous(), True,
                    x.stride())
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
    c = comm if comm is not None else _default
    if c is None:
        raise WeftError("weft: call weft.init() first (or pass comm=)")
    return c


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


# ---- ops ----------------------------------------------------------------------------------------------


def all_reduce(x, op="sum", out=None, comm=None):
    """Elementwise reduction over ranks (sum, max or min); returns out (new tensor if not given)."""
    if out is None and _torch_tensor(x):
        return _ops.all_reduce(x, op, comm)
    c, s, a = _prepare(x, comm, op)
    out, o = _output(c, s, x, a, a.shape, out)
    _weft.all_reduce(c._c, a.ptr, o.ptr, a.numel, a.dtype, op, s)
    return out


def all_gather(x, dim=0, out=None, comm=None):
    """Concatenates every rank's x along dim (any dim: no extra copies for inner ones)."""
    if out is None and _torch_tensor(x):
        return _ops.all_gather(x, dim, comm)
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
        return _ops.reduce_scatter(x, dim, op, comm)
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
        return _ops.all_to_all(x, comm)
    c, s, a = _prepare(x, comm)
    w = c.world_size
    if a.numel % w:
        raise WeftValueError(f"weft: x has {a.numel} elements, not divisible by the world size {w}")
    out, o = _output(c, s, x, a, a.shape, out)
    _weft.all_to_all(c._c, a.ptr, o.ptr, a.numel // w, a.dtype, s)
    return out


# ---- fused tensor-parallel ops (bf16) ------------------------------------------------------------------


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
        return _ops.all_gather_matmul(a, b, comm)
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
        return _ops.matmul_reduce_scatter(a, b, comm)
    return _summed_matmul(_weft.matmul_reduce_scatter, a, b, out, comm, scatter=True)


def matmul_all_reduce(a, b, out=None, comm=None):
    """The [M, N] product a @ b summed over ranks, on every rank."""
    if out is None and _torch_tensor(a):
        return _ops.matmul_all_reduce(a, b, comm)
    return _summed_matmul(_weft.matmul_all_reduce, a, b, out, comm, scatter=False)


# ---- attention (one GPU, no communicator) ----------------------------------------------------------------


def flash_attention(q, k, v, causal=False, softmax_scale=None, return_lse=False, deterministic=False):
    """softmax(softmax_scale * q k^T [causal mask]) v on one GPU with weft's Hopper kernel, with autograd.

    q [batch, seq_q, heads, dim], k and v [batch, seq_k, kv_heads, dim] (flash-attn's layout), CUDA torch
    tensors on one device, all bf16 or all fp16; dim 64 or 128; heads a multiple of kv_heads (GQA / MQA); any lengths >= 1.
    causal: query i sees keys j <= i + seq_k - seq_q (aligned to the bottom right, as flash-attn); a row
    that sees no key gets 0. softmax_scale defaults to 1 / sqrt(dim). Inputs that are not contiguous are
    copied first. Runs on torch's current stream. Returns the output (like q), and with return_lse=True
    also the fp32 log-sum-exp [batch, heads, seq_q] (not differentiable). deterministic=True makes the backward
    bit-reproducible run to run (its dQ additions take turns; slower).
    """
    if not (_torch_tensor(q) and _torch_tensor(k) and _torch_tensor(v)):
        raise WeftTypeError("weft.flash_attention: q, k and v must be torch tensors")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not x.is_cuda:
            raise WeftValueError(f"weft.flash_attention: {name} must be a CUDA tensor, got one on {x.device}")
        if x.dim() != 4:
            raise WeftValueError(f"weft.flash_attention: {name} must be 4-d [batch, seq, heads, dim], "
                                 f"got shape {tuple(x.shape)}")
        if x.dtype != q.dtype or _dtype_name(x.dtype) not in ("bf16", "fp16"):
            raise WeftTypeError(f"weft.flash_attention: q, k and v must all be bf16 or all fp16, got {q.dtype}, "
                                f"{k.dtype}, {v.dtype}")
        if x.device != q.device:
            raise WeftValueError(f"weft.flash_attention: q, k and v must be on one device, got {q.device}, "
                                 f"{k.device}, {v.device}")
    if k.shape != v.shape:
        raise WeftValueError(f"weft.flash_attention: k and v must have one shape, got {tuple(k.shape)} and "
                             f"{tuple(v.shape)}")
    b, sq, h, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise WeftValueError(f"weft.flash_attention: k's batch and dim must be q's, got q {tuple(q.shape)}, "
                             f"k {tuple(k.shape)}")
    if d not in (64, 128):
        raise WeftValueError(f"weft.flash_attention: dim must be 64 or 128, got {d}")
    if k.shape[2] < 1 or h % k.shape[2] != 0:
        raise WeftValueError(f"weft.flash_attention: heads ({h}) must be a multiple of kv_heads ({k.shape[2]})")
    if min(b, sq, h, k.shape[1]) < 1:
        raise WeftValueError(f"weft.flash_attention: empty input, q {tuple(q.shape)}, k {tuple(k.shape)}")
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    if not scale > 0:
        raise WeftValueError(f"weft.flash_attention: softmax_scale must be positive, got {softmax_scale}")
    out, lse = _ops.flash_attention(q, k, v, bool(causal), scale, None, bool(deterministic))
    return (out, lse) if return_lse else out


# ---- grouped GEMM (one GPU, no communicator) ---------------------------------------------------------------


def _stored_weights(b):
    """Experts' weights given as [E, K, N]: (the tensor as stored, whether that is [E, N, K]). A transposed view of
    contiguous [E, N, K] (stacked nn.Linear) is read in place; anything else not contiguous is copied."""
    if b.is_contiguous():
        return b, False
    if b.transpose(1, 2).is_contiguous():
        return b.transpose(1, 2), True
    return b.contiguous(), False


def grouped_mm(a, b, group_end, out_dtype=None, validate=True, zero_unused_rows=True, activation=None):
    """Grouped matmul of an MoE layer's experts on one GPU (weft's Hopper kernel), with autograd.

    a [rows, K] bf16: the rows of group e are [group_end[e - 1], group_end[e]) (group 0 from row 0), each end
    a multiple of 128 (e.g. weft.moe_dispatch's group_end with align=128), ascending, at most rows; rows a
    multiple of 128. b [E, K, N] bf16 (torch._grouped_mm's layout): contiguous, or the transpose of a
    contiguous [E, N, K] (stacked nn.Linear weights, `w.transpose(1, 2)`), read in place either way.
    group_end: int32 [E] on a's device. Returns [rows, N] of out_dtype (torch.bfloat16, the default, or
    torch.float32): row r of group e is a[r] @ b[e]; rows past the last end are zero (left unwritten with
    zero_unused_rows=False, e.g. for a dispatch's worst-case capacity, whose unused rows combine never reads;
    the backward's dA then leaves them too). K and N multiples of 8.
    The backward gives dA by the same kernel and dB by torch's row-grouped matmul.
    activation="swiglu": the epilogue returns silu(gate) * up, [rows, N / 2], from the fp32 accumulators; b's
    columns must hold gate and up in blocks of 128 (weft.swiglu_interleave), N a multiple of 256. Its
    backward computes the pre-activation again (one more GEMM) instead of keeping it.
    validate=True reads group_end on the host (a synchronisation; skipped while a CUDA graph is captured): an
    end that is not a multiple of 128 would otherwise stop the kernel with a device trap.
    """
    where = "weft.grouped_mm"
    if not (_torch_tensor(a) and _torch_tensor(b) and _torch_tensor(group_end)):
        raise WeftTypeError(f"{where}: a, b and group_end must be torch tensors")
    torch = _ops.torch
    for name, x in (("a", a), ("b", b), ("group_end", group_end)):
        if not x.is_cuda or x.device != a.device:
            raise WeftValueError(f"{where}: {name} must be a CUDA tensor on a's device, got one on {x.device}")
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        raise WeftTypeError(f"{where}: a and b must be bf16, got {a.dtype} and {b.dtype}")
    if group_end.dtype != torch.int32 or group_end.dim() != 1 or group_end.numel() < 1:
        raise WeftTypeError(f"{where}: group_end must be a 1-d int32 tensor of at least one end, got "
                            f"{group_end.dtype} {tuple(group_end.shape)}")
    if a.dim() != 2 or b.dim() != 3:
        raise WeftValueError(f"{where}: a must be [rows, K] and b [E, K, N], got {tuple(a.shape)} and "
                             f"{tuple(b.shape)}")
    rows, k = a.shape
    e, kb, n = b.shape
    if kb != k or e != group_end.numel():
        raise WeftValueError(f"{where}: b must be [E, K, N] with K = a's {k} and E = group_end's "
                             f"{group_end.numel()}, got {tuple(b.shape)}")
    if rows % 128 or rows < 128:
        raise WeftValueError(f"{where}: a's rows must be a positive multiple of 128 (whole tiles), got {rows}")
    if k % 8 or n % 8:
        raise WeftValueError(f"{where}: K and N must be multiples of 8 (16-byte rows for TMA), got K {k}, N {n}")
    if activation not in (None, "swiglu"):
        raise WeftValueError(f"{where}: activation must be None or 'swiglu', got {activation!r}")
    if activation == "swiglu" and n % 256:
        raise WeftValueError(f"{where}: activation='swiglu' needs N (gate and up columns) a multiple of 256, "
                             f"got {n}")
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise WeftTypeError(f"{where}: out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    if validate and not torch.cuda.is_current_stream_capturing() and not torch.compiler.is_compiling():
        ends = group_end.tolist()
        if any(x % 128 for x in ends) or any(y < x for x, y in zip(ends, ends[1:])) or ends[0] < 0 or ends[-1] > rows:
            raise WeftValueError(f"{where}: group_end must ascend in multiples of 128 up to rows ({rows}), got "
                                 f"{ends[:8]}{' ...' if len(ends) > 8 else ''}")
    stored, nk = _stored_weights(b)
    return _ops.grouped_mm(a.contiguous(), stored, group_end.contiguous(), nk, out_dtype, bool(zero_unused_rows),
                           activation or "")


def swiglu_interleave(w):
    """SwiGLU weights [E, K, 2 I] (gate columns, then up: torch's chunk(2) order) in the column order
    weft.grouped_mm(activation="swiglu") reads: blocks of 256 columns, the first 128 of block b gate columns
    [128 b, 128 b + 128), the last 128 the same up columns. I a multiple of 128. A transposed view of
    contiguous [E, 2 I, K] weights (stacked nn.Linear) stays one (nn.Linear layout); anything else comes back
    contiguous. A copy: do it once, not per step."""
    if not _torch_tensor(w) or w.dim() != 3 or w.shape[2] % 256:
        raise WeftValueError("weft.swiglu_interleave: w must be a torch tensor [E, K, 2 I] with I a multiple of "
                             f"128, got {tuple(w.shape) if hasattr(w, 'shape') else type(w).__name__}")
    blocks = w.shape[2] // 256
    if not w.is_contiguous() and w.transpose(1, 2).is_contiguous():  # [E, 2 I, K] stored
        t = w.transpose(1, 2)
        t = t.unflatten(1, (2, blocks, 128)).transpose(1, 2).flatten(1, 3).contiguous()
        return t.transpose(1, 2)
    return w.unflatten(2, (2, blocks, 128)).transpose(2, 3).flatten(2, 4).contiguous()


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                           softmax_scale=None, return_lse=False, deterministic=False):
    """weft.flash_attention over a packed batch of variable-length sequences (flash-attn's varlen layout).

    q [total_q, heads, dim], k and v [total_k, kv_heads, dim], CUDA tensors, all bf16 or all fp16; sequence b is query rows
    cu_seqlens_q[b] .. cu_seqlens_q[b + 1] and key rows cu_seqlens_k[b] .. cu_seqlens_k[b + 1]
    (int32 CUDA tensors of batch + 1 ascending offsets starting at 0). max_seqlen_q / max_seqlen_k: the
    longest sequences (a Python int each; the offsets stay on the GPU, nothing synchronises); a longer
    sequence stops the kernel with a CUDA error rather than computing a wrong answer. causal aligns each
    sequence's mask to its bottom right. Returns the output (like q), and with return_lse=True also the fp32
    log-sum-exp [heads, total_q]. Differentiable in q, k and v; deterministic as in flash_attention.
    """
    where = "weft.flash_attention_varlen"
    if not (_torch_tensor(q) and _torch_tensor(k) and _torch_tensor(v) and _torch_tensor(cu_seqlens_q)
            and _torch_tensor(cu_seqlens_k)):
        raise WeftTypeError(f"{where}: q, k, v, cu_seqlens_q and cu_seqlens_k must be torch tensors")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not x.is_cuda or x.device != q.device:
            raise WeftValueError(f"{where}: q, k and v must be CUDA tensors on one device, got {name} on {x.device}")
        if x.dim() != 3:
            raise WeftValueError(f"{where}: {name} must be 3-d [total, heads, dim], got shape {tuple(x.shape)}")
        if x.dtype != q.dtype or _dtype_name(x.dtype) not in ("bf16", "fp16"):
            raise WeftTypeError(f"{where}: q, k and v must all be bf16 or all fp16, got {q.dtype}, {k.dtype}, "
                                f"{v.dtype}")
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if x.dtype != _ops.torch.int32 or x.dim() != 1 or x.device != q.device:
            raise WeftValueError(f"{where}: {name} must be a 1-d int32 tensor on {q.device}, got {x.dtype} "
                                 f"{tuple(x.shape)} on {x.device}")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0] or cu_seqlens_q.shape[0] < 2:
        raise WeftValueError(f"{where}: cu_seqlens_q and cu_seqlens_k must have batch + 1 >= 2 entries each, got "
                             f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    if k.shape != v.shape:
        raise WeftValueError(f"{where}: k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    total_q, h, d = q.shape
    if k.shape[2] != d:
        raise WeftValueError(f"{where}: k's dim must be q's, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if d not in (64, 128):
        raise WeftValueError(f"{where}: dim must be 64 or 128, got {d}")
    if k.shape[1] < 1 or h % k.shape[1] != 0:
        raise WeftValueError(f"{where}: heads ({h}) must be a multiple of kv_heads ({k.shape[1]})")
    max_q, max_k = int(max_seqlen_q), int(max_seqlen_k)
    if min(total_q, k.shape[0], h, max_q, max_k) < 1 or max_q > total_q or max_k > k.shape[0]:
        raise WeftValueError(f"{where}: need non-empty q and k and 1 <= max_seqlen <= total rows, got q "
                             f"{tuple(q.shape)}, k {tuple(k.shape)}, max_seqlen_q {max_q}, max_seqlen_k {max_k}")
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    if not scale > 0:
        raise WeftValueError(f"{where}: softmax_scale must be positive, got {softmax_scale}")
    packed = (cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max_q, max_k)
    out, lse = _ops.flash_attention(q, k, v, bool(causal), scale, packed, bool(deterministic))
    return (out, lse) if return_lse else out


def _ring_documents(seq_len, cu_seqlens):
    if (seq_len is None) == (cu_seqlens is None):
        raise WeftValueError("give either seq_len (one sequence) or cu_seqlens (a packed batch of documents)")
    if seq_len is not None:
        return [int(seq_len)]
    offsets = [int(x) for x in (cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else cu_seqlens)]
    if len(offsets) < 2 or offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise WeftValueError(f"cu_seqlens must start with 0, not decrease and hold at least one document, "
                             f"got {offsets}")
    return [b - a for a, b in zip(offsets, offsets[1:])]


def ring_shard_indices(world, rank, causal=True, seq_len=None, cu_seqlens=None):
    """Positions in the (packed) sequence of the rows rank `rank` of `world` holds for ring attention.

    Each document (the whole sequence, or each of a packed batch given by cu_seqlens = [0, l0, l0 + l1, ...])
    is cut into parts differing by at most one token: with causal=True 2 * world parts, rank r holding parts r
    and 2 * world - 1 - r (zigzag: every rank gets equal causal work); else world parts, rank r holding part r.
    A rank's rows are its parts of document 0, then of document 1, ... Returns a list of ints.
    """
    docs = _ring_documents(seq_len, cu_seqlens)
    if world < 1 or not 0 <= rank < world:
        raise WeftValueError(f"ring_shard_indices: rank {rank} of a team of {world}")
    if any(n < 0 for n in docs):
        raise WeftValueError(f"ring_shard_indices: negative sequence length in {docs}")
    return _weft.ring_shard_tokens(docs, int(world), int(rank), bool(causal))


def ring_shard(x, world, rank, causal=True, dim=1, cu_seqlens=None):
    """This rank's rows of the torch tensor x along `dim` (the sequence), in ring attention's layout
    (ring_shard_indices: zigzag when causal). cu_seqlens: x holds a packed batch of documents along dim."""
    t = _torch_api()
    if t is None or not isinstance(x, t.Tensor):
        raise WeftTypeError("weft.ring_shard: x must be a torch tensor")
    d = _dim(dim, x.dim())
    idx = ring_shard_indices(world, rank, causal, seq_len=None if cu_seqlens is not None else x.shape[d],
                             cu_seqlens=cu_seqlens)
    if cu_seqlens is not None and (not idx or max(idx) >= x.shape[d]):
        raise WeftValueError(f"weft.ring_shard: cu_seqlens covers more tokens than x has along dim {d}")
    import torch
    return x.index_select(d, torch.tensor(idx, dtype=torch.long, device=x.device))


def ring_unshard(shards, causal=True, dim=1, cu_seqlens=None):
    """The inverse of ring_shard: the whole sequence from the list of every rank's shard (rank order)."""
    t = _torch_api()
    if t is None or not shards or not all(isinstance(x, t.Tensor) for x in shards):
        raise WeftTypeError("weft.ring_unshard: shards must be a non-empty list of torch tensors")
    import torch
    world = len(shards)
    d = _dim(dim, shards[0].dim())
    total = sum(x.shape[d] for x in shards)
    shape = list(shards[0].shape)
    shape[d] = total
    out = shards[0].new_empty(shape)
    for r, x in enumerate(shards):
        idx = ring_shard_indices(world, r, causal, seq_len=None if cu_seqlens is not None else total,
                                 cu_seqlens=cu_seqlens)
        if len(idx) != x.shape[d]:
            raise WeftValueError(f"weft.ring_unshard: rank {r}'s shard has {x.shape[d]} rows along dim {d}, "
                                 f"the layout gives it {len(idx)}")
        out.index_copy_(d, torch.tensor(idx, dtype=torch.long, device=x.device), x)
    return out


# ---- sequence-parallel attention (a team; ring attention's layout) -------------------------------------
def context_attention(q, k, v, causal=False, method="all_gather", seq_len=None, cu_seqlens=None,
                      softmax_scale=None, return_lse=False, comm=None, ulysses_size=None):
    """Attention over a sequence sharded across the team (context parallelism), with autograd.

    Every rank calls it with its shard in ring attention's layout (weft.ring_shard: zigzag when causal).
    q [batch, local_seq, heads, dim], k and v [batch, local_seq, kv_heads, dim]: each of the batch's
    sequences (global length seq_len, default local_seq * world) sharded alike; or a packed batch of
    documents: q [local_rows, heads, dim], k and v [local_rows, kv_heads, dim] with cu_seqlens the documents'
    global offsets [0, l0, l0 + l1, ...] (a list or tensor; the same on every rank). bf16 or fp16, dim 64
    or 128, on this rank's GPU. Attention never crosses a document; causal masks each one.
    method "all_gather": every rank gathers the whole K / V and attends its own queries (any head counts);
    "ring": the K / V rows travel to every rank while it attends the ones that have landed (one kernel per
    pass); in the backward the Q / dO rows travel, each rank's dK / dV stay in registers and dQ parts are
    summed in fp32 on the rank that computed them, then read once by the rows' owner;
    "ulysses": heads are split over the ranks (heads a multiple of the world size, kv_heads and the world
    size dividing one another), each rank attends its heads over the whole sequence;
    "hybrid": Ulysses within groups of ulysses_size consecutive ranks (a divisor of the world size; heads a
    multiple of it, kv_heads and it dividing one another), a ring across the groups (on several nodes: the
    groups inside a node, the rings across them).
    Returns the output (like q), and with return_lse=True also the fp32 log-sum-exp [heads, local rows]
    (rows in q's order, batch-major; not differentiable). Runs on torch's current stream.
    """
    where = "weft.context_attention"
    if not (_torch_tensor(q) and _torch_tensor(k) and _torch_tensor(v)):
        raise WeftTypeError(f"{where}: q, k and v must be torch tensors")
    if method not in ("all_gather", "ring", "ulysses", "hybrid"):
        raise WeftValueError(f"{where}: method must be 'all_gather', 'ring', 'ulysses' or 'hybrid', got {method!r}")
    c = _comm(comm)
    if method == "hybrid":
        if not isinstance(ulysses_size, int) or ulysses_size < 1 or c.world_size % ulysses_size != 0:
            raise WeftValueError(f"{where}: method 'hybrid' needs ulysses_size, a divisor of the world size "
                                 f"({c.world_size}), got {ulysses_size!r}")
        method = f"hybrid:{ulysses_size}"
    elif ulysses_size is not None:
        raise WeftValueError(f"{where}: ulysses_size is for method 'hybrid' only")
    packed = cu_seqlens is not None
    ndim = 3 if packed else 4
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not x.is_cuda or x.device.index != c.device:
            raise WeftValueError(f"{where}: {name} must be a CUDA tensor on this rank's cuda:{c.device}, got one "
                                 f"on {x.device}")
        if x.dim() != ndim:
            raise WeftValueError(f"{where}: {name} must be {ndim}-d "
                                 f"{'[local_rows, heads, dim] with cu_seqlens' if packed else '[batch, local_seq, heads, dim]'}"
                                 f", got shape {tuple(x.shape)}")
        if x.dtype != q.dtype or _dtype_name(x.dtype) not in ("bf16", "fp16"):
            raise WeftTypeError(f"{where}: q, k and v must all be bf16 or all fp16, got {q.dtype}, {k.dtype}, "
                                f"{v.dtype}")
    if k.shape != v.shape or k.shape[:-2] != q.shape[:-2] or k.shape[-1] != q.shape[-1]:
        raise WeftValueError(f"{where}: k and v must be [..., kv_heads, dim] over q's rows, got q {tuple(q.shape)}, "
                             f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    heads, kv_heads, dim = q.shape[-2], k.shape[-2], q.shape[-1]
    if dim not in (64, 128):
        raise WeftValueError(f"{where}: dim must be 64 or 128, got {dim}")
    if kv_heads < 1 or heads % kv_heads != 0:
        raise WeftValueError(f"{where}: heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    world = c.world_size
    if packed:
        docs = _ring_documents(None, cu_seqlens)
    else:
        batch, local = q.shape[0], q.shape[1]
        docs = [int(seq_len) if seq_len is not None else local * world] * batch
    scale = 1.0 / math.sqrt(dim) if softmax_scale is None else float(softmax_scale)
    if not scale > 0:
        raise WeftValueError(f"{where}: softmax_scale must be positive, got {softmax_scale}")
    flat = lambda x: x.reshape(-1, x.shape[-2], x.shape[-1])
    out, lse = _ops.context_attention(flat(q), flat(k), flat(v), method, docs, bool(causal), scale, c)
    out = out.view(q.shape)
    return (out, lse) if return_lse else out


def ring_attention(q, k, v, causal=False, seq_len=None, cu_seqlens=None, softmax_scale=None, return_lse=False,
                   comm=None):
    """weft.context_attention with method="ring" (K / V travel to every rank while it computes)."""
    return context_attention(q, k, v, causal=causal, method="ring", seq_len=seq_len, cu_seqlens=cu_seqlens,
                             softmax_scale=softmax_scale, return_lse=return_lse, comm=comm)


def ulysses_attention(q, k, v, causal=False, seq_len=None, cu_seqlens=None, softmax_scale=None, return_lse=False,
                      comm=None):
    """weft.context_attention with method="ulysses" (heads split over the ranks)."""
    return context_attention(q, k, v, causal=causal, method="ulysses", seq_len=seq_len, cu_seqlens=cu_seqlens,
                             softmax_scale=softmax_scale, return_lse=return_lse, comm=comm)


def hybrid_attention(q, k, v, ulysses_size, causal=False, seq_len=None, cu_seqlens=None, softmax_scale=None,
                     return_lse=False, comm=None):
    """weft.context_attention with method="hybrid": Ulysses within groups of ulysses_size ranks, ring across."""
    return context_attention(q, k, v, causal=causal, method="hybrid", seq_len=seq_len, cu_seqlens=cu_seqlens,
                             softmax_scale=softmax_scale, return_lse=return_lse, comm=comm, ulysses_size=ulysses_size)


# ---- expert parallelism (MoE) ----------------------------------------------------------------------------
class MoeDispatch:
    """What weft.moe_dispatch returns on this rank: `rows` [capacity, hidden] (this rank's experts' rows, one
    padded group per local expert, back to back; a view valid until the next dispatch on the team),
    `group_end` int32 [experts per rank] (each group's padded end, on the GPU), `capacity` (the worst case);
    with exact=True also `counts` (rows per local expert, a host list) and rows cut to the rows in use (the
    last group's end), else counts is None; and what weft.moe_combine needs of the dispatch (each slot's row on
    its expert's rank, the expert ids)."""

    def __init__(self, comm, shape, rows, group_end, row_of, experts, capacity, counts=None):
        self.rows, self.group_end, self.capacity = rows, group_end, capacity
        self.counts = list(counts[0]) if counts is not None else None
        self._comm, self._shape = comm, shape
        self._row_of, self._experts = row_of, experts


def moe_dispatch(x, experts, num_experts, max_tokens=None, align=128, comm=None, exact=False):
    """Sends each token of this rank to the ranks holding its top-k experts (experts split evenly over the team).

    x [tokens, hidden] bf16 / fp16 on this rank's GPU (hidden a multiple of 8); experts [tokens, top_k] integer
    global expert ids (-1: a dropped slot). max_tokens: the most tokens any rank passes (the same on every rank;
    default this rank's count, right when all ranks pass as many). Every rank calls it. No host
    synchronisation: buffers are sized for the worst case; exact=True reads the counts back (one
    synchronisation; not for CUDA graphs, nor for a team one process drives) and cuts rows to the rows in use, so what runs on them (expert
    GEMMs, activations) skips the worst case's empty rows. Returns a MoeDispatch. A torch operator
    (torch.compile traces it) with autograd: x's gradient is the sum of its rows' gradients (a combine with
    weights 1). rows is a view of the team's dispatch area, valid until the next dispatch; when x requires
    grad it is a copy (its consumers, e.g. weft.grouped_mm, may keep it for their backward).
    """
    where = "weft.moe_dispatch"
    if not (_torch_tensor(x) and _torch_tensor(experts)):
        raise WeftTypeError(f"{where}: x and experts must be torch tensors")
    c = _comm(comm)
    if not x.is_cuda or x.device.index != c.device or experts.device != x.device:
        raise WeftValueError(f"{where}: x and experts must be CUDA tensors on this rank's cuda:{c.device}")
    if x.dim() != 2 or experts.dim() != 2 or experts.shape[0] != x.shape[0]:
        raise WeftValueError(f"{where}: x must be [tokens, hidden] and experts [tokens, top_k], got "
                             f"{tuple(x.shape)} and {tuple(experts.shape)}")
    if _ops.DTYPES.get(x.dtype) not in ("bf16", "fp16"):
        raise WeftTypeError(f"{where}: x must be bf16 or fp16, got {x.dtype}")
    if experts.dtype.is_floating_point:
        raise WeftTypeError(f"{where}: experts must hold integer ids, got {experts.dtype}")
    if exact and c._c.local_ranks > 1:  # refused before anything is queued: the peers would wait for ever
        raise WeftValueError(f"{where}: exact=True reads the counts back, synchronising this rank's stream, "
                             f"which in a team that one process drives ({c._c.local_ranks} ranks here) waits for "
                             "ranks not yet launched; run one process per rank (torchrun), or use exact=False")
    tokens, hidden = x.shape
    shape = (tokens, int(max_tokens) if max_tokens is not None else tokens, hidden, int(num_experts),
             experts.shape[1], int(align))
    ids = experts.to(_ops.torch.int32).contiguous()
    rows, ends, row_of, kept, counts = _ops.moe_dispatch(x.contiguous(), ids, shape, c, bool(exact))
    # (Exact counts cut rows; the pybind call is kept out of what torch.compile traces otherwise.)
    capacity = rows.shape[0] if counts is None else _ops._moe_capacity(shape, c.world_size)
    return MoeDispatch(c, shape, rows, ends, row_of, kept, capacity, counts)


def moe_combine_input(dispatched):
    """The buffer weft.moe_combine reads the experts' outputs from: [capacity, hidden] in dispatched.rows'
    layout (write each group's output to the same rows), symmetric so every rank can read it. Writing there
    saves moe_combine a copy; any other [capacity, hidden] tensor works too."""
    if not isinstance(dispatched, MoeDispatch):
        raise WeftTypeError("weft.moe_combine_input: pass what weft.moe_dispatch returned")
    torch = sys.modules["torch"]
    dtype = _dtype_name(dispatched.rows.dtype)
    return torch.from_dlpack(_weft.moe_combine_input(dispatched._comm._c, dispatched._shape, dtype))


def moe_combine(expert_out, dispatched, weights):
    """out[t] = sum over j of weights[t, j] * the expert output of token t's j-th slot, in fp32 in slot order
    (deterministic), rounded once. expert_out [capacity, hidden] in dispatched.rows' layout (best:
    weft.moe_combine_input(dispatched), else it is copied there); weights [tokens, top_k] (fp32). Every rank
    calls it. Returns out [tokens, hidden]. A torch operator (torch.compile traces it) with autograd:
    expert_out's gradient is weights[t, j] * dout[t] at each slot's row (zeros elsewhere), the weights'
    <dout[t], the slot's expert output> (weft.moe_combine_backward's kernel, rows read and written on the
    experts' ranks)."""
    where = "weft.moe_combine"
    if not isinstance(dispatched, MoeDispatch):
        raise WeftTypeError(f"{where}: pass what weft.moe_dispatch returned")
    tokens, _, hidden, _, top_k, _ = dispatched._shape
    if tuple(weights.shape) != (tokens, top_k):
        raise WeftValueError(f"{where}: weights must be [{tokens}, {top_k}], got {tuple(weights.shape)}")
    rows = dispatched.rows.shape[0]
    if tuple(expert_out.shape) != (rows, hidden) or expert_out.dtype != dispatched.rows.dtype:
        raise WeftValueError(f"{where}: expert_out must be [{rows}, {hidden}] of {dispatched.rows.dtype} "
                             f"(dispatched.rows' layout), got {tuple(expert_out.shape)} of {expert_out.dtype}")
    w = weights.to(_ops.torch.float32).contiguous()
    return _ops.moe_combine(expert_out, dispatched._row_of, dispatched._experts, w, dispatched._shape,
                            dispatched._comm)


def moe_grouped_mm_combine(a, b, dispatched, weights):
    """The second expert GEMM and the combine in one: weft.moe_combine(weft.grouped_mm(a, b,
    dispatched.group_end), dispatched, weights), with the GEMM's epilogue sending each output row straight to
    the rank of the token it came from (then each rank sums its tokens' rows as moe_combine does: the same
    results). a [rows, inter] bf16 in dispatched.rows' layout (its row count); b [experts per rank, inter,
    hidden] bf16 (torch._grouped_mm's layout; a transposed view of stacked nn.Linear weights is read in place);
    weights [tokens, top_k]. No other dispatch on the team may come between this one's dispatch and it. Every
    rank calls it. With autograd (a, b, weights; the backward computes the GEMM again)."""
    where = "weft.moe_grouped_mm_combine"
    if not isinstance(dispatched, MoeDispatch):
        raise WeftTypeError(f"{where}: pass what weft.moe_dispatch returned")
    if not (_torch_tensor(a) and _torch_tensor(b) and _torch_tensor(weights)):
        raise WeftTypeError(f"{where}: a, b and weights must be torch tensors")
    torch = _ops.torch
    tokens, _, hidden, num_experts, top_k, align = dispatched._shape
    local = num_experts // dispatched._comm.world_size
    rows = dispatched.rows.shape[0]
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        raise WeftTypeError(f"{where}: a and b must be bf16, got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or a.shape[0] != rows or b.dim() != 3 or tuple(b.shape) != (local, a.shape[1], hidden):
        raise WeftValueError(f"{where}: a must be [{rows} (dispatched.rows' count), inter] and b [{local}, inter, "
                             f"{hidden}], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[1] % 8 or align % 128:
        raise WeftValueError(f"{where}: inter must be a multiple of 8 and the dispatch's align a multiple of 128, "
                             f"got {a.shape[1]} and {align}")
    if tuple(weights.shape) != (tokens, top_k):
        raise WeftValueError(f"{where}: weights must be [{tokens}, {top_k}], got {tuple(weights.shape)}")
    stored, nk = _stored_weights(b)
    w = weights.to(torch.float32).contiguous()
    return _ops.moe_grouped_mm_combine(a.contiguous(), stored, nk, dispatched.group_end, dispatched._row_of,
                                       dispatched._experts, w, dispatched._shape, dispatched._comm)


_ACTIVATIONS = ("swiglu", "silu", "gelu", "relu")


def moe_layer(x, experts, weights, w_up, w_down, num_experts, activation="swiglu", max_tokens=None, align=128,
              comm=None, exact=False, swiglu_interleaved=False, fused_combine=False):
    """The experts of an expert-parallel MoE layer: dispatch, grouped_mm up, activation, grouped_mm down, combine.

    x [tokens, hidden] bf16; experts [tokens, top_k] global expert ids (-1: a dropped slot); weights [tokens,
    top_k] routing weights; w_up: this rank's experts' first weights, [num_experts / world, hidden, 2 * inter]
    for activation "swiglu" (gate columns, then up: silu(gate) * up) or [num_experts / world, hidden, inter]
    for "silu", "gelu", "relu"; w_down [num_experts / world, inter, hidden]; both bf16 in torch._grouped_mm's
    [E, K, N] layout (stacked nn.Linear weights, transposed views, are read in place). Every rank calls it;
    returns [tokens, hidden]. With autograd (x, weights, w_up, w_down). align (a multiple of 128) pads each
    expert's rows for the GEMM tiles. The activation runs over the dispatch's worst-case capacity rows, or with
    exact=True (one synchronisation, see moe_dispatch) over the rows in use only. swiglu_interleaved=True: w_up's
    columns are in weft.swiglu_interleave's order, and the first GEMM's epilogue applies SwiGLU (no
    [rows, 2 inter] intermediate). fused_combine=True: the second GEMM and the combine in one
    (weft.moe_grouped_mm_combine).
    """
    where = "weft.moe_layer"
    if activation not in _ACTIVATIONS:
        raise WeftValueError(f"{where}: activation must be one of {_ACTIVATIONS}, got {activation!r}")
    if int(align) % 128:
        raise WeftValueError(f"{where}: align must be a multiple of 128 (the grouped GEMM's tile rows), got {align}")
    c = _comm(comm)
    if not (_torch_tensor(w_up) and _torch_tensor(w_down)):
        raise WeftTypeError(f"{where}: w_up and w_down must be torch tensors")
    local = int(num_experts) // c.world_size
    hidden = x.shape[-1]
    if w_up.dim() != 3 or w_down.dim() != 3 or w_up.shape[0] != local or w_down.shape[0] != local:
        raise WeftValueError(f"{where}: w_up and w_down must be [{local} experts of this rank, K, N], got "
                             f"{tuple(w_up.shape)} and {tuple(w_down.shape)}")
    inter = w_up.shape[2] // 2 if activation == "swiglu" else w_up.shape[2]
    if w_up.shape[1] != hidden or tuple(w_down.shape[1:]) != (inter, hidden) or (
            activation == "swiglu" and w_up.shape[2] % 2):
        raise WeftValueError(f"{where}: with hidden {hidden} and activation {activation}, w_up must be "
                             f"[{local}, {hidden}, {'2 x ' if activation == 'swiglu' else ''}inter] and w_down "
                             f"[{local}, inter, {hidden}], got {tuple(w_up.shape)} and {tuple(w_down.shape)}")
    d = moe_dispatch(x, experts, num_experts, max_tokens=max_tokens, align=align, comm=comm, exact=exact)
    F = _ops.torch.nn.functional
    if d.rows.shape[0] == 0:  # exact counts, no row here: the experts' weights still get (zero) gradients
        h = d.rows @ w_up[0]
        a = F.silu(h[:, :inter]) * h[:, inter:] if activation == "swiglu" else h
        return moe_combine(a @ w_down[0], d, weights)
    # Rows past the last group are never read by combine, nor by any backward: left unwritten.
    if activation == "swiglu" and swiglu_interleaved:
        a = grouped_mm(d.rows, w_up, d.group_end, validate=False, zero_unused_rows=False, activation="swiglu")
    else:
        h = grouped_mm(d.rows, w_up, d.group_end, validate=False, zero_unused_rows=False)
        if activation == "swiglu":
            a = F.silu(h[:, :inter]) * h[:, inter:]
        else:
            a = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}[activation](h)
    if fused_combine:
        return moe_grouped_mm_combine(a, w_down, d, weights)
    y = grouped_mm(a.contiguous(), w_down, d.group_end, validate=False, zero_unused_rows=False)
    return moe_combine(y, d, weights)


# Communicator's bound ops say what the module-level ones say.
for _name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_gather_matmul",
              "matmul_reduce_scatter", "matmul_all_reduce"):
    getattr(Communicator, _name).__doc__ = globals()[_name].__doc__
del _name

_torch_api()  # torch's operators, when torch came first
