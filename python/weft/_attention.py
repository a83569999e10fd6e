"""Attention: flash_attention and its varlen form on one GPU; ring attention's sharding helpers; attention over
a sequence sharded across a team (context_attention and its ring / Ulysses / hybrid shorthands)."""
from __future__ import annotations

import functools
import math
from typing import Optional

import weft as _w
from . import _op_table, _weft
from ._args import _comm, _dim, _dtype_name, _torch_api, _torch_tensor
from ._errors import WeftTypeError, WeftValueError
from ._op_table import DTYPES, Tensor, _native, _stream, declare, torch

__all__ = ["flash_attention", "flash_attention_varlen", "ring_shard_indices", "ring_shard", "ring_unshard", "context_attention", "ring_attention", "ulysses_attention", "hybrid_attention", "flash_decode"]


# ---- one GPU, no communicator ---------------------------------------------------------------------------


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
    out, lse = _torch_flash_attention(q, k, v, bool(causal), scale, None, bool(deterministic))
    return (out, lse) if return_lse else out


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
        if x.dtype != torch.int32 or x.dim() != 1 or x.device != q.device:
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
    out, lse = _torch_flash_attention(q, k, v, bool(causal), scale, packed, bool(deterministic))
    return (out, lse) if return_lse else out


# ---- flash attention's torch operators (weft._op_table) ------------------------------------------------------


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


@declare("weft::flash_attention")
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


@declare("weft::flash_attention_backward")
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
    dq, dk, dv = _flash_attention_backward.op(dout.contiguous().to(q.dtype), q, k, v, out, lse, causal, scale,
                                              cu_q, cu_k, max_q, max_k, deterministic)
    return dq, dk, dv, None, None, None, None, None, None, None


_flash_attention.register_autograd(_flash_attention_backward_fn, setup_context=_flash_attention_setup)


def _torch_flash_attention(q, k, v, causal, scale, packed, deterministic):
    """packed: None, or (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k). Checked by the caller."""
    cu_q, cu_k, max_q, max_k = packed if packed is not None else (None, None, 0, 0)
    out, lse = _flash_attention.op(q.contiguous(), k.contiguous(), v.contiguous(), causal, scale, cu_q, cu_k,
                                   max_q, max_k, deterministic)
    return out, lse.detach()


# ---- ring attention's layout (sharding a sequence over a team) ---------------------------------------


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


def ring_shard_indices(world, rank, causal=True, seq_len=None, cu_seqlens=None, contiguous=False):
    """Positions in the (packed) sequence of the rows rank `rank` of `world` holds for ring attention.

    Each document (the whole sequence, or each of a packed batch given by cu_seqlens = [0, l0, l0 + l1, ...])
    is cut into parts differing by at most one token: with causal=True 2 * world parts, rank r holding parts r
    and 2 * world - 1 - r (zigzag: every rank gets equal causal work); else world parts, rank r holding part r
    (also with causal=True and contiguous=True: each rank a consecutive slice, as many training stacks shard;
    the causal work then grows with the rank). A rank's rows are its parts of document 0, then of document 1,
    ... Returns a list of ints.
    """
    docs = _ring_documents(seq_len, cu_seqlens)
    if world < 1 or not 0 <= rank < world:
        raise WeftValueError(f"ring_shard_indices: rank {rank} of a team of {world}")
    if any(n < 0 for n in docs):
        raise WeftValueError(f"ring_shard_indices: negative sequence length in {docs}")
    return _weft.ring_shard_tokens(docs, int(world), int(rank), bool(causal), bool(contiguous))


def ring_shard(x, world, rank, causal=True, dim=1, cu_seqlens=None, contiguous=False):
    """This rank's rows of the torch tensor x along `dim` (the sequence), in ring attention's layout
    (ring_shard_indices: zigzag when causal, unless contiguous). cu_seqlens: x holds a packed batch of
    documents along dim."""
    t = _torch_api()
    if t is None or not isinstance(x, t.Tensor):
        raise WeftTypeError("weft.ring_shard: x must be a torch tensor")
    d = _dim(dim, x.dim())
    idx = ring_shard_indices(world, rank, causal, seq_len=None if cu_seqlens is not None else x.shape[d],
                             cu_seqlens=cu_seqlens, contiguous=contiguous)
    if cu_seqlens is not None and (not idx or max(idx) >= x.shape[d]):
        raise WeftValueError(f"weft.ring_shard: cu_seqlens covers more tokens than x has along dim {d}")
    import torch
    return x.index_select(d, torch.tensor(idx, dtype=torch.long, device=x.device))


def ring_unshard(shards, causal=True, dim=1, cu_seqlens=None, contiguous=False):
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
                                 cu_seqlens=cu_seqlens, contiguous=contiguous)
        if len(idx) != x.shape[d]:
            raise WeftValueError(f"weft.ring_unshard: rank {r}'s shard has {x.shape[d]} rows along dim {d}, "
                                 f"the layout gives it {len(idx)}")
        out.index_copy_(d, torch.tensor(idx, dtype=torch.long, device=x.device), x)
    return out


# ---- sequence-parallel attention (a team; ring attention's layout) -------------------------------------
def context_attention(q, k, v, causal=False, method="all_gather", seq_len=None, cu_seqlens=None,
                      softmax_scale=None, return_lse=False, comm=None, ulysses_size=None, contiguous=False):
    """Attention over a sequence sharded across the team (context parallelism), with autograd.

    Every rank calls it with its shard in ring attention's layout (weft.ring_shard: zigzag when causal; with
    contiguous=True the contiguous causal shards of weft.ring_shard(..., contiguous=True): every method runs
    them, the ring with uneven work per rank).
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
    if contiguous and causal:
        method += "/contiguous"  # the layout travels in the method name (weft::AttentionOptions::contiguous_shards)
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
    out, lse = _torch_context_attention(flat(q), flat(k), flat(v), method, docs, bool(causal), scale, c)
    out = out.view(q.shape)
    return (out, lse) if return_lse else out


# ---- context_attention's torch operators (weft._op_table) ----------------------------------------------------


# A layout's sizes, the same every step of a training run: computed once (weft's host code builds the ring
# layout of every rank for them, ~15-20 us a call at 2 ranks).
@functools.lru_cache(maxsize=256)
def _context_workspace_bytes(method, world, docs, causal, heads, kv_heads, dim, backward):
    return _weft.context_attention_workspace_bytes(method, world, list(docs), causal, heads, kv_heads, dim, backward)


@functools.lru_cache(maxsize=256)
def _context_local_rows(world, rank, docs, causal, contiguous):
    return _weft.context_attention_local_rows(world, rank, list(docs), causal, contiguous)


def _context_rows_check(q, method, docs, causal, comm):
    c = _w._communicators[comm]
    rows = _context_local_rows(c.world_size, c.rank, tuple(docs), causal, method.endswith("/contiguous"))
    if q.shape[0] != rows:
        raise WeftValueError(f"weft.context_attention: rank {c.rank} of {c.world_size} holds {rows} rows of "
                             f"that layout, q has {q.shape[0]} (pass seq_len= when the global length is not "
                             "local_seq x world)")


@declare("weft::context_attention")
def _context_attention(q: Tensor, k: Tensor, v: Tensor, method: str, docs: list[int], causal: bool, scale: float,
                       comm: int) -> tuple[Tensor, Tensor]:
    _context_rows_check(q, method, docs, causal, comm)
    if _op_table.EMULATE:
        return torch.zeros_like(q), q.new_zeros((q.shape[1], q.shape[0]), dtype=torch.float32)
    native = _native(comm)
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty((heads, q.shape[0]), dtype=torch.float32, device=q.device)
    nbytes = _context_workspace_bytes(method, native.world_size, tuple(docs), causal, heads, kv_heads, dim,
                                                     False)
    ws = torch.empty(max(nbytes, 256), dtype=torch.uint8, device=q.device)
    _weft.context_attention_forward(native, method, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                    lse.data_ptr(), docs, heads, kv_heads, dim, ws.data_ptr(), nbytes,
                                    DTYPES[q.dtype], _stream(q), causal, scale)
    return out, lse


@_context_attention.register_fake
def _(q, k, v, method, docs, causal, scale, comm):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@declare("weft::context_attention_backward")
def _context_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                method: str, docs: list[int], causal: bool, scale: float,
                                comm: int) -> tuple[Tensor, Tensor, Tensor]:
    if _op_table.EMULATE:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    native = _native(comm)
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    nbytes = _context_workspace_bytes(method, native.world_size, tuple(docs), causal, heads, kv_heads, dim,
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
    dq, dk, dv = _context_attention_backward.op(dout.contiguous().to(q.dtype), q, k, v, out, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None, None


_context_attention.register_autograd(_context_attention_backward_fn, setup_context=_context_attention_setup)


def _torch_context_attention(q, k, v, method, docs, causal, scale, comm):
    """q, k, v [rows, heads, dim] (checked by the caller); returns (out, lse), lse not differentiable."""
    out, lse = _context_attention.op(q.contiguous(), k.contiguous(), v.contiguous(), method, list(docs), causal,
                                     scale, comm._id)
    return out, lse.detach()


def ring_attention(q, k, v, causal=False, seq_len=None, cu_seqlens=None, softmax_scale=None, return_lse=False,
                   comm=None, contiguous=False):
    """weft.context_attention with method="ring" (K / V travel to every rank while it computes)."""
    return context_attention(q, k, v, causal=causal, method="ring", seq_len=seq_len, cu_seqlens=cu_seqlens,
                             softmax_scale=softmax_scale, return_lse=return_lse, comm=comm, contiguous=contiguous)


def ulysses_attention(q, k, v, causal=False, seq_len=None, cu_seqlens=None, softmax_scale=None, return_lse=False,
                   comm=None, contiguous=False):
    """weft.context_attention with method="ulysses" (heads split over the ranks)."""
    return context_attention(q, k, v, causal=causal, method="ulysses", seq_len=seq_len, cu_seqlens=cu_seqlens,
                             softmax_scale=softmax_scale, return_lse=return_lse, comm=comm, contiguous=contiguous)


def hybrid_attention(q, k, v, ulysses_size, causal=False, seq_len=None, cu_seqlens=None, softmax_scale=None,
                     return_lse=False, comm=None, contiguous=False):
    """weft.context_attention with method="hybrid": Ulysses within groups of ulysses_size ranks, ring across."""
    return context_attention(q, k, v, causal=causal, method="hybrid", seq_len=seq_len, cu_seqlens=cu_seqlens,
                             softmax_scale=softmax_scale, return_lse=return_lse, comm=comm, ulysses_size=ulysses_size,
                             contiguous=contiguous)


def flash_decode(q, k_cache, v_cache, cache_seqlens, block_table=None, cache_offsets=None, seq_total=None,
                 causal=True, softmax_scale=None, return_lse=False, out_rank=None, comm=None):
    """Attention of q_len new tokens per sequence over a KV cache, on one GPU or split over the team
    (context-parallel decoding); flash_attn_with_kvcache's layouts, the new tokens' K / V already in the cache.

    q [batch, q_len, heads, dim] (the same on every rank); k_cache, v_cache this rank's part: contiguous
    [batch, max_local, kv_heads, dim], or paged [num_blocks, block_size, kv_heads, dim] with block_table int32
    [batch, max_blocks]; cache_seqlens int32 [batch]: the tokens of each sequence on this rank (any split, 0
    included). On a team, for causal masking among the new tokens: cache_offsets int32 [batch] (the global
    position of this rank's first token) and seq_total int32 [batch] (each sequence's whole length); a team of
    one needs neither. bf16 or fp16, dim 64 or 128, heads a multiple of kv_heads. The cache's capacity
    (max_local, or max_blocks x block_size) must be the same on every rank. Returns out (like q, the same on
    every rank), and with return_lse=True also the fp32 log-sum-exp [batch, q_len, heads]. out_rank=r: the result
    on rank r alone (the others push their partials there and merge nothing) and None on the others. A torch
    operator (torch.compile, CUDA graphs with changing lengths); no autograd. Runs on torch's current stream.
    """
    where = "weft.flash_decode"
    tensors = [q, k_cache, v_cache, cache_seqlens] + [t for t in (block_table, cache_offsets, seq_total) if t is not None]
    if not all(_torch_tensor(t) for t in tensors):
        raise WeftTypeError(f"{where}: q, the caches and the int32 tensors must be torch tensors")
    for t in tensors:
        if not t.is_cuda or t.device != q.device or not t.is_contiguous():
            raise WeftValueError(f"{where}: every tensor must be a contiguous CUDA tensor on q's device")
    if q.dtype not in (torch.bfloat16, torch.float16) or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise WeftTypeError(f"{where}: q and the caches must be bf16 or fp16, alike; got {q.dtype}, "
                            f"{k_cache.dtype}, {v_cache.dtype}")
    for name, t in (("cache_seqlens", cache_seqlens), ("block_table", block_table), ("cache_offsets", cache_offsets),
                    ("seq_total", seq_total)):
        if t is not None and t.dtype != torch.int32:
            raise WeftTypeError(f"{where}: {name} must be int32, got {t.dtype}")
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise WeftValueError(f"{where}: q must be [batch, q_len, heads, dim] and the caches 4-D alike, got "
                             f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    batch, q_len, heads, dim = q.shape
    if k_cache.shape[2] < 1 or k_cache.shape[3] != dim or heads % k_cache.shape[2]:
        raise WeftValueError(f"{where}: the caches' dim must be q's ({dim}) and heads a multiple of kv_heads, got "
                             f"{tuple(k_cache.shape)}")
    if block_table is not None:
        if block_table.dim() != 2 or block_table.shape[0] != batch:
            raise WeftValueError(f"{where}: block_table must be [batch, max_blocks], got {tuple(block_table.shape)}")
        max_local = block_table.shape[1] * k_cache.shape[1]
    else:
        if k_cache.shape[0] != batch:
            raise WeftValueError(f"{where}: a contiguous cache must be [batch, max_local, kv_heads, dim], got "
                                 f"{tuple(k_cache.shape)} for batch {batch}")
        max_local = k_cache.shape[1]
    for name, t in (("cache_seqlens", cache_seqlens), ("cache_offsets", cache_offsets), ("seq_total", seq_total)):
        if t is not None and tuple(t.shape) != (batch,):
            raise WeftValueError(f"{where}: {name} must be [batch], got {tuple(t.shape)}")
    if dim not in (64, 128):
        raise WeftValueError(f"{where}: dim must be 64 or 128, got {dim}")
    if softmax_scale is not None and not float(softmax_scale) > 0:
        raise WeftValueError(f"{where}: softmax_scale must be positive, got {softmax_scale}")
    c = _comm(comm)
    if c.world_size > 1 and causal and q_len > 1 and (cache_offsets is None or seq_total is None):
        raise WeftValueError(f"{where}: on a team of {c.world_size}, causal masking among {q_len} new tokens needs "
                             "cache_offsets and seq_total (each rank's part and the sequences' global lengths)")
    if q.device.index != c.device:
        raise WeftValueError(f"{where}: q is on cuda:{q.device.index} but this rank uses cuda:{c.device}")
    if out_rank is not None and (isinstance(out_rank, bool) or not isinstance(out_rank, int)
                                 or not 0 <= out_rank < c.world_size):
        raise WeftValueError(f"{where}: out_rank must be None (every rank) or a rank of the team (0.."
                             f"{c.world_size - 1}), got {out_rank!r}")
    scale = 1.0 / math.sqrt(dim) if softmax_scale is None else float(softmax_scale)
    out, lse = _torch_flash_decode(q, k_cache, v_cache, cache_seqlens, block_table, cache_offsets, seq_total,
                                   max_local, bool(causal), scale, c._id, -1 if out_rank is None else out_rank)
    if out_rank is not None and out_rank != c.rank:
        out = lse = None  # not written here
    return (out, lse) if return_lse else out


# ---- flash_decode's torch operator (weft._op_table; inference: no autograd) -----------------------------------
# The cache tensors pass as they are; block_table / offsets / seq_total may be absent (None).


@declare("weft::flash_decode")
def _flash_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, seqlens: Tensor, block_table: Optional[Tensor],
                  offsets: Optional[Tensor], seq_total: Optional[Tensor], max_local: int, causal: bool, scale: float,
                  comm: int, out_rank: int) -> tuple[Tensor, Tensor]:
    batch, q_len, heads, dim = q.shape
    out = torch.empty_like(q)
    lse = q.new_empty((batch, q_len, heads), dtype=torch.float32)
    if _op_table.EMULATE:
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


def _torch_flash_decode(q, k_cache, v_cache, seqlens, block_table, offsets, seq_total, max_local, causal, scale,
                        comm, out_rank=-1):
    """Arguments checked by the caller (weft.flash_decode). out_rank >= 0: out and lse written on that rank only
    (elsewhere their contents are undefined)."""
    return _flash_decode.op(q, k_cache, v_cache, seqlens, block_table, offsets, seq_total, max_local, causal,
                            scale, comm, out_rank)
