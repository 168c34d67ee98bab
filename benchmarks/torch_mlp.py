#!/usr/bin/env python3
"""PyTorch's one-thread throughput on the reference workload, for `scaling --modes ...,torch`.

The same model as examples/mlp.hpp (784-512-ReLU-10, softmax cross-entropy, mean over the batch),
the same data (Fashion-MNIST's training images scaled to [0, 1], global batch j being rows
[(j mod (n / b)) * b, ... + b)) and plain SGD, on one intra-op thread. Runs --warmup untimed steps,
then times --steps steps and prints one line: samples_per_s=<float> cpu_per_sample=<float>.
With --device cuda (scripts/gpu-check) the model runs on the GPU, its batches copied there each
step from host memory (as the example's loader does), or held there throughout with --data-on-device.
"""

import argparse
import gzip
import os
import sys
import time

# torch.set_num_threads bounds PyTorch's own pool only: a PyTorch built on the system BLAS (Debian's,
# BLAS_INFO=generic) runs its GEMMs on OpenBLAS's threads, one per core unless these say otherwise.
# Set before torch (and its BLAS) is loaded, so "one thread" is one thread.
for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")


def load(folder):
    import numpy as np

    with gzip.open(os.path.join(folder, "train-images-idx3-ubyte.gz"), "rb") as f:
        images = np.frombuffer(f.read(), dtype=np.uint8, offset=16).reshape(-1, 784).astype(np.float32) / 255.0
    with gzip.open(os.path.join(folder, "train-labels-idx1-ubyte.gz"), "rb") as f:
        labels = np.frombuffer(f.read(), dtype=np.uint8, offset=8).astype(np.int64)
    return images, labels


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--data-on-device", action="store_true")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(1)
    images, labels = load(args.data)
    x_all, y_all = torch.from_numpy(images), torch.from_numpy(labels)
    model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).to(args.device)
    if args.data_on_device:
        x_all, y_all = x_all.to(args.device), y_all.to(args.device)
    elif args.device != "cpu":
        x_all, y_all = x_all.pin_memory(), y_all.pin_memory()
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    b, batches = args.batch, x_all.shape[0] // args.batch

    def step(j):
        start = (j % batches) * b
        x, y = x_all[start:start + b], y_all[start:start + b]
        x, y = x.to(args.device, non_blocking=True), y.to(args.device, non_blocking=True)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for j in range(args.warmup):
        step(j)
    sync()
    cpu0, t0 = time.process_time(), time.perf_counter()
    for j in range(args.warmup, args.warmup + args.steps):
        step(j)
    sync()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    samples = args.steps * b
    print(f"samples_per_s={samples / wall:.3f} cpu_per_sample={cpu / samples:.9g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
