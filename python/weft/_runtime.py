"""Runtime and teams: weft.init (the launcher's team, its job secret), weft.virtual_team (a team on one GPU),
Team and Communicator."""
from __future__ import annotations

import functools
import inspect
import operator
import os
import secrets
import sys

import weft as _w
from . import _weft
from ._args import _dtype_name, _output, _prepare, _shape_tuple, _torch_api
from . import _collectives, _tensor_parallel
from ._errors import WeftError, WeftValueError

# The package's mutable state (_default, _communicators, _ops, _torch, _inits) lives in weft/__init__.py
# alone and is read there at call time (`_w._default`, not a copy bound at import), so that
# mock.patch.object(weft, "_default", ...) and weft._torch_api() reach every module.


def init(timeout_ms: int = 0) -> "Communicator":
    """Joins this process's GPU to the team described by the launcher's environment.

    The processes meet on a local socket that only this user's processes can use, and authenticate with a
    job secret: WEFT_JOB_SECRET when set (weft-launch sets one; set your own, 16 characters or more, under
    mpirun), else, under torchrun or once torch.distributed is initialized, a random one that rank 0 shares
    through torch's store. The returned communicator's `job_secret_from` says which (None: no secret, the
    user check alone). It also becomes the default communicator of the module-level ops.
    """
    nodes = _weft.launch_nodes()
    if nodes > 1:  # before any secret is drawn: the n-th init() of every rank reads the n-th one
        raise WeftError(f"weft.init(): a multi-node job ({nodes} nodes): weft.init_multi_node() makes its team "
                        "(the node's weft team and NCCL between the nodes)")
    store = None
    if not os.environ.get("WEFT_JOB_SECRET") and _torch_api() is not None:
        store = _launcher_store(sys.modules["torch"])
    return _join_team(timeout_ms, store, int(os.environ.get("RANK", "0")))


def init_multi_node(timeout_ms: int = 0) -> "MultiNodeTeam":
    """Joins this process's GPU to a job spanning nodes (torchrun --nnodes N, weft-launch --nnodes N; fake nodes
    of one host with WEFT_NODE_SIZE=k): weft's team of the node's ranks plus NCCL between the nodes. The job
    secret as for init() (across nodes one is required: WEFT_JOB_SECRET, or torch's store under torchrun).
    The nodes meet at MASTER_ADDR, port WEFT_RENDEZVOUS_PORT or MASTER_PORT + 1. Needs NCCL 2.10+ (loaded at
    run time: WEFT_NCCL_LIBRARY, else libnccl.so.2)."""
    store = None
    if not os.environ.get("WEFT_JOB_SECRET") and _torch_api() is not None:
        store = _launcher_store(sys.modules["torch"])
    return _join_nodes(timeout_ms, store, int(os.environ.get("RANK", "0")))


def _join_nodes(timeout_ms, store, rank):
    secret, source = _job_secret(store, rank)
    team = MultiNodeTeam(_weft.MultiNode.from_env(timeout_ms, secret))
    team.node.job_secret_from = source
    _w._default_multi_node = team
    return team


class MoeNodesDispatch:
    """What MultiNodeTeam.moe_dispatch returns: `rows` [capacity, hidden] and `group_end` int32 [experts per rank]
    (this rank's experts' rows, one padded group per local expert, as weft.moe_dispatch's), and what the
    combine takes back (the workspace and inputs kept alive until then)."""

    def __init__(self, rows, group_end, shape, dtype, handle, keep):
        self.rows, self.group_end = rows, group_end
        self._shape, self._dtype, self._handle, self._keep = shape, dtype, handle, keep


class MultiNodeTeam:
    """This process's rank of a job spanning nodes. `node` is weft's team of this node's ranks (a Communicator:
    every weft op runs on it, inside the node); the collectives below span every rank of the job, weft's kernels
    inside each node and NCCL between nodes, each rank's network leg carrying its share only. Ranks: rank =
    node_index x node_size + the rank in the node. Eager calls, queued on torch's current stream (torch tensors)
    or the node rank's stream (DLPack); dim 0 is the one gathered and scattered."""

    def __init__(self, native):
        self._m = native
        self.rank, self.world_size = native.rank, native.world_size
        self.node_index, self.nodes, self.node_size = native.node, native.nodes, native.node_size
        self.device = native.device
        self.node = Communicator(native.node_comm())

    def all_reduce(self, x, op="sum", out=None):
        """Elementwise reduction over every rank of the job (sum, max or min); returns out (new if not given)."""
        c, s, a = _prepare(x, self.node, op)
        out, o = _output(c, s, x, a, a.shape, out)
        _weft.hierarchical_all_reduce(self._m, a.ptr, o.ptr, a.numel, a.dtype, op, s)
        return out

    def all_gather(self, x, out=None):
        """Every rank's x, concatenated along dim 0 in rank order."""
        c, s, a = _prepare(x, self.node)
        if not a.shape:
            raise WeftValueError("weft: all_gather concatenates along dim 0; x is 0-d")
        out, o = _output(c, s, x, a, (a.shape[0] * self.world_size,) + tuple(a.shape[1:]), out)
        _weft.hierarchical_all_gather(self._m, a.ptr, o.ptr, a.numel, a.dtype, s)
        return out

    def reduce_scatter(self, x, op="sum", out=None):
        """The reduction over every rank of x, rank r keeping the r-th of world_size equal slices along dim 0."""
        c, s, a = _prepare(x, self.node, op)
        if not a.shape or a.shape[0] % self.world_size:
            raise WeftValueError(f"weft: reduce_scatter splits dim 0 into {self.world_size} slices; x has shape "
                                 f"{a.shape}")
        shape = (a.shape[0] // self.world_size,) + tuple(a.shape[1:])
        out, o = _output(c, s, x, a, shape, out)
        _weft.hierarchical_reduce_scatter(self._m, a.ptr, o.ptr, a.numel // self.world_size, a.dtype, op, s)
        return out

    def all_to_all(self, x, out=None):
        """x's world_size equal slices along dim 0, slice j to rank j; out's slice j is rank j's slice for this rank
        (not in place)."""
        c, s, a = _prepare(x, self.node)
        if not a.shape or a.shape[0] % self.world_size:
            raise WeftValueError(f"weft: all_to_all splits dim 0 into {self.world_size} slices; x has shape "
                                 f"{a.shape}")
        out, o = _output(c, s, x, a, a.shape, out)
        if o.ptr == a.ptr and a.numel:
            raise WeftValueError("weft: all_to_all is not in place: out must not be x")
        _weft.hierarchical_all_to_all(self._m, a.ptr, o.ptr, a.numel // self.world_size, a.dtype, s)
        return out

    def all_gather_matmul(self, a, b, out=None, gathered_a=None):
        """out [world x m, N] = every rank's a [m, K] gathered along dim 0 in rank order, times b ([K, N], or the
        .t() view of an [N, K] weight; the same on every rank); also fills gathered_a [world x m, K] when given.
        bf16."""
        c, s, x, w, layout, n, k = _tensor_parallel._matmul_operands(a, b, self.node)
        m = x.shape[0]
        out, o = _output(c, s, a, x, (m * self.world_size, n), out)
        g = 0
        if gathered_a is not None:
            _, ga = _output(c, s, a, x, (m * self.world_size, k), gathered_a, "gathered_a")
            g = ga.ptr
        _weft.hierarchical_all_gather_matmul(self._m, x.ptr, w.ptr, o.ptr, g, m, n, k, layout, s)
        return out

    def matmul_reduce_scatter(self, a, b, out=None):
        """The [M, N] product a @ b (a [M, K], b as all_gather_matmul's) summed over every rank; this rank gets
        rows rank x M / world .. (rank + 1) x M / world. bf16."""
        c, s, x, w, layout, n, k = _tensor_parallel._matmul_operands(a, b, self.node)
        if x.shape[0] % self.world_size:
            raise WeftValueError(f"weft: a has {x.shape[0]} rows, not divisible by the world size {self.world_size}")
        m = x.shape[0] // self.world_size
        out, o = _output(c, s, a, x, (m, n), out)
        _weft.hierarchical_matmul_reduce_scatter(self._m, x.ptr, w.ptr, o.ptr, m, n, k, layout, s)
        return out

    def moe_dispatch(self, x, experts, weights, num_experts, max_tokens, align=128):
        """Expert parallelism across nodes (experts split evenly over the job's ranks): this rank's tokens x
        [tokens, hidden] (bf16 / fp16) with their top-k global expert ids experts [tokens, top_k] (-1: dropped) and
        weights [tokens, top_k] go to every node's i-th rank, then weft's dispatch in the node. Returns a
        MoeNodesDispatch: `rows` / `group_end` as weft.moe_dispatch's (this rank's experts' rows; the expert
        GEMMs run on them into team.moe_combine_input(d)), then team.moe_combine(expert_out, d). max_tokens:
        the most tokens any rank passes, the same on every rank (it sizes the legs between nodes, whose sends
        and receives must match). Eager; every rank calls it."""
        torch = sys.modules.get("torch")
        if torch is None or not all(isinstance(t, torch.Tensor) for t in (x, experts, weights)):
            raise WeftValueError("weft: moe_dispatch takes torch tensors x, experts and weights")
        if x.dim() != 2 or experts.dim() != 2 or tuple(weights.shape) != tuple(experts.shape) or \
                experts.shape[0] != x.shape[0]:
            raise WeftValueError(f"weft: moe_dispatch: x [tokens, hidden], experts and weights [tokens, top_k], got "
                                 f"{tuple(x.shape)}, {tuple(experts.shape)}, {tuple(weights.shape)}")
        for t in (x, experts, weights):
            if not t.is_cuda or t.device.index != self.device:
                raise WeftValueError(f"weft: moe_dispatch: tensors must be on this rank's cuda:{self.device}")
        dtype = _dtype_name(x.dtype)
        tokens, hidden = x.shape
        try:
            max_tokens = None if isinstance(max_tokens, bool) else operator.index(max_tokens)
        except TypeError:
            max_tokens = None
        if max_tokens is None or not tokens <= max_tokens:
            raise WeftValueError(f"weft: moe_dispatch: max_tokens must be an integer >= this rank's {tokens} tokens, "
                                 "the same on every rank")
        shape = (tokens, max_tokens, hidden, int(num_experts), experts.shape[1], int(align),
                 int(torch.is_grad_enabled()))
        x = x.contiguous()
        ids = experts.to(torch.int32).contiguous()
        w = weights.to(torch.float32).contiguous()
        workspace = torch.empty(_weft.hierarchical_moe_workspace_bytes(self._m, shape, dtype), dtype=torch.uint8,
                                device=x.device)
        s = torch.cuda.current_stream(x.device).cuda_stream
        rows, ends, *handle = _weft.hierarchical_moe_dispatch(self._m, self.node._c, x.data_ptr(), ids.data_ptr(),
                                                              w.data_ptr(), shape, workspace.data_ptr(),
                                                              workspace.numel(), dtype, s)
        return MoeNodesDispatch(torch.from_dlpack(rows), torch.from_dlpack(ends), shape, dtype, handle,
                                (workspace, x, ids, w))

    def moe_combine_input(self, dispatched):
        """The buffer team.moe_combine reads the experts' outputs from ([capacity, hidden] in dispatched.rows'
        layout, in the node team's symmetric memory)."""
        torch = sys.modules["torch"]
        t = self.nodes * dispatched._shape[1]
        s = dispatched._shape
        node_shape = (t, t, s[2], s[3] // self.nodes, s[4], s[5], s[6])
        return torch.from_dlpack(_weft.moe_combine_input(self.node._c, node_shape, dispatched._dtype))

    def moe_combine(self, expert_out, dispatched):
        """out [tokens, hidden]: each token's sum over its slots of weight x its expert's output (fp32, rounded
        once per node, the nodes' parts summed in fp32). expert_out: team.moe_combine_input(dispatched), written
        in dispatched.rows' layout. Eager; every rank calls it."""
        torch = sys.modules["torch"]
        if not isinstance(dispatched, MoeNodesDispatch):
            raise WeftValueError("weft: moe_combine takes what this team's moe_dispatch returned")
        if tuple(expert_out.shape) != tuple(dispatched.rows.shape) or expert_out.dtype != dispatched.rows.dtype:
            raise WeftValueError(f"weft: moe_combine: expert_out must be {tuple(dispatched.rows.shape)} of "
                                 f"{dispatched.rows.dtype} (team.moe_combine_input(dispatched)), got "
                                 f"{tuple(expert_out.shape)} of {expert_out.dtype}")
        tokens, hidden = dispatched._shape[0], dispatched._shape[2]
        out = torch.empty(tokens, hidden, dtype=dispatched.rows.dtype, device=dispatched.rows.device)
        s = torch.cuda.current_stream(out.device).cuda_stream
        _weft.hierarchical_moe_combine(self._m, expert_out.data_ptr(), tuple(dispatched._handle), out.data_ptr(),
                                       dispatched._shape, dispatched._dtype, s)
        return out

    def broadcast(self, x, root=0, out=None):
        """Every rank gets rank root's x (the others' x gives the shape); out=x broadcasts in place."""
        if not isinstance(root, int) or not 0 <= root < self.world_size:
            raise WeftValueError(f"weft: root must be a rank of the job (0..{self.world_size - 1}), got {root!r}")
        c, s, a = _prepare(x, self.node)
        out, o = _output(c, s, x, a, a.shape, out)
        _weft.hierarchical_broadcast(self._m, a.ptr, o.ptr, a.numel, a.dtype, root, s)
        return out

    def synchronize(self):
        """Waits for this rank's queued work (torch's current stream, where the calls on torch tensors ran, and
        the node rank's own); raises WeftError if the team failed (a rank lost, an NCCL error)."""
        t = _torch_api()
        if t is not None:
            t.current_stream(self.device).synchronize()
        self.node.synchronize()
        self._m.check_alive()


def register_torch_backend():
    """Registers weft as torch.distributed's backend "weft" (dist.init_process_group("weft")). Importing weft
    does it when torch was imported first; this imports torch and does it whatever the order."""
    import torch  # noqa: F401 (the caller asks for torch's backend)
    _torch_api()
    if not _w._torch_backend_registered:
        raise WeftError("weft: torch.distributed is not available in this torch build: no backend to register")


def _job_secret(store, rank):
    """(secret, where it came from) for a rendezvous: WEFT_JOB_SECRET's (read by the C++ side itself), else one
    rank 0 draws into `store` (a torch key-value store every rank reads), else none."""
    if os.environ.get("WEFT_JOB_SECRET"):
        return "", "WEFT_JOB_SECRET"
    if store is not None:
        return _shared_secret(store, rank, _secret_key()), "torch store"
    return "", None


def _join_team(timeout_ms, store, rank):
    """init()'s rendezvous, the secret (where WEFT_JOB_SECRET is not set) drawn by rank 0 into `store` (a torch
    key-value store every rank reads; None: no secret); also the torch backend's first group's (its store)."""
    secret, source = _job_secret(store, rank)
    comm = Communicator(_weft.Comm.from_env(timeout_ms, secret))
    comm.job_secret_from = source
    _w._default = comm
    return comm


def _secret_key():
    """The store key of the next init()'s secret. weft._inits counts the init() calls so far in this process:
    every rank makes them in the same order, so the n-th call of each rank reads the n-th secret."""
    _w._inits += 1
    return f"weft/job_secret/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_w._inits}"


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
        from . import _torch_ops
        with _torch_ops.emulated():
            for r, (c, s) in enumerate(zip(self.comms, self.streams)):
                args = [_detached_copy(a[r], torch) for a in per_rank]
                with torch.cuda.stream(s):
                    out = fn(c, *args)
                    outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,))
                            if isinstance(t, torch.Tensor) and t.requires_grad]
                    if outs:
                        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
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


def _subteam_shape(ranks, world, rank):
    """(size, stride) of the sub-team (Communicator.subteam) whose team ranks are `ranks` and that holds
    `rank`; raises WeftValueError with the reason when the ranks are not one of them."""
    ranks = sorted(int(r) for r in ranks)
    size = len(ranks)
    if rank not in ranks:
        raise WeftValueError(f"weft: rank {rank} is not in the group (ranks {ranks})")
    stride = ranks[1] - ranks[0] if size > 1 else 1
    if stride < 1 or ranks != [ranks[0] + i * stride for i in range(size)]:
        raise WeftValueError(f"weft: the group's ranks {ranks} are not evenly spaced: weft's sub-teams are")
    block = size * stride
    if world % block or ranks[0] != rank // block * block + rank % stride:
        raise WeftValueError(f"weft: the group's ranks {ranks} do not tile the team of {world} as sub-teams of "
                             f"{size} ranks {stride} apart do")
    return size, stride


class Communicator:
    """This process's rank of a weft team (one GPU)."""

    def __init__(self, native):
        self._c = native
        # Plain attributes: every op call reads them (a native property costs a pybind11 round trip).
        self.rank, self.world_size, self.device = native.rank, native.world_size, native.device
        # What authenticated this process's rendezvous (set by weft.init; None: no job secret).
        self.job_secret_from = None
        communicators = _w._communicators
        self._id = len(communicators)
        communicators[self._id] = self
        self._subteams = {}  # (size, stride, lane) -> Communicator
        self._groups = {}  # torch ProcessGroup -> sub-team Communicator
        self._parent = None  # a sub-team's team

    def subteam(self, size: int, stride: int = 1, lane: int = 0) -> "Communicator":
        """The sub-team of `size` ranks `stride` apart that holds this rank (ranks first + i * stride, with
        first = rank // (size * stride) * (size * stride) + rank % stride; size x stride must divide the world
        size): ops given it run over those ranks only. Made once per shape; every rank of the team makes the
        same splits in the same order. Symmetric allocations and the host barrier stay with the whole team.
        lane >= 1: another instance of the split with workspace, flags and meetings of its own (size = the
        world size: the whole team again), for work in flight at once with lane 0's on the same ranks, e.g.
        two micro-batches' MoE layers interleaved (dispatch A, dispatch B, combine A, combine B): run B's on
        comm.subteam(comm.world_size, lane=1)."""
        if not all(isinstance(v, int) for v in (size, stride, lane)):
            raise WeftValueError(f"weft: subteam size, stride and lane must be ints, got {size!r}, {stride!r}, "
                                 f"{lane!r}")
        if lane < 0:
            raise WeftValueError(f"weft: a sub-team's lane must be 0 or more, got {lane}")
        if self._parent is not None:
            raise WeftValueError("weft: subteam of a sub-team: split the team's own communicator")
        key = (size, stride, lane)
        if key not in self._subteams:
            sub = Communicator(self._c.subteam(size, stride, lane))
            sub._parent = self
            self._subteams[key] = sub
        return self._subteams[key]

    def group(self, process_group) -> "Communicator":
        """The sub-team of this team that a torch.distributed ProcessGroup (e.g. a DeviceMesh dimension's)
        spans: its global ranks must be evenly spaced and tile the team as subteam() does (a mesh dimension
        does). Ops also take the group itself as comm= (weft.all_reduce(x, comm=mesh.get_group("tp"))); ranks
        in their arguments (a root) are then group ranks, as torch's group_src / group_dst are."""
        if process_group not in self._groups:
            dist = sys.modules["torch"].distributed
            ranks = list(dist.get_process_group_ranks(process_group))
            if ranks != sorted(ranks):
                raise WeftValueError(f"weft: the group's ranks {ranks} are not in ascending order: weft's sub-team "
                                     "ranks are")
            self._groups[process_group] = self.subteam(*_subteam_shape(ranks, self.world_size, self.rank))
        return self._groups[process_group]

    def empty(self, shape, dtype="bf16"):
        """A symmetric tensor (collective: every rank must call it with the same shape and dtype). On a
        sub-team: the team's, every rank of the team calling it (every group of the split at once)."""
        if self._parent is not None:
            return self._parent.empty(shape, dtype)
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


def _bound(fn):
    """fn as a Communicator method: the call with comm=self (help() and inspect show fn's parameters, self
    first and comm left out)."""
    @functools.wraps(fn)
    def method(self, *args, **kwargs):
        return fn(*args, comm=self, **kwargs)

    sig = inspect.signature(fn)
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    method.__signature__ = sig.replace(parameters=[self_param] + [p for n, p in sig.parameters.items() if n != "comm"])
    del method.__wrapped__
    method.__qualname__ = f"Communicator.{fn.__name__}"
    return method


# Every collective and tensor-parallel op is also a method of Communicator (comm=self): a new op of those
# areas is a method by being in its module's __all__.
for _area in (_collectives, _tensor_parallel):
    for _name in _area.__all__:
        setattr(Communicator, _name, _bound(getattr(_area, _name)))
del _area, _name
