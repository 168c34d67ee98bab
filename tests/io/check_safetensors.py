#!/usr/bin/env python3
"""Reads safetensors files written by dparallel with nothing but the Python standard library
(json, struct), and has dparallel read a file written the way PyTorch tools write them.

    check_safetensors.py FIXTURE WORKDIR

FIXTURE is the dparallel_io_fixture program (tests/io/fixture.cpp). The script checks:
  1. the file layout: 8-byte little-endian header length, a JSON header padded with spaces to a
     multiple of 8 bytes, data offsets that tile the data section from 0 to the end of the file;
  2. the names (plain: the state dict was saved through a DataParallel wrapper, so no "module."),
     dtypes, shapes and values of every tensor, decoded here with struct;
  3. a checkpoint's __metadata__ scalars and its prefixed tensor names;
  4. the other direction: a file written here (names with "module.", keys out of data order, no
     padding, a scalar) loads into the C++ model with the right bytes; a truncated one is refused.
Exits non-zero with a message on the first failure.
"""
import json
import math
import os
import struct
import subprocess
import sys

FORMATS = {"F32": ("f", 4), "F64": ("d", 8), "F16": ("e", 2), "I32": ("i", 4), "I64": ("q", 8), "U8": ("B", 1)}
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def read_file(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header_bytes = blob[8 : 8 + n]
    header = json.loads(header_bytes.decode("utf-8"))
    return blob, n, header_bytes, header


def decode(dtype, raw):
    if dtype == "BF16":
        return [struct.unpack("<f", struct.pack("<I", h << 16))[0] for (h,) in struct.iter_unpack("<H", raw)]
    code, size = FORMATS[dtype]
    return list(struct.unpack("<%d%s" % (len(raw) // size, code), raw))


def tensors_of(path):
    blob, n, header_bytes, header = read_file(path)
    check(n % 8 == 0, "%s: header length %d is a multiple of 8" % (path, n))
    check(header_bytes.rstrip(b" ").endswith(b"}"), "%s: header padded with spaces only" % path)
    data = blob[8 + n :]
    meta = header.pop("__metadata__", {})
    spans = sorted((v["data_offsets"][0], v["data_offsets"][1], k) for k, v in header.items())
    pos = 0
    for begin, end, name in spans:
        check(begin == pos, "%s: tensor %s starts at %d, expected %d (contiguous)" % (path, name, begin, pos))
        pos = end
    check(pos == len(data), "%s: tensors cover %d of %d data bytes" % (path, pos, len(data)))
    out = {}
    for name, v in header.items():
        begin, end = v["data_offsets"]
        count = math.prod(v["shape"])
        size = 2 if v["dtype"] == "BF16" else FORMATS[v["dtype"]][1]
        check(end - begin == count * size, "%s: tensor %s size matches dtype and shape" % (path, name))
        out[name] = (v["dtype"], v["shape"], decode(v["dtype"], data[begin:end]))
    return meta, list(header.keys()), out


def expect_tensors(path, got, want):
    check(sorted(got) == sorted(want), "%s: names %s, expected %s" % (path, sorted(got), sorted(want)))
    for name, (dtype, shape, values) in want.items():
        if name not in got:
            continue
        g = got[name]
        check(g[0] == dtype, "%s: %s has dtype %s, expected %s" % (path, name, g[0], dtype))
        check(g[1] == shape, "%s: %s has shape %s, expected %s" % (path, name, g[1], shape))
        check(g[2] == values, "%s: %s has values %s, expected %s" % (path, name, g[2], values))


MODEL = {
    "encoder.fc.weight": ("F32", [3, 4], [0.25 * i - 1.5 for i in range(12)]),
    "encoder.fc.bias": ("F32", [3], [100.0, 101.0, 102.0]),
    "scale": ("F64", [2], [1.0 / 3.0, -2.5e300]),
    "steps": ("I64", [], [1234567890123]),
    "half": ("F16", [2, 2], [1.0, -2.0, 0.333251953125, math.inf]),
    "bhalf": ("BF16", [3], [1.0, -3.0, 3.140625]),
    "mask": ("U8", [5], [0, 1, 2, 254, 255]),
    "ids": ("I32", [3], [-7, 0, 2147483647]),
}
ORDER = ["encoder.fc.weight", "encoder.fc.bias", "scale", "steps", "half", "bhalf", "mask", "ids"]


def main():
    fixture, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    subprocess.run([fixture, "write", work], check=True)

    # 1-2: the state dict.
    state = os.path.join(work, "state.safetensors")
    meta, names, got = tensors_of(state)
    check(names == ORDER, "%s: tensors in parameters-then-buffers order: %s" % (state, names))
    check(meta == {"format": "pt", "source": "dparallel"}, "%s: metadata %s" % (state, meta))
    check(not any(n.startswith("module.") for n in names), "%s: no module. prefix" % state)
    expect_tensors(state, got, MODEL)

    # 3: the checkpoint.
    ckpt = os.path.join(work, "checkpoint.safetensors")
    meta, names, got = tensors_of(ckpt)
    check(meta == {"dparallel.checkpoint": "1", "epoch": "3", "step": "17", "sampler.epoch": "3",
                   "sampler.index": "40", "sampler.order": "torch", "seed": "1234", "user.note": "\u00fcnicode \u2713"},
          "%s: metadata %s" % (ckpt, meta))
    want = {"model." + k: v for k, v in MODEL.items()}
    want["optimizer.momentum.0"] = ("F32", [12], [0.5 * i for i in range(12)])
    want["optimizer.momentum.1"] = ("F32", [3], [-1.0, -2.0, -3.0])
    want["optimizer.momentum.2"] = ("F64", [2], [1e-300, 2.0])
    expect_tensors(ckpt, got, want)

    # 4: a file written the way a wrapped PyTorch model's state dict is saved.
    values = {
        "encoder.fc.weight": struct.pack("<12f", *[-0.5 * i for i in range(12)]),
        "encoder.fc.bias": struct.pack("<3f", 7.0, 8.0, 9.0),
        "scale": struct.pack("<2d", math.pi, -0.0),
        "steps": struct.pack("<q", -42),
        "half": struct.pack("<4e", 0.5, 0.25, -1.0, 65504.0),
        "bhalf": struct.pack("<3H", 0x4000, 0xBF80, 0x0000),
        "mask": bytes([9, 8, 7, 6, 5]),
        "ids": struct.pack("<3i", 1, -2, 3),
    }
    header, data = {"__metadata__": {"format": "pt"}}, b""
    for name in reversed(ORDER):  # data in reverse order; header keys in the other order below
        header["module." + name] = {"dtype": MODEL[name][0], "shape": MODEL[name][1],
                                    "data_offsets": [len(data), len(data) + len(values[name])]}
        data += values[name]
    header = dict(sorted(header.items()))
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    theirs = os.path.join(work, "torch_style.safetensors")
    with open(theirs, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)
    run = subprocess.run([fixture, "read", theirs], capture_output=True, text=True)
    check(run.returncode == 0, "fixture read %s: exit %d: %s" % (theirs, run.returncode, run.stderr))
    lines = run.stdout.split("\n")[:-1]
    check([l.split(" ")[0] for l in lines] == ORDER, "fixture read: names %s" % lines)
    for line in lines:
        name, hexbytes = line.split(" ")
        check(bytes.fromhex(hexbytes) == values[name], "fixture read: %s loaded as %s" % (name, hexbytes))

    truncated = os.path.join(work, "truncated.safetensors")
    with open(truncated, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data[:-3])
    run = subprocess.run([fixture, "read", truncated], capture_output=True, text=True)
    check(run.returncode == 1 and "dparallel:" in run.stderr and "truncated" in run.stderr,
          "fixture read of a truncated file: exit %d, %s" % (run.returncode, run.stderr.strip()))

    if failures:
        print("%d check(s) failed" % len(failures))
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
