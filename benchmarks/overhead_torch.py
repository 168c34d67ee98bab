#!/usr/bin/env python3
"""PyTorch DDP's per-step overhead, measured the way benchmarks/overhead.cpp measures ours.

N processes (gloo over the loopback, CPU, one intra-op thread each) wrap a model of P parameters
holding G bytes of F32 in all in torch.nn.parallel.DistributedDataParallel. The step is a
forward whose loss touches one element of every parameter, an optional busy wait (wall time), and
backward (which fills every gradient and fires DDP's bucketed all-reduce). In the same round the
script also times
  local: the same forward, busy wait and backward on an unwrapped copy of the model (the compute);
  comm:  dist.all_reduce of DDP's bucket sizes (reverse parameter order, 1 MiB first bucket, then
         25 MiB caps), issued together and waited for.
overhead = ddp step - local step - comm. The median of --rounds rounds is reported, as CSV with
the columns devices,params,bytes,busy_us,torch_step_us,torch_local_us,torch_comm_us,torch_overhead_us.
"""

import argparse
import os
import statistics
import sys
import time

# torch.set_num_threads bounds PyTorch's own pool only: a PyTorch built on the system BLAS (Debian's,
# BLAS_INFO=generic) runs its GEMMs on OpenBLAS's threads, one per core unless these say otherwise.
# Set before torch (and its BLAS) is loaded, so "one thread" is one thread.
for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")


def busy(us):
    if us <= 0:
        return
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def buckets(sizes, first_cap=1 << 20, cap=25 << 20):
    """Element counts of DDP's buckets for parameters of `sizes` elements (F32), reverse order."""
    out, cur, limit = [], 0, first_cap
    for n in reversed(sizes):
        cur += n
        if cur * 4 >= limit:
            out.append(cur)
            cur, limit = 0, cap
    if cur:
        out.append(cur)
    return out


def worker(rank, world, args, port, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    import datetime

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))

    class Synthetic(torch.nn.Module):
        def __init__(self, params, nbytes):
            super().__init__()
            each = max(1, nbytes // 4 // params)
            self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.full((each,), 0.5 + i)) for i in range(params)])

        def forward(self):
            return sum(p[0] for p in self.ps)

    rows = []
    for params in args.params:
        for nbytes in args.bytes:
            for bu in args.busy_us:
                steps = max(10, min(args.steps, (64 << 20) // nbytes))
                warmup = max(2, min(args.warmup, steps // 4))
                local = Synthetic(params, nbytes)
                ddp = torch.nn.parallel.DistributedDataParallel(Synthetic(params, nbytes))
                sizes = [p.numel() for p in local.ps]
                bufs = [torch.full((n,), 0.25) for n in buckets(sizes)]

                def step_ddp():
                    loss = ddp()
                    busy(bu)
                    loss.backward()

                def step_local():
                    loss = local()
                    busy(bu)
                    loss.backward()

                def comm():
                    works = [dist.all_reduce(b, async_op=True) for b in bufs]
                    for w in works:
                        w.wait()

                def timed(fn):
                    for _ in range(warmup):
                        fn()
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        fn()
                    dist.barrier()
                    return (time.perf_counter() - t0) / steps

                s, l, c = [], [], []
                for _ in range(args.rounds):
                    s.append(timed(step_ddp))
                    l.append(timed(step_local))
                    c.append(timed(comm))
                med = [statistics.median(v) * 1e6 for v in (s, l, c)]
                rows.append((world, params, nbytes, bu, med[0], med[1], med[2], med[0] - med[1] - med[2]))
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",")]
    ap.add_argument("--params", type=ints, default=[1, 8])
    ap.add_argument("--bytes", type=ints, default=[1024, 65536, 1048576, 16777216])
    ap.add_argument("--devices", type=ints, default=[2, 4])
    ap.add_argument("--busy-us", type=ints, default=[0, 200])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--port", type=int, default=29571)
    ap.add_argument("--csv", default="")
    args = ap.parse_args()
    try:
        import torch
        import torch.multiprocessing as mp
    except ImportError:
        print("overhead_torch: PyTorch is not installed (Debian: python3-torch); skipped", file=sys.stderr)
        return 3

    ctx = mp.get_context("spawn")
    rows = []
    for i, world in enumerate(args.devices):
        queue = ctx.SimpleQueue()
        procs = [ctx.Process(target=worker, args=(r, world, args, args.port + i, queue)) for r in range(world)]
        for p in procs:
            p.start()
        # Rank 0 sends the rows; a rank that died instead must not leave this process waiting.
        while queue.empty():
            if any(p.exitcode not in (None, 0) for p in procs):
                print("overhead_torch: a rank failed", file=sys.stderr)
                for p in procs:
                    p.terminate()
                return 1
            time.sleep(0.2)
        rows += queue.get()
        for p in procs:  # the rows are in; a rank stuck in shutting gloo down is stopped
            p.join(timeout=60)
            if p.exitcode is None:
                p.terminate()
                p.join()
    cols = "devices,params,bytes,busy_us,torch_step_us,torch_local_us,torch_comm_us,torch_overhead_us"
    lines = [cols] + [",".join([str(r[0]), str(r[1]), str(r[2]), str(r[3])] + [f"{v:.1f}" for v in r[4:]]) for r in rows]
    print(f"# PyTorch {torch.__version__} DDP (gloo, CPU, 1 thread per rank) per-step overhead, median of "
          f"{args.rounds} rounds; load average {os.getloadavg()[0]:.2f}")
    widths = [max(len(x) for x in col) for col in zip(*[l.split(",") for l in lines])]
    for l in lines:
        print("  ".join(x.rjust(w) for x, w in zip(l.split(","), widths)))
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
