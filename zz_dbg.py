import sys, torch, weft
team = weft.virtual_team(2)
g = torch.Generator(device="cuda").manual_seed(1)
W=2; m,k,n=128,256,384
case = sys.argv[1]
def rel(x,y): return ((x.float()-y).norm()/y.norm()).item()
a=[torch.randn(m,k,device="cuda",dtype=torch.bfloat16,generator=g) for _ in range(W)]
wt=[torch.randn(n,k,device="cuda",dtype=torch.bfloat16,generator=g)*k**-0.5 for _ in range(W)]
if "before" in case:
    want=[torch.cat(a).float()@w.float().t() for w in wt]
if "warmalloc" in case:
    for s in team.streams:
        with torch.cuda.stream(s):
            t = torch.empty(64 << 20, dtype=torch.uint8, device="cuda"); del t
    torch.cuda.synchronize()
if "ar" in case:  # a collective first (no cuBLAS handle, allocations on the rank streams)
    team.run(lambda c, x: weft.all_reduce(x, comm=c), a); torch.cuda.synchronize()
fn = weft.all_gather_matmul if "mrs" not in case else None
o=team.run(lambda c,x,w: weft.all_gather_matmul(x,w.t(),comm=c), a, wt)
if "before" not in case:
    want=[torch.cat(a).float()@w.float().t() for w in wt]
try:
    torch.cuda.synchronize(); print(case, [round(rel(x,y),4) for x,y in zip(o,want)])
except Exception as e: print(case, "ERROR", str(e)[:200])
try: team.synchronize()
except Exception as e: print(case, "ERROR", str(e)[:150])
