"""weft as a torch.distributed backend: `dist.init_process_group("weft")` (registered once weft and torch are both
imported) runs torch.distributed's collectives, and what is built on them (DDP, FSDP2, DeviceMesh, DTensor's
functional collectives), on weft's kernels, unchanged.

    import torch, torch.distributed as dist, weft
    dist.init_process_group("weft")                   # under torchrun, weft-launch or mpirun: one GPU per process
    mesh = init_device_mesh("cuda", (2, 2))           # each dimension a weft sub-team

What runs on weft: all_reduce (sum, avg, max, min), all_gather / all_gather_into_tensor, reduce_scatter /
reduce_scatter_tensor, all_to_all_single (equal or given splits) and all_to_all, broadcast, reduce, gather, scatter,
barrier. Reductions take bf16, fp16 and fp32; the copying collectives any dtype (moved as bytes). Each call is queued
on the caller's current CUDA stream; its Work makes the waiting stream wait for it (as NCCL's does) and
barrier() waits on the host. CUDA graphs capture every collective but barrier(), as NCCL's (run each shape once
eagerly first: weft's workspaces cannot grow during a capture). Refused with the reason, never run elsewhere: point-to-point send / recv, other
reduction ops (product, bitwise, premultiplied sums), CPU tensors, non-contiguous tensors, groups whose ranks are
not a weft sub-team (evenly spaced ranks tiling the team, as a DeviceMesh dimension's are; every rank creates its
dimension's group in the same order, as DeviceMesh does).

The team: the default group's creation joins weft's team (weft.init(), the job secret through the group's store)
unless weft.init() ran first; its ranks must be torch's global ranks. A group created later is the sub-team of
that team its global ranks span; every rank of the team must create the groups of a split together (a sub-team's
first call reserves resources on every rank), as DeviceMesh does: dist.new_group([0, 1]) alone on a team of 4
would leave ranks 2 and 3 behind.

On a job spanning nodes (weft.init_multi_node()'s team) the default group alone runs on weft, with all_reduce,
all_gather, reduce_scatter, broadcast, all_to_all_single of equal splits and barrier hierarchical (weft inside each
node, NCCL between nodes); its other collectives and other groups are refused (NCCL groups serve them).

Registered when weft finds torch imported (import torch before weft, or call weft.register_torch_backend()).
Not supported: init_process_group(..., device_id=...) (torch then asks the group for a C++ backend to split,
which this Python group has none of), object collectives (they move CPU tensors), and C++ callers of the group
methods torch 2.11's Python trampoline does not forward (gather, scatter, reduce, _allgather_base from compiled
code such as torch.ops._c10d_functional.all_gather_into_tensor_out): they fail in torch naming the device type.
"""
from __future__ import annotations

import math

# Imported once torch is (weft._args._torch_api): weft never imports torch first.
import torch
import torch.distributed as dist

import weft as _w
from . import _weft
from ._errors import WeftError, WeftValueError

BACKEND = "weft"


def register():
    """Registers the backend with torch.distributed (once; where torch.distributed is available)."""
    if not dist.is_available() or _w._torch_backend_registered:
        return
    if BACKEND.upper() not in getattr(dist.Backend, "_plugins", {}):
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cuda"])
    _w._torch_backend_registered = True


def _create(opts, backend_options=None):
    """torch's creator of the backend's process group (extended API: opts carries the store, the group's rank,
    size and global ranks)."""
    ranks_given = bool(getattr(opts, "global_ranks_in_group", []))  # [] for the default group
    ranks = list(getattr(opts, "global_ranks_in_group", []) or range(opts.group_size))
    if _w._default is None and _w._default_multi_node is None and _weft.launch_nodes() > 1:
        from ._runtime import _join_nodes  # a job spanning nodes: the hierarchical team
        _join_nodes(0, opts.store, opts.group_rank)
    if _w._default_multi_node is not None and _w._default_multi_node.nodes > 1:
        return _multi_node_group(opts, ranks_given)
    if _w._default is None:
        if len(ranks) != opts.group_size or ranks != list(range(opts.group_size)):
            raise WeftError("weft: the backend's first group must be the default group (every rank): call "
                            "dist.init_process_group('weft') or weft.init() first")
        from ._runtime import _join_team
        _join_team(0, opts.store, opts.group_rank)
    team = _w._default
    torch.cuda.set_device(team.device)
    if not ranks_given and opts.group_size != team.world_size:
        raise WeftError(f"weft: torch's default group has {opts.group_size} ranks, weft's team "
                        f"{team.world_size}: the launcher's environment (WORLD_SIZE) and init_process_group's "
                        "arguments disagree")
    if len(ranks) == team.world_size and ranks == list(range(team.world_size)):
        group = team
        if opts.group_rank != team.rank:
            raise WeftError(f"weft: torch's rank {opts.group_rank} is weft's rank {team.rank}: the launcher's "
                            "environment (RANK, WORLD_SIZE) and init_process_group's arguments disagree")
    else:
        from ._runtime import _subteam_shape
        group = team.subteam(*_subteam_shape(ranks, team.world_size, team.rank))
    return ProcessGroupWeft(group, opts.group_rank, opts.group_size)


def _multi_node_group(opts, ranks_given):
    """The default group of a job spanning nodes, on weft.init_multi_node()'s team."""
    team = _w._default_multi_node
    torch.cuda.set_device(team.device)
    if ranks_given and list(opts.global_ranks_in_group) != list(range(team.world_size)):
        raise WeftError("weft backend: groups of a job spanning nodes are not built yet: only the default group "
                        "(every rank) runs on weft; make other groups with backend='nccl'")
    if opts.group_size != team.world_size or opts.group_rank != team.rank:
        raise WeftError(f"weft: torch's rank {opts.group_rank} of {opts.group_size} is weft's {team.rank} of "
                        f"{team.world_size}: the launcher's environment and init_process_group's arguments disagree")
    return ProcessGroupWeftNodes(team, opts.group_rank, opts.group_size)


_REDUCIBLE = (torch.bfloat16, torch.float16, torch.float32)
# The event after this process's last weft collective on each device. weft's collectives of one rank run one
# at a time (they share the rank's workspace and meeting slots, and every rank must run them in one order),
# while torch's callers issue them from several streams (FSDP2: all-gathers and reduce-scatters on streams of
# their own, overlapping by design); so each call first makes its stream wait for the previous one, and the
# calls run in issue order, as NCCL's do on its one stream per communicator. weft's own ops called directly
# (weft.moe_layer, the fused matmuls, ...) on the same team are not ordered by it: they share the workspace
# and meeting slots, so run them on the stream of the backend's collectives, or on a sub-team of their own
# (a DeviceMesh dimension), not beside a collective on another stream. Under CUDA graph capture the order
# holds among the calls of one capture (a stream may wait only for events of its own capture): events are kept
# per (device, capture id; 0: none). A graph's replay is ordered against other weft calls by its caller.
_LAST = {}  # (device, capture id) -> event


def _capture_id():
    return _weft.capture_id(torch.cuda.current_stream().cuda_stream)


def _in_issue_order(method):
    """method, run on the caller's stream after every earlier weft collective of this process on the device."""
    def ordered(self, *args, **kwargs):
        last = _LAST.get((self.comm.device, _capture_id()))
        if last is not None:
            torch.cuda.current_stream().wait_event(last)
        return method(self, *args, **kwargs)

    ordered.__name__ = method.__name__
    return ordered


if dist.is_available():  # the classes' bases live in torch.distributed
    _REDUCE_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.MAX: "max",
                   dist.ReduceOp.MIN: "min"}  # torch's -> weft's (avg: the sum, divided)

    class Work(dist._Work):
        """A call queued on a stream: wait() makes the caller's current stream wait for it (barrier: the host)."""

        def __init__(self, result, host_wait=False):
            super().__init__()
            self._event = torch.cuda.Event()
            self._event.record()
            self._captured = _capture_id()
            _LAST[(torch.cuda.current_device(), self._captured)] = self._event
            self._host_wait = host_wait
            self._future = torch.futures.Future()
            self._future.set_result(result)

        def wait(self, timeout=None):
            if self._host_wait:
                self._event.synchronize()
            else:
                torch.cuda.current_stream().wait_event(self._event)
            return True

        def is_completed(self):
            return False if self._captured else self._event.query()  # (a captured event cannot be queried)

        def is_success(self):
            return True

        def get_future(self):
            return self._future

    class ProcessGroupWeft(dist.ProcessGroup):
        """A torch process group on a weft team or sub-team (comm)."""

        def __init__(self, comm, rank, size):
            super().__init__(rank, size)
            self.comm = comm  # the weft team (or sub-team) whose rank runs this process's part
            self.world = comm.world_size  # the group's ranks
            self._group_name, self._group_desc = "", ""

        def getBackendName(self):
            return BACKEND

        # torch names the group after creating it; with no C++ backend behind this group, the base class
        # would keep no name (and DeviceMesh, DTensor and FSDP2 read it).
        def setGroupName(self, name):
            self._group_name = name

        def getGroupName(self):
            return self._group_name

        def setGroupDesc(self, desc):
            self._group_desc = desc

        def getGroupDesc(self):
            return self._group_desc

        def __repr__(self):
            return f"ProcessGroupWeft(rank {self.comm.rank} of {self.comm.world_size})"

        # ---- checks -----------------------------------------------------------------------------------
        def _tensor(self, t, what):
            if not t.is_cuda or t.get_device() != self.comm.device:
                raise WeftValueError(f"weft backend: {what}: the tensor is on {t.device}, this rank's GPU is "
                                     f"cuda:{self.comm.device} (CPU tensors: a gloo group, "
                                     "dist.new_group(backend='gloo'))")
            if not t.is_contiguous():
                raise WeftValueError(f"weft backend: {what}: the tensor is not contiguous")
            return t

        def _op(self, reduce_op, t, what):
            for k, name in _REDUCE_OPS.items():
                if reduce_op == k:
                    break
            else:
                raise WeftValueError(f"weft backend: {what}: reduction {reduce_op} is not supported (sum, avg, "
                                     "max, min)")
            if t.dtype not in _REDUCIBLE:
                raise WeftValueError(f"weft backend: {what}: reductions take bf16, fp16 or fp32, got {t.dtype}")
            return name

        def _words(self, t, what):
            """t flat, as weft moves it: itself in bf16 / fp16 / fp32, else its bytes as 2-byte words."""
            flat = self._tensor(t, what).reshape(-1)
            if flat.dtype in _REDUCIBLE:
                return flat
            nbytes = flat.numel() * flat.element_size()
            if flat.data_ptr() % 2:
                raise WeftValueError(f"weft backend: {what}: a {flat.dtype} tensor at an odd address: the copying "
                                     "collectives move 2-byte words")
            if nbytes % 2:
                raise WeftValueError(f"weft backend: {what}: {flat.dtype} tensor of {nbytes} bytes: the copying "
                                     "collectives move 2-byte words (an even byte count)")
            return flat.view(torch.uint8).view(torch.float16)

        # ---- the transport: weft's collectives on the group's team (ProcessGroupWeftNodes: hierarchical) ----
        def _all_reduce(self, x, op, out):
            _w.all_reduce(x, op, out=out, comm=self.comm)

        def _all_gather(self, x, out):
            _w.all_gather(x, out=out, comm=self.comm)

        def _reduce_scatter(self, x, op, out):
            _w.reduce_scatter(x, op=op, out=out, comm=self.comm)

        def _broadcast(self, x, root):
            _w.broadcast(x, root=root, out=x, comm=self.comm)

        def _averaged(self, name, run, out):
            """run(op) with avg as the sum, then divided by the group's size."""
            run("sum" if name == "avg" else name)
            if name == "avg":
                out.div_(self.world)

        # ---- collectives --------------------------------------------------------------------------------
        @_in_issue_order
        def allreduce(self, tensors, opts=None):
            for t in tensors:
                name = self._op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, t, "all_reduce")
                x = self._tensor(t, "all_reduce").view(-1)
                self._averaged(name, lambda op: self._all_reduce(x, op, x), x)
            return Work(tensors)

        @_in_issue_order
        def allreduce_coalesced(self, tensors, opts=None):
            return self.allreduce(tensors, opts)

        @_in_issue_order
        def all_gather_single(self, output, input, opts=None):
            x = self._words(input, "all_gather_into_tensor")
            out = self._words(output, "all_gather_into_tensor")
            if out.numel() != x.numel() * self.world:
                raise WeftValueError(f"weft backend: all_gather_into_tensor: output has {output.numel()} elements, "
                                     f"expected {input.numel()} x {self.world}")
            self._all_gather(x, out)
            return Work([output])

        _allgather_base = all_gather_single

        @_in_issue_order
        def allgather(self, output_tensors, input_tensors, opts=None):
            for outs, x in zip(output_tensors, input_tensors):
                flat = torch.empty(x.numel() * self.world, dtype=x.dtype, device=x.device)
                self.all_gather_single(flat, x)
                for q, o in enumerate(outs):
                    o.copy_(flat[q * x.numel():(q + 1) * x.numel()].view(o.shape))
            return Work(output_tensors)

        @_in_issue_order
        def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
            for o, x in zip(outputs, inputs):
                self.all_gather_single(o, x)
            return Work(outputs)

        all_gather_single_coalesced = allgather_into_tensor_coalesced

        @_in_issue_order
        def reduce_scatter_single(self, output, input, opts=None):
            name = self._op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, input, "reduce_scatter_tensor")
            x = self._tensor(input, "reduce_scatter_tensor").view(-1)
            out = self._tensor(output, "reduce_scatter_tensor").view(-1)
            if x.numel() != out.numel() * self.world:
                raise WeftValueError(f"weft backend: reduce_scatter_tensor: input has {input.numel()} elements, "
                                     f"expected {output.numel()} x {self.world}")
            self._averaged(name, lambda op: self._reduce_scatter(x, op, out), out)
            return Work([output])

        _reduce_scatter_base = reduce_scatter_single

        @_in_issue_order
        def reduce_scatter(self, output_tensors, input_tensors, opts=None):
            for out, xs in zip(output_tensors, input_tensors):
                self.reduce_scatter_single(out, torch.cat([x.reshape(-1) for x in xs]), opts)
            return Work(output_tensors)

        @_in_issue_order
        def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
            for o, x in zip(outputs, inputs):
                self.reduce_scatter_single(o, x, opts)
            return Work(outputs)

        reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

        @_in_issue_order
        def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
            w = self.world
            self._tensor(input, "all_to_all_single")
            self._tensor(output, "all_to_all_single")
            if not output_split_sizes and not input_split_sizes:
                rows = input.shape[0] if input.dim() else 0
                if input.shape != output.shape or rows % w:
                    raise WeftValueError(f"weft backend: all_to_all_single: input {tuple(input.shape)} and output "
                                         f"{tuple(output.shape)}: equal splits need one shape, dim 0 divisible by {w}")
                x, out = self._words(input, "all_to_all_single"), self._words(output, "all_to_all_single")
                if x.numel() % w:
                    raise WeftValueError("weft backend: all_to_all_single: each rank's part has an odd byte count "
                                         "(the copying collectives move 2-byte words)")
                _w.all_to_all(x, out=out, comm=self.comm)
                return Work([output])
            rows_in, rows_out = input.shape[0] if input.dim() else 0, output.shape[0] if output.dim() else 0
            send = list(input_split_sizes) or [rows_in // w] * w
            recv = list(output_split_sizes) or [rows_out // w] * w
            if len(send) != w or len(recv) != w or sum(send) != rows_in or sum(recv) != rows_out:
                raise WeftValueError(f"weft backend: all_to_all_single: splits {send} / {recv} do not cut {rows_in} "
                                     f"/ {rows_out} rows into {w} parts")
            # Rows as 2-byte words (any dtype); all_to_all_v's out rows are one number on every rank: the
            # largest output over the group (a host read), through a bigger buffer where this rank's is smaller.
            if input.shape[1:] != output.shape[1:] or input.dtype != output.dtype:
                raise WeftValueError("weft backend: all_to_all_single: input and output rows differ in shape or dtype")
            words = self._words(input, "all_to_all_single")
            row_bytes = math.prod(input.shape[1:]) * input.element_size()
            if row_bytes % words.element_size():
                raise WeftValueError("weft backend: all_to_all_single: rows of an odd byte count (the copying "
                                     "collectives move 2-byte words)")
            row = row_bytes // words.element_size()  # words a row
            x = words.view(rows_in, row)
            bound = self._max_over_group(rows_out)
            counts = torch.tensor(send, dtype=torch.int64, device=input.device)
            if bound == rows_out:
                out = self._words(output, "all_to_all_single").view(rows_out, row)
                _w.all_to_all_v(x, counts, bound, out=out, comm=self.comm)
            else:
                out, _ = _w.all_to_all_v(x, counts, bound, comm=self.comm)
                self._words(output, "all_to_all_single").view(rows_out, row).copy_(out[:rows_out])
            return Work([output])

        alltoall_base = all_to_all_single

        @_in_issue_order
        def alltoall(self, output_tensors, input_tensors, opts=None):
            x = torch.cat([t.reshape(-1) for t in input_tensors])
            out = torch.empty(sum(t.numel() for t in output_tensors), dtype=x.dtype, device=x.device)
            self.all_to_all_single(out.view(-1, 1), x.view(-1, 1), [t.numel() for t in output_tensors],
                                   [t.numel() for t in input_tensors])
            first = 0
            for t in output_tensors:
                t.copy_(out[first:first + t.numel()].view(t.shape))
                first += t.numel()
            return Work(output_tensors)

        def _max_over_group(self, value):
            """The largest value over the group's ranks (a host read: all_to_all_v's out rows are one size)."""
            t = torch.tensor([int(value)], dtype=torch.int64, device=torch.device("cuda", self.comm.device))
            every = torch.empty(self.world, dtype=torch.int64, device=t.device)
            _w.all_gather(self._words(t, "all_to_all_single"), out=self._words(every, "all_to_all_single"),
                          comm=self.comm)
            return int(every.max().item())

        @_in_issue_order
        def broadcast(self, tensors, opts=None):
            root = opts.rootRank if opts is not None else 0
            for t in tensors:
                self._broadcast(self._words(t, "broadcast"), root)
            return Work(tensors)

        @_in_issue_order
        def reduce(self, tensors, opts=None):
            root = opts.rootRank if opts is not None else 0
            for t in tensors:
                name = self._op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, t, "reduce")
                x = self._tensor(t, "reduce").view(-1)
                got = _w.reduce(x, root=root, op="sum" if name == "avg" else name, comm=self.comm)
                if got is not None:
                    x.copy_(got)
                    if name == "avg":
                        x.div_(self.world)
            return Work(tensors)

        @_in_issue_order
        def gather(self, output_tensors, input_tensors, opts=None):
            root = opts.rootRank if opts is not None else 0
            x = self._words(input_tensors[0], "gather")
            got = _w.gather(x, root=root, comm=self.comm)
            if got is not None:
                for q, o in enumerate(output_tensors[0]):
                    self._words(o, "gather").copy_(got[q * x.numel():(q + 1) * x.numel()])
            return Work(output_tensors)

        @_in_issue_order
        def scatter(self, output_tensors, input_tensors, opts=None):
            root = opts.rootRank if opts is not None else 0
            out = self._words(output_tensors[0], "scatter")
            if self.comm.rank == root:
                x = torch.cat([self._words(t, "scatter") for t in input_tensors[0]])
            else:  # only the root's data is read; the others pass the shape
                x = torch.empty(out.numel() * self.world, dtype=out.dtype, device=out.device)
            _w.scatter(x, root=root, out=out, comm=self.comm)
            return Work(output_tensors)

        @_in_issue_order
        def barrier(self, opts=None):
            if _capture_id():
                raise WeftError("weft backend: barrier() waits on the host, which a CUDA graph capture cannot hold")
            t = torch.zeros(1, device=torch.device("cuda", self.comm.device))
            self._all_reduce(t, "sum", t)
            return Work([t], host_wait=True)

        def send(self, tensors, dst, tag=0):
            raise WeftError("weft backend: point-to-point send / recv is not supported: make an NCCL group for it "
                            "(dist.new_group(backend='nccl'))")

        def recv(self, tensors, src, tag=0):
            return self.send(tensors, src, tag)

        def recv_anysource(self, tensors, tag=0):
            return self.send(tensors, -1, tag)

    class ProcessGroupWeftNodes(ProcessGroupWeft):
        """The default group of a job spanning nodes (weft.MultiNodeTeam): all-reduce, all-gather, reduce-scatter,
        broadcast and the all-to-all of equal splits are the hierarchical ones (weft inside each node, NCCL between
        nodes); the rest is refused."""

        def __init__(self, team, rank, size):
            super().__init__(team.node, rank, size)  # comm: the node's team (this rank's GPU)
            self.team = team
            self.world = team.world_size

        def __repr__(self):
            return f"ProcessGroupWeftNodes(rank {self.team.rank} of {self.team.world_size}, {self.team.nodes} nodes)"

        def _not_built(self, what):
            raise WeftError(f"weft backend: {what} is not built for a job spanning nodes yet (all_reduce, "
                            "all_gather, reduce_scatter, broadcast, all_to_all_single of equal splits and barrier "
                            "are): make an NCCL group for it")

        def _all_reduce(self, x, op, out):
            self.team.all_reduce(x, op, out=out)

        def _all_gather(self, x, out):
            self.team.all_gather(x, out=out)

        def _reduce_scatter(self, x, op, out):
            self.team.reduce_scatter(x, op=op, out=out)

        def _broadcast(self, x, root):
            self.team.broadcast(x, root=root, out=x)

        @_in_issue_order
        def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
            """Equal splits only (the hierarchical all-to-all); given unequal splits are refused."""
            w = self.world
            rows = input.shape[0] if input.dim() else 0
            splits = list(input_split_sizes or []) + list(output_split_sizes or [])
            if input.shape != output.shape or rows % w or any(n != rows // w for n in splits):
                self._not_built(f"all_to_all_single with unequal splits or shapes (input {tuple(input.shape)}, "
                                f"output {tuple(output.shape)}, splits {splits})")
            x, out = self._words(input, "all_to_all_single"), self._words(output, "all_to_all_single")
            if x.numel() % w:
                raise WeftValueError("weft backend: all_to_all_single: each rank's part has an odd byte count "
                                     "(the copying collectives move 2-byte words)")
            self.team.all_to_all(x, out=out)
            return Work([output])

        alltoall_base = all_to_all_single

        def alltoall(self, *args, **kwargs):
            self._not_built("all_to_all (of tensor lists)")

        def reduce(self, *args, **kwargs):
            self._not_built("reduce")

        def gather(self, *args, **kwargs):
            self._not_built("gather")

        def scatter(self, *args, **kwargs):
            self._not_built("scatter")
