#!/usr/bin/env python3
"""PyTorch's DDP on the workload of benchmarks/torch_adapter.cpp, for its ddp ratio.

--ranks processes (gloo over the loopback, CPU, one intra-op thread each) train the 784-512-ReLU-10
MLP (initialised from torch.manual_seed(1), as the C++ side's) wrapped in
torch.nn.parallel.DistributedDataParallel with plain SGD; the global batches are the C++ side's
(torch.manual_seed(7), then per batch randn(batch, 784) and randint(0, 10, (batch,))), rank r
taking the r-th equal slice. Runs --warmup untimed steps, times --steps steps and prints, from
rank 0, one line: samples_per_s=<global samples per second>.
"""
import argparse
import datetime
import os
import socket
import sys
import time

# torch.set_num_threads bounds PyTorch's own pool only: a PyTorch built on the system BLAS (Debian's,
# BLAS_INFO=generic) runs its GEMMs on OpenBLAS's threads, one per core unless these say otherwise.
# Set before torch (and its BLAS) is loaded, so "one thread" is one thread.
for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, args, port):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks, timeout=datetime.timedelta(seconds=600))
    torch.manual_seed(7)
    batches = [(torch.randn(args.batch, 784), torch.randint(0, 10, (args.batch,)))
               for _ in range(args.warmup + args.steps)]
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    per = args.batch // args.ranks
    start = 0.0
    for i, (x, y) in enumerate(batches):
        if i == args.warmup:
            dist.barrier()
            start = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
        loss.backward()
        opt.step()
    dist.barrier()
    seconds = time.perf_counter() - start
    if rank == 0:
        print("samples_per_s=%.6g" % (args.steps * args.batch / seconds), flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    import torch.multiprocessing as mp

    mp.start_processes(worker, args=(args, free_port()), nprocs=args.ranks, join=True, start_method="fork")
    return 0


if __name__ == "__main__":
    sys.exit(main())
