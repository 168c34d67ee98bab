#!/usr/bin/env python3
"""trace:merge: runs test_trace leaving its DDP traces in a folder, merges them with
scripts/merge-traces and checks the merged timeline: one process per rank (0 and 1), four steps
each, numbered 0..3, events in time order, every category one of step, compute, comm, wait, data.

    check_merged_trace.py <test_trace> <scripts/merge-traces> <work dir>
"""
import json
import os
import shutil
import subprocess
import sys

test, merge, work = sys.argv[1:4]
shutil.rmtree(work, ignore_errors=True)
env = dict(os.environ, DPARALLEL_TEST_TRACE_DIR=work)
subprocess.run([test, "trace: DP and DDP write a timeline of their steps per rank"], env=env, check=True)
subprocess.run([sys.executable, merge, work], check=True)
with open(os.path.join(work, "merged.trace.json"), encoding="utf-8") as f:
    doc = json.load(f)
assert doc["otherData"]["ranks"] == [0, 1], doc["otherData"]
timed = [e for e in doc["traceEvents"] if e["ph"] != "M"]
names = {(e["pid"], e["args"]["name"]) for e in doc["traceEvents"] if e["name"] == "process_name"}
assert names == {(0, "rank 0"), (1, "rank 1")}, names
assert [e["ts"] for e in timed] == sorted(e["ts"] for e in timed), "events out of time order"
assert all(e["cat"] in {"step", "compute", "comm", "wait", "data"} for e in timed)
for rank in (0, 1):
    steps = [e["args"]["step"] for e in timed if e["pid"] == rank and e["name"] == "step"]
    assert steps == [0, 1, 2, 3], (rank, steps)
print("trace:merge: ranks 0 and 1, 4 steps each, in time order")
