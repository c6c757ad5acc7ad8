"""gloo over CUDA: zero_dtensor.collectives.all_to_all_into (host-staged) vs bare all_to_all_single."""
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp

def run(rank, world, bare, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533" if bare else "29534")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from zero_dtensor import collectives
    dev = torch.device("cuda", 0)
    n = 1 << 20
    inp = torch.arange(world * n, device=dev, dtype=torch.float32) + rank * 10**7
    out = torch.empty(world * n, device=dev, dtype=torch.float32)
    splits = [n] * world
    if bare:
        dist.all_to_all_single(out, inp, splits, splits)
    else:
        collectives.all_to_all_into(out, inp, splits, splits, dist.group.WORLD)
    want = torch.cat([torch.arange(rank * n, (rank + 1) * n, device=dev, dtype=torch.float32) + r * 10**7
                      for r in range(world)])
    q.put((rank, bool(torch.equal(out, want)), str(out.device)))
    dist.destroy_process_group()

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    for bare in (False, True):
        q = ctx.Queue()
        ps = [ctx.Process(target=run, args=(r, 2, bare, q)) for r in range(2)]
        [p.start() for p in ps]; [p.join(120) for p in ps]
        res = [q.get() for _ in range(q.qsize())] if not q.empty() else []
        print("bare" if bare else "staged", "exitcodes", [p.exitcode for p in ps], "results", res, flush=True)
