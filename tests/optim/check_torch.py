"""Replays tests/optim/torch_fixture's runs with PyTorch's optimizers (SGD, Adam, AdamW) and
compares the parameters. Exit 77 (CTest: skipped) when torch cannot be imported. The tolerance is
a few f32 ulps: PyTorch's vectorised CPU kernels may fuse multiply-adds, which dparallel's rules
(and the scalar references of tests/test_optim.cpp) never do.

usage: check_torch.py <torch_fixture executable>
"""
import json
import subprocess
import sys

try:
    import torch
except ImportError as e:  # pragma: no cover - depends on the machine
    print(f"skipped: PyTorch is not importable ({e})")
    sys.exit(77)

runs = json.loads(subprocess.run([sys.argv[1]], check=True, capture_output=True, text=True).stdout)
failures = 0
for run in runs:
    p = torch.tensor(run["p0"], dtype=torch.float32, requires_grad=True)
    o = dict(run["options"])
    if run["rule"] == "sgd":
        opt = torch.optim.SGD([p], lr=run["lrs"][0], **o)
    elif run["rule"] == "adam":
        opt = torch.optim.Adam([p], lr=run["lrs"][0], betas=tuple(o["betas"]), eps=o["eps"],
                               weight_decay=o["weight_decay"], foreach=False)
    else:
        opt = torch.optim.AdamW([p], lr=run["lrs"][0], betas=tuple(o["betas"]), eps=o["eps"],
                                weight_decay=o["weight_decay"], foreach=False)
    for g, lr in zip(run["grads"], run["lrs"]):
        for group in opt.param_groups:
            group["lr"] = lr
        p.grad = torch.tensor(g, dtype=torch.float32)
        opt.step()
    want = torch.tensor(run["p"], dtype=torch.float32)
    diff = (p.detach() - want).abs()
    tol = 8 * torch.finfo(torch.float32).eps * torch.maximum(p.detach().abs(), want.abs()).clamp_min(1e-30)
    bad = int((diff > tol).sum())
    print(f"{run['rule']} {run['options']}: max |diff| {float(diff.max()):.3g}, "
          f"bitwise equal: {bool(torch.equal(p.detach(), want))}, beyond tolerance: {bad}")
    failures += bad != 0
sys.exit(1 if failures else 0)
