"""Compares dparallel's distributed_sampler (as printed by tests/sampler/torch_fixture) with
PyTorch's torch.utils.data.DistributedSampler over the same cases: every rank's indices, every
epoch, must be the same list. Exit 77 (CTest: skipped) when torch cannot be imported.

usage: check_torch.py <torch_fixture executable>
"""
import json
import subprocess
import sys

try:
    import torch
    from torch.utils.data import DistributedSampler
except ImportError as e:  # pragma: no cover - depends on the machine
    print(f"skipped: PyTorch is not importable ({e})")
    sys.exit(77)

cases = json.loads(subprocess.run([sys.argv[1]], check=True, capture_output=True, text=True).stdout)
failures = 0
for case in cases:
    for rank, got in enumerate(case["ranks"]):
        sampler = DistributedSampler(range(case["len"]), num_replicas=case["replicas"], rank=rank,
                                     shuffle=case["shuffle"], seed=case["seed"], drop_last=case["drop_last"])
        sampler.set_epoch(case["epoch"])
        want = list(sampler)
        if len(sampler) != len(got) or want != got:
            failures += 1
            if failures <= 5:
                print(f"differs: {dict((k, v) for k, v in case.items() if k != 'ranks')}, rank {rank}: "
                      f"PyTorch {want[:12]}... ({len(want)}), dparallel {got[:12]}... ({len(got)})")
print(f"{len(cases)} cases, {sum(len(c['ranks']) for c in cases)} rank lists compared with PyTorch "
      f"{torch.__version__}'s DistributedSampler: {failures} differ")
sys.exit(1 if failures else 0)
