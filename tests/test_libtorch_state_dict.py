#!/usr/bin/env python3
"""A state dict written by dparallel's libtorch adapter loads into the Python module.

    test_libtorch_state_dict.py TEST_LIBTORCH WORKDIR

Runs TEST_LIBTORCH's hidden case "[.python]", which trains the C++ module (two linear layers, a
tanh and a buffer `scale`) for a few DataParallel steps and writes WORKDIR/net.safetensors (the
state dict, by dparallel::save_state_dict) and WORKDIR/io.safetensors (an input x and the C++
module's output on it). Then builds the same module in PyTorch, loads the state dict with
load_state_dict(strict=True) and checks that its output on x equals the C++ output. Exits 77
(reported as skipped) when PyTorch for Python is not installed (Debian: python3-torch).
"""
import json
import os
import struct
import subprocess
import sys

try:
    import torch
except ImportError:
    print("python3-torch is not installed: skipped (Debian: apt-get install python3-torch)")
    sys.exit(77)

DTYPES = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16, "BF16": torch.bfloat16,
          "I32": torch.int32, "I64": torch.int64, "U8": torch.uint8}


def load(path):
    """The tensors of a safetensors file, read with the standard library and torch.frombuffer."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    data = bytearray(blob[8 + n:])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        t = torch.frombuffer(data[begin:end], dtype=DTYPES[info["dtype"]]) if end > begin else torch.empty(0)
        out[name] = t.reshape(info["shape"]).clone()
    return out


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.fc2 = torch.nn.Linear(8, 3)
        self.register_buffer("scale", torch.full((3,), 0.5))

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))) * self.scale


def main():
    exe, work = sys.argv[1], sys.argv[2]
    env = dict(os.environ, DPARALLEL_TORCH_STATE_DIR=work)
    subprocess.run([exe, "[.python]"], env=env, check=True)
    state = load(os.path.join(work, "net.safetensors"))
    io = load(os.path.join(work, "io.safetensors"))
    net = Net().double()
    result = net.load_state_dict(state, strict=True)  # raises on a missing or unexpected name, or a wrong shape
    print("loaded:", sorted(state), result)
    with torch.no_grad():
        got = net(io["x"])
    if not torch.allclose(got, io["expected"], rtol=1e-12, atol=1e-12):
        print("FAIL: the Python module's output differs from the C++ module's:", (got - io["expected"]).abs().max())
        return 1
    print("the state dict loads into the Python module (strict) and gives the C++ module's output")
    return 0


if __name__ == "__main__":
    sys.exit(main())
