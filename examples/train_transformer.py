"""A small Llama-style decoder trained with weft's ops on a (context x tensor) DeviceMesh, beside the same
model in plain torch (torch.distributed + SDPA) on the same mesh, from the same weights and data.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    PYTHONPATH=build/python torchrun --nproc_per_node=4 examples/train_transformer.py [--tp 2] [--steps 50]
        [--layers 8] [--seq 2048] [--lr 0.02] [--emb-scale 1] [--csv FILE]
    CUDA_DEVICE_MAX_CONNECTIONS=32 PYTHONPATH=build/python python3 examples/train_transformer.py --ranks 4 ...
        (weft's model on 4 virtual ranks of one GPU against the torch models whole on it: correctness only)

The model: RMSNorm, RoPE, grouped-query attention (16 query heads, 4 KV heads, dim 128), SwiGLU MLPs, every
second layer a mixture of experts (8 experts, top 2, SwiGLU), tied embeddings; hidden 2048. bf16 compute,
fp32 master weights, SGD with momentum. Parallelism, mesh (cp, tp), world = cp x tp:
- context parallel over cp: each sequence in weft.ring_shard's zigzag layout (rank r of cp holds chunks r and
  2 cp - 1 - r), attention by weft.ring_attention; torch: the whole K / V all-gathered, SDPA with the mask of
  the global positions;
- tensor + sequence parallel over tp (Megatron's layout): activations split by rows between the blocks,
  column-parallel projections by weft.all_gather_matmul, row-parallel ones by weft.matmul_reduce_scatter;
  torch: all_gather + matmul and matmul + reduce_scatter (torch.distributed.nn.functional);
- expert parallel over tp: weft.moe_layer with the tp group; torch: every expert's weights all-gathered and
  each token's top 2 evaluated locally.
Gradients of weights replicated over a mesh dimension are all-reduced over it (both models alike).
A third model, the torch one in fp32, trains beside them from the same weights: the reference of both checks.
Checks: the loss of every step as close to the fp32 model's as the torch bf16 model's is (within BF16_SLACK
times its relative difference, or TOL where that is small: after a few steps of this loud training two bf16
models part by several percent, rounding alone); the gradients at step 0 of each parameter against the fp32
model's, as close as the torch bf16 model's (within BF16_SLACK times its error, or GRAD_TOL where that error is
small). At step 0 every model routes each token to the experts the fp32
model picks (its routing weights still its own): otherwise the tokens whose top 2 flip under bf16 rounding of
the router scores, a different set in each model, would dominate the gradients' difference. Then
tokens / s and memory of a training step of each, measured in turns. Rank 0 prints the tables; --csv
writes the loss curves and the throughput, which `scripts/plot_training.py FILE.csv FILE.png` draws.
"""
import argparse
import math
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.nn import functional as dnn

import weft

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 2048, 16, 4, 128, 5632
EXPERTS, TOP_K, EXPERT_FFN, VOCAB, BATCH = 8, 2, 1408, 8192, 2
MOMENTUM, TOL, GRAD_TOL, BF16_SLACK = 0.9, 2e-2, 5e-2, 1.25


def full_weights(layers, seed, emb_scale):
    """Every weight, whole, the same on every rank (fp32); the embedding (tied to the output) emb_scale times the
    others' 1 / sqrt(fan_in): its logits' spread at the start."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *shape, fan_in: torch.randn(*shape, device="cuda", generator=g) / math.sqrt(fan_in)
    w = {"emb": rnd(VOCAB, HIDDEN, fan_in=HIDDEN) * emb_scale, "norm": torch.ones(HIDDEN, device="cuda")}
    for i in range(layers):
        p = f"l{i}."
        w[p + "attn_norm"] = torch.ones(HIDDEN, device="cuda")
        w[p + "mlp_norm"] = torch.ones(HIDDEN, device="cuda")
        w[p + "wq"] = rnd(HEADS * HEAD_DIM, HIDDEN, fan_in=HIDDEN)
        w[p + "wk"] = rnd(KV_HEADS * HEAD_DIM, HIDDEN, fan_in=HIDDEN)
        w[p + "wv"] = rnd(KV_HEADS * HEAD_DIM, HIDDEN, fan_in=HIDDEN)
        w[p + "wo"] = rnd(HIDDEN, HEADS * HEAD_DIM, fan_in=HEADS * HEAD_DIM)
        if i % 2:
            w[p + "router"] = rnd(EXPERTS, HIDDEN, fan_in=HIDDEN)
            w[p + "up"] = rnd(EXPERTS, HIDDEN, 2 * EXPERT_FFN, fan_in=HIDDEN)  # [E, K, N]: gate, then up
            w[p + "down"] = rnd(EXPERTS, EXPERT_FFN, HIDDEN, fan_in=EXPERT_FFN)
        else:
            w[p + "w_gate"] = rnd(FFN, HIDDEN, fan_in=HIDDEN)
            w[p + "w_up"] = rnd(FFN, HIDDEN, fan_in=HIDDEN)
            w[p + "w_down"] = rnd(HIDDEN, FFN, fan_in=FFN)
    return w


def shard(w, tp, tp_rank):
    """This rank's parameters (fp32, requiring grad) and, per name, the mesh dimensions it is replicated over."""
    params, replicated = {}, {}
    for name, t in w.items():
        key = name.split(".")[-1]
        if key in ("wq", "wk", "wv", "w_gate", "w_up", "up", "down"):
            t = t.chunk(tp)[tp_rank]  # column-parallel: this rank's heads / columns; MoE: its experts
        elif key in ("wo", "w_down"):
            t = t.chunk(tp, dim=1)[tp_rank]  # row-parallel: this rank's input columns
        sharded = key in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "up", "down")
        params[name] = t.clone().requires_grad_()
        replicated[name] = ("cp",) if sharded else ("cp", "tp")
    return params, replicated


def rms_norm(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w).to(x.dtype)


def rope(x, pos):
    """x [batch, seq, heads, dim] rotated by the global positions pos [seq]."""
    half = HEAD_DIM // 2
    freq = 1.0 / (10000.0 ** (torch.arange(half, device=x.device, dtype=torch.float32) / half))
    ang = pos.float()[:, None] * freq[None, :]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x1, x2 = x.float()[..., :half], x.float()[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).to(x.dtype)


class Ops:
    """The communicating pieces of the model: weft's, or plain torch's on the same mesh."""

    def __init__(self, use_weft, tp, cp, sizes, tp_rank, positions, all_positions, dtype=torch.bfloat16):
        """tp, cp: the mesh dimensions' groups (process groups, or weft sub-teams of a virtual team), sizes their
        (tp, cp) sizes; a dimension of size 1 needs no group (the torch model on one GPU)."""
        self.weft, self.tp, self.cp = use_weft, tp, cp
        self.dtype = dtype  # of the activations and of the weights' copies the matmuls read
        (self.tp_size, self.cp_size), self.tp_rank = sizes, tp_rank
        self.pos, self.all_pos = positions, all_positions  # this cp rank's tokens' positions; every cp rank's
        self.routes, self.picked = {}, {}  # MoE layer -> expert ids: to use; chosen by the last forward

    @classmethod
    def on_mesh(cls, use_weft, mesh, positions, all_positions, dtype=torch.bfloat16):
        return cls(use_weft, mesh.get_group("tp"), mesh.get_group("cp"), (mesh.size(1), mesh.size(0)),
                   mesh.get_local_rank(1), positions, all_positions, dtype)

    def gather_matmul(self, x, w):  # [rows / tp, K] x [N / tp, K] -> [rows, N / tp]
        if self.weft:
            return weft.all_gather_matmul(x, w.t(), comm=self.tp)
        if self.tp_size == 1:
            return x @ w.t()
        return torch.cat(dnn.all_gather(x, group=self.tp)) @ w.t()

    def matmul_scatter(self, x, w):  # [rows, K / tp] x [N, K / tp] -> [rows / tp, N], summed over tp
        if self.weft:
            return weft.matmul_reduce_scatter(x, w.t(), comm=self.tp)
        if self.tp_size == 1:
            return x @ w.t()
        out = torch.empty(x.shape[0] // self.tp_size, w.shape[0], device=x.device, dtype=x.dtype)
        return dnn.reduce_scatter(out, list((x @ w.t()).chunk(self.tp_size)), group=self.tp)

    def attention(self, q, k, v):  # [batch, local_seq, heads, dim], this cp rank's tokens
        if self.weft:
            return weft.ring_attention(q, k, v, causal=True, comm=self.cp)
        gather = (lambda t: [t]) if self.cp_size == 1 else (lambda t: dnn.all_gather(t.contiguous(), group=self.cp))
        ks, vs = torch.cat(gather(k), 1), torch.cat(gather(v), 1)
        rep = q.shape[2] // k.shape[2]
        ks, vs = ks.repeat_interleave(rep, 2), vs.repeat_interleave(rep, 2)
        mask = self.pos[:, None] >= self.all_pos[None, :]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2),
                                           attn_mask=mask)
        return o.transpose(1, 2)

    def moe(self, h, ids, weights, up, down):  # h [rows / tp, H]; this rank's experts' weights
        if self.weft:
            return weft.moe_layer(h, ids, weights, up, down, EXPERTS, comm=self.tp)
        if self.tp_size == 1:
            ups, downs = up, down
        else:
            ups = torch.cat(dnn.all_gather(up.contiguous(), group=self.tp))
            downs = torch.cat(dnn.all_gather(down.contiguous(), group=self.tp))
        out = torch.zeros(h.shape, device=h.device, dtype=torch.float32)
        for e in range(EXPERTS):
            tok, slot = (ids == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            g = h[tok] @ ups[e]
            a = F.silu(g[:, :EXPERT_FFN]) * g[:, EXPERT_FFN:]
            out = out.index_add(0, tok, (a @ downs[e]).float() * weights[tok, slot, None])
        return out.to(h.dtype)


def forward(ops, p, tokens, layers):
    """This rank's part of the loss (sum over its tokens / every token of the team) and its token count.
    tokens [batch, local_seq] (this cp rank's, zigzag); rows split over tp between the blocks."""
    b, s = tokens.shape
    rows = b * s // ops.tp_size
    tp_rank = ops.tp_rank
    mine = tokens.reshape(-1)[tp_rank * rows:(tp_rank + 1) * rows]
    bf = lambda t: t.to(ops.dtype)
    emb = bf(p["emb"])
    x = emb[mine]  # [rows, H]
    for i in range(layers):
        pre = f"l{i}."
        h = rms_norm(x, p[pre + "attn_norm"])
        wqkv = torch.cat([bf(p[pre + n]) for n in ("wq", "wk", "wv")])
        qkv = ops.gather_matmul(h, wqkv).view(b, s, -1, HEAD_DIM)
        hq, hk = HEADS // ops.tp_size, KV_HEADS // ops.tp_size
        q, k, v = qkv[:, :, :hq], qkv[:, :, hq:hq + hk], qkv[:, :, hq + hk:]
        q, k = rope(q, ops.pos), rope(k, ops.pos)
        o = ops.attention(q.contiguous(), k.contiguous(), v.contiguous())
        x = x + ops.matmul_scatter(o.reshape(b * s, -1), bf(p[pre + "wo"]))
        h = rms_norm(x, p[pre + "mlp_norm"])
        if i % 2:
            probs = (h.float() @ p[pre + "router"].t()).softmax(-1)
            if i in ops.routes:  # the experts another model picked (step 0: the fp32 model's)
                ids = ops.routes[i]
                weights = probs.gather(-1, ids)
            else:
                weights, ids = probs.topk(TOP_K, -1)
                ops.picked[i] = ids
            weights = weights / weights.sum(-1, keepdim=True)
            x = x + ops.moe(h, ids, weights, bf(p[pre + "up"]), bf(p[pre + "down"]))
        else:
            gate, up = ops.gather_matmul(h, torch.cat([bf(p[pre + "w_gate"]), bf(p[pre + "w_up"])])).chunk(2, -1)
            x = x + ops.matmul_scatter(F.silu(gate) * up, bf(p[pre + "w_down"]))
    logits = (rms_norm(x, p["norm"]) @ emb.t()).float()
    # Next-token targets: each token's successor in the global sequence (the last position predicts token 0).
    targets = ops.targets.reshape(-1)[tp_rank * rows:(tp_rank + 1) * rows]
    return F.cross_entropy(logits, targets, reduction="sum") / ops.team_tokens


def sync_grads(params, replicated, mesh):
    for name, t in params.items():
        for dim in replicated[name]:
            if mesh.size(mesh.mesh_dim_names.index(dim)) > 1:
                dist.all_reduce(t.grad, group=mesh.get_group(dim))


def step(params, momentum, lr):
    with torch.no_grad():
        for name, t in params.items():
            m = momentum.get(name)
            if m is None:
                m = momentum[name] = torch.zeros_like(t)
            m.mul_(MOMENTUM).add_(t.grad)
            t -= lr * m
            t.grad = None


def worse(worst, *errors):
    """The largest error over its limit so far; NaN sticks."""
    for e in (worst, *errors):
        if e != e:
            return float("nan")
    return max(worst, *errors)


def check_gradients(grads, rank):
    """Each parameter's step-0 gradient, weft's and torch's bf16 model's, against the fp32 model's (relative
    Frobenius, max over ranks); the largest of weft's errors over its limit, max(GRAD_TOL, BF16_SLACK x torch's).
    Rank 0 prints the parameters nearest their limits."""
    ref, rows = grads["fp32"], []
    for n in ref:
        den = ref[n].float().norm().clamp_min(1e-30)
        ew, et = [((grads[m][n].float() - ref[n].float()).norm() / den).item() for m in ("weft", "torch")]
        # (a NaN goes as inf: NCCL's max may pass over a NaN)
        ew, et = [team_value(float("inf") if e != e else e, dist.ReduceOp.MAX) for e in (ew, et)]
        rows.append((ew / max(GRAD_TOL, BF16_SLACK * et), n, ew, et))
    rows.sort(reverse=True)
    if rank == 0:
        print("gradients at step 0 against the fp32 model (relative error; the parameters nearest their limits):")
        for ratio, n, ew, et in rows[:4]:
            print(f"  {n}: weft {ew:.2e}, torch bf16 {et:.2e}, {ratio:.2f} of the limit")
    return rows[0][0]


def team_value(x, op=dist.ReduceOp.SUM):
    t = torch.tensor([float(x)], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.item()


def data(seq, cp, cp_rank, seed):
    """The batch's tokens (this cp rank's zigzag part) and their next-token targets, the same on every rank."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    # A learnable sequence: counting up from a random start (mod VOCAB), a tenth of the tokens noise.
    start = torch.randint(0, VOCAB, (BATCH, 1), device="cuda", generator=g)
    whole = (start + torch.arange(seq, device="cuda")) % VOCAB
    noise = torch.randint(0, VOCAB, (BATCH, seq), device="cuda", generator=g)
    whole = torch.where(torch.rand(BATCH, seq, device="cuda", generator=g) < 0.1, noise, whole)
    targets = whole.roll(-1, 1)
    return weft.ring_shard(whole, cp, cp_rank, causal=True), weft.ring_shard(targets, cp, cp_rank, causal=True)


def timed_step(fn, reps=5):
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return team_value(statistics.median(times), dist.ReduceOp.MAX)


def virtual_rows(cp, tp, cp_rank, tp_rank, seq):
    """Rank (cp_rank, tp_rank)'s rows as rows of the whole batch (b * seq + position): its zigzag part, then its
    tp share of those rows (forward's split)."""
    pos = torch.tensor(weft.ring_shard_indices(cp, cp_rank, causal=True, seq_len=seq), device="cuda")
    rows = (torch.arange(BATCH, device="cuda")[:, None] * seq + pos[None, :]).reshape(-1)
    n = rows.numel() // tp
    return pos, rows[tp_rank * n:(tp_rank + 1) * n]


def sum_replicas(ranks, cp, tp):
    """The virtual team's sync_grads: a weight replicated over a mesh dimension gets the sum of its replicas'
    gradients over that dimension (rank r = cp_rank x tp + tp_rank)."""
    for name in ranks[0][0]:
        for dim in ranks[0][1][name]:
            size, groups = (tp, [[c * tp + t for t in range(tp)] for c in range(cp)]) if dim == "tp" else \
                (cp, [[c * tp + t for c in range(cp)] for t in range(tp)])
            if size == 1:
                continue
            for members in groups:
                total = sum(ranks[r][0][name].grad for r in members)
                for r in members:
                    ranks[r][0][name].grad = total.clone()


def train_virtual(args):
    """--ranks W: weft's model on W virtual ranks of this GPU (the mesh's dimensions weft sub-teams: tp the
    consecutive ranks, cp the ranks tp apart), the torch models (bf16 and the fp32 reference) whole on the same
    GPU: the same function of the same weights and data, split differently (rounding aside). Losses and step-0
    gradients checked as in the distributed run; no throughput (the ranks share one GPU). Returns the worst
    difference over its limit."""
    world = args.ranks
    tp = min(args.tp, world)
    if world % tp or KV_HEADS % tp or EXPERTS % tp or args.seq % 2 or BATCH * args.seq % tp:
        raise SystemExit(f"--tp {tp} must divide --ranks {world}, {KV_HEADS} and {EXPERTS}; --seq even")
    cp = world // tp
    seq = args.seq * cp
    team = weft.virtual_team(world)
    w = full_weights(args.layers, seed=1, emb_scale=args.emb_scale)
    ranks = []  # (params, replicated, ops, momentum, rows of the whole batch)
    for r in range(world):
        cp_rank, tp_rank = divmod(r, tp)
        pos, rows = virtual_rows(cp, tp, cp_rank, tp_rank, seq)
        params, replicated = shard(w, tp, tp_rank)
        ops = Ops(True, team[r].subteam(tp, 1), team[r].subteam(cp, tp), (tp, cp), tp_rank, pos, None)
        ops.team_tokens = BATCH * seq
        ranks.append((params, replicated, ops, {}, rows))
    whole = torch.arange(seq, device="cuda")
    models = {}
    for name in ("fp32", "torch"):
        ops = Ops(False, None, None, (1, 1), 0, whole, whole, torch.float32 if name == "fp32" else torch.bfloat16)
        ops.team_tokens = BATCH * seq
        models[name] = (shard(w, 1, 0)[0], ops, {})
    del w
    fwd = lambda c, params, ops, tokens: forward(ops, params, tokens, args.layers)  # noqa: E731
    print(f"# train_transformer: {world} virtual ranks of one GPU ({torch.cuda.get_device_name()}), mesh cp {cp} "
          f"x tp {tp}, {args.layers} layers, hidden {HIDDEN}, batch {BATCH} x {seq} tokens (correctness only)")
    print("| step | loss, weft | loss, torch | loss, fp32 | weft - fp32, relative | torch - fp32, relative |")
    print("|---:|---:|---:|---:|---:|---:|")
    worst = 0.0
    for it in range(args.steps):
        tokens, targets = data(seq, 1, 0, seed=1000 + it)
        losses, grads = {}, {}
        for name, (params, ops, momentum) in models.items():  # fp32 first: step 0 routes by it
            ops.targets = targets
            ops.routes = models["fp32"][1].picked if it == 0 and name != "fp32" else {}
            loss = forward(ops, params, tokens, args.layers)
            loss.backward()
            losses[name] = loss.item()
            grads[name] = {n: t.grad.detach().clone() for n, t in params.items()} if it == 0 else None
            step(params, momentum, args.lr)
        parts = [data(seq, cp, r // tp, seed=1000 + it) for r in range(world)]
        picked = models["fp32"][1].picked
        for r, (params, _, ops, _, rows) in enumerate(ranks):
            ops.targets = parts[r][1]
            ops.routes = {i: ids[rows] for i, ids in picked.items()} if it == 0 else {}
        args_of = ([x[0] for x in ranks], [x[2] for x in ranks], [p[0] for p in parts])
        if it == 0:
            team.warmup(fwd, *args_of)
            for params, *_ in ranks:
                for t in params.values():
                    t.grad = None
        loss = sum(team.run(fwd, *args_of))
        loss.backward()
        torch.cuda.synchronize()
        sum_replicas(ranks, cp, tp)
        losses["weft"] = loss.item()
        if it == 0:
            worst = worse(worst, virtual_gradients(ranks, grads, tp))
        for params, _, _, momentum, _ in ranks:
            step(params, momentum, args.lr)
        ref = losses["fp32"]
        dw, dt = [abs(losses[m] - ref) / abs(ref) for m in ("weft", "torch")]
        worst = worse(worst, dw / max(TOL, BF16_SLACK * dt))
        if it < 5 or it % 5 == 4 or it == args.steps - 1:
            print(f"| {it} | {losses['weft']:.4f} | {losses['torch']:.4f} | {ref:.4f} | {dw:.2e} | {dt:.2e} |")
    return worst


def virtual_gradients(ranks, grads, tp):
    """check_gradients for the virtual team: every rank's step-0 gradient against the same shard of the whole
    fp32 model's, beside the torch bf16 model's shard; the largest error over its limit (max over ranks)."""
    rows = []
    with torch.no_grad():
        for r, (params, *_) in enumerate(ranks):
            rows += gradient_errors(params, shard(grads["fp32"], tp, r % tp)[0], shard(grads["torch"], tp, r % tp)[0],
                                    r)
    rows.sort(reverse=True)
    print("gradients at step 0 against the fp32 model (relative error; the parameters nearest their limits):")
    for ratio, n, r, ew, et in rows[:4]:
        print(f"  {n} (rank {r}): weft {ew:.2e}, torch bf16 {et:.2e}, {ratio:.2f} of the limit")
    return rows[0][0]


def gradient_errors(params, want, theirs, r):
    """(error over its limit, name, rank, weft's error, torch bf16's) of each of rank r's parameters."""
    rows = []
    for n, t in params.items():
        den = want[n].norm().clamp_min(1e-30)
        ew = ((t.grad.float() - want[n]).norm() / den).item()
        et = ((theirs[n].float() - want[n]).norm() / den).item()
        ew = float("inf") if ew != ew else ew
        rows.append((ew / max(GRAD_TOL, BF16_SLACK * et), n, r, ew, et))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048, help="tokens of each sequence per cp rank")
    ap.add_argument("--lr", type=float, default=0.02, help="SGD's learning rate (momentum 0.9)")
    ap.add_argument("--emb-scale", type=float, default=1.0,
                    help="the embedding's scale: the logits' spread at the start (1: loss ~ ln(vocab))")
    ap.add_argument("--csv", help="the loss curves and tokens / s (scripts/plot_training.py draws them)")
    ap.add_argument("--ranks", type=int, help="W virtual ranks of one GPU instead of torchrun's processes "
                    "(correctness only)")
    args = ap.parse_args()
    if args.ranks is not None:
        worst = train_virtual(args)
        print(f"worst loss / gradient difference over its limit: {worst:.2f} (passes <= 1)")
        if not worst <= 1.0:
            print("FAILED: weft's model is further from the fp32 one than torch's bf16 model is", flush=True)
            sys.exit(1)
        return
    comm = weft.init()
    torch.cuda.set_device(comm.device)
    dist.init_process_group("nccl", device_id=torch.device("cuda", comm.device))
    world, rank = dist.get_world_size(), dist.get_rank()
    tp = min(args.tp, world)
    if world % tp or KV_HEADS % tp or EXPERTS % tp:
        raise SystemExit(f"--tp {tp} must divide the world size {world}, {KV_HEADS} KV heads and {EXPERTS} experts")
    if args.seq % 2 or BATCH * args.seq % tp:
        raise SystemExit(f"--seq {args.seq} must be even (the zigzag's two chunks) and BATCH x seq divisible by tp")
    cp = world // tp
    mesh = init_device_mesh("cuda", (cp, tp), mesh_dim_names=("cp", "tp"))
    cp_rank, tp_rank = mesh.get_local_rank(0), mesh.get_local_rank(1)
    seq = args.seq * cp
    pos = torch.tensor(weft.ring_shard_indices(cp, cp_rank, causal=True, seq_len=seq), device="cuda")
    all_pos = torch.cat([torch.tensor(weft.ring_shard_indices(cp, r, causal=True, seq_len=seq), device="cuda")
                         for r in range(cp)])
    w = full_weights(args.layers, seed=1, emb_scale=args.emb_scale)
    models = {}
    for name in ("fp32", "weft", "torch"):  # fp32 first: step 0 routes by it
        params, replicated = shard(w, tp, tp_rank)
        ops = Ops.on_mesh(name == "weft", mesh, pos, all_pos, torch.float32 if name == "fp32" else torch.bfloat16)
        ops.team_tokens = BATCH * seq
        models[name] = (params, replicated, ops, {})
    reference = models["fp32"]
    del w
    if rank == 0:
        print(f"# train_transformer: {world} GPUs ({torch.cuda.get_device_name()}), mesh cp {cp} x tp {tp}, "
              f"{args.layers} layers, hidden {HIDDEN}, batch {BATCH} x {seq} tokens")
        print("| step | loss, weft | loss, torch | loss, fp32 | weft - fp32, relative | torch - fp32, relative |")
        print("|---:|---:|---:|---:|---:|---:|")
    curves, worst, first_grads = [], 0.0, {}
    for it in range(args.steps):
        tokens, targets = data(seq, cp, cp_rank, seed=1000 + it)
        losses = {}
        # Step 0: the fp32 reference first; its routing is every model's at this step.
        for name, (params, replicated, ops, momentum) in models.items():
            ops.targets = targets
            ops.routes = reference[2].picked if it == 0 and name != "fp32" else {}
            loss = forward(ops, params, tokens, args.layers)
            loss.backward()
            sync_grads(params, replicated, mesh)
            losses[name] = team_value(loss.item())
            if it == 0:
                first_grads[name] = {n: t.grad.detach().clone() for n, t in params.items()}
            step(params, momentum, args.lr)
        if it == 0:
            worst = worse(worst, check_gradients(first_grads, rank))
            first_grads = None
        ref = losses["fp32"]
        dw, dt = [abs(losses[m] - ref) / abs(ref) for m in ("weft", "torch")]
        worst = worse(worst, dw / max(TOL, BF16_SLACK * dt))
        curves.append((it, losses["weft"], losses["torch"], ref))
        if rank == 0 and (it < 5 or it % 5 == 4 or it == args.steps - 1):
            print(f"| {it} | {losses['weft']:.4f} | {losses['torch']:.4f} | {ref:.4f} | {dw:.2e} | {dt:.2e} |")
    # Throughput and peak memory of one training step of each, in turns.
    tokens, targets = data(seq, cp, cp_rank, seed=7)
    perf = {}
    for _ in range(2):
        for name, (params, replicated, ops, momentum) in models.items():
            if name == "fp32":
                continue
            ops.targets = targets

            def one():
                forward(ops, params, tokens, args.layers).backward()
                sync_grads(params, replicated, mesh)
                step(params, momentum, args.lr)

            torch.cuda.reset_peak_memory_stats()
            secs = timed_step(one)
            peak = team_value(torch.cuda.max_memory_allocated() / 2**30, dist.ReduceOp.MAX)
            free, total = torch.cuda.mem_get_info()
            used = team_value((total - free) / 2**30, dist.ReduceOp.MAX)
            perf[name] = (BATCH * seq / secs, peak, used)
    if rank == 0:
        # torch's allocator does not see weft's symmetric heap (cuMemCreate) nor NCCL's buffers: the device's
        # memory in use after the step is printed beside it (both models' weights live in this process).
        print("| model | tokens / s (team) | torch allocator peak GiB | device memory in use GiB (max over ranks) |")
        print("|---|---:|---:|---:|")
        for name, (tps, peak, used) in perf.items():
            print(f"| {name} | {tps:,.0f} | {peak:.1f} | {used:.1f} |")
        print(f"weft / torch throughput: {perf['weft'][0] / perf['torch'][0]:.2f}x; worst loss / gradient difference "
              f"over its limit: {worst:.2f} (passes <= 1)")
        if args.csv:
            with open(args.csv, "w") as f:
                f.write(f"# run: cp {cp} x tp {tp}, {world} GPUs, {args.layers} layers, seq {args.seq}, "
                        f"lr {args.lr}, emb-scale {args.emb_scale}\n")
                f.write("# tokens_per_s: " + ",".join(f"{n}={v[0]:.0f}" for n, v in perf.items()) + "\n")
                f.write("step,loss_weft,loss_torch,loss_fp32\n")
                f.writelines(f"{s},{a},{b},{c}\n" for s, a, b, c in curves)
    dist.destroy_process_group()
    if not worst <= 1.0:
        print("FAILED: weft's model is further from the fp32 one than torch's bf16 model is", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
