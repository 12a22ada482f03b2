"""SIGKILL a process writing evidence (records *and* their safetensors) at random moments.

Part of ``kv-sidecar bench reliability`` (and its ``--quick`` test) and of
tests/test_evidence_files.py. One long-lived parent imports torch once and forks a fresh
writer per cycle (a restart: each writer opens the directory like a sidecar starting); the
bench SIGKILLs the writer at a random moment and then checks the directory as a restart
sees it: every record complete and of its own number, its tensor file present and exactly
what the record says, no tensor file without its record, no ``.tmp`` left, nothing
acknowledged lost inside the retention window, at most ``capacity`` records and
``max_bytes`` bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvtestbed.bench.fuzz import FuzzResult

_PARENT = """
import os, sys
import torch
from sidecar.evidence.record import EvidenceLog, tensor_key
d, capacity, max_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for line in sys.stdin:
    run = int(line)
    pid = os.fork()
    if pid == 0:
        parent = os.getppid()
        try:
            log = EvidenceLog(capacity=capacity, directory=d, max_bytes=max_bytes)
            g = torch.Generator().manual_seed(run)
            i = 0
            while True:
                n = 1 + i % 7
                tensors = {tensor_key(0, n, side, part): torch.randn(2, 2, 16, 8 * n,
                                                                     generator=g)
                           for side in ("cached", "recomputed") for part in ("key", "value")}
                rec = log.add({"kind": "kill-test", "run": run, "i": i,
                               "pad": "x" * (i % 700)}, tensors)
                # One write per line: with PYTHONUNBUFFERED a print is several writes,
                # and a kill between them leaves half a line for the next one to join.
                os.write(1, f"{rec['seq']} {run} {i}\\n".encode())
                i += 1
                if os.getppid() != parent:  # the parent is gone (the bench stopped): stop
                    break
        finally:
            os._exit(0)
    os.write(1, f"pid {pid}\\n".encode())
    os.waitpid(pid, 0)
    os.write(1, b"done\\n")
"""


def kill_cycles(cycles: int, capacity: int = 50, seed: int = 0,
                max_bytes: int = 4 * 2**20) -> FuzzResult:
    """``cycles`` SIGKILLs of an evidence writer, each followed by the restart's check."""
    from sidecar.evidence.record import EvidenceLog

    rng = random.Random(seed)
    res = FuzzResult("evidence_sigkill", f"SIGKILL/restart cycles writing evidence records "
                                         f"with safetensors into one directory (capacity "
                                         f"{capacity}, {max_bytes} bytes)")
    seen: dict[int, tuple[int, int]] = {}  # seq -> (run, i) acknowledged by a writer
    recovered = discarded = 0  # leftovers of a kill mid-write, settled by the restart
    with tempfile.TemporaryDirectory(prefix="kvsidecar-kill-") as d:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        parent = subprocess.Popen([sys.executable, "-c", _PARENT, d, str(capacity),
                                   str(max_bytes)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, env=env, text=True)
        assert parent.stdin is not None and parent.stdout is not None
        writer = 0
        try:
            for run in range(cycles):
                res.cases += 1
                parent.stdin.write(f"{run}\n")
                parent.stdin.flush()
                acks = []
                line = parent.stdout.readline()
                while line and not line.startswith("pid "):
                    acks.append(line)
                    line = parent.stdout.readline()
                if not line:
                    raise RuntimeError("the evidence writer's parent died")
                writer = int(line.split()[1])
                time.sleep(rng.uniform(0.15, 0.5))
                os.kill(writer, signal.SIGKILL)
                for line in iter(parent.stdout.readline, "done\n"):
                    if not line:
                        raise RuntimeError("the evidence writer's parent died")
                    if line.endswith("done\n"):  # a line the kill cut short: not an ack
                        break
                    acks.append(line)
                writer = 0  # killed and reaped by the parent: its pid may be reused
                for ack in acks:
                    seq, r, i = (int(x) for x in ack.split())
                    if seq in seen and seen[seq] != (r, i):
                        res.lost += 1  # the same number acknowledged twice: an overwrite
                    seen[seq] = (r, i)
                log = EvidenceLog(capacity=capacity, directory=d, max_bytes=max_bytes)
                recovered += log.recovered
                discarded += log.discarded
                bad, ondisk, total = _check_dir(Path(d))
                for seq, who in ondisk.items():
                    if seq in seen and seen[seq] != who:
                        res.lost += 1  # an acknowledged record overwritten
                top = max(seen, default=0)
                window = [s for s in seen if s > top - capacity + 1]
                res.lost += sum(1 for s in window if s not in ondisk) + len(bad)
                if len(ondisk) <= capacity and total <= max_bytes and not bad \
                        and sorted(ondisk) == log.files:
                    res.survived += 1
        finally:
            if writer:  # a stop between the fork and the kill must not leave it writing
                with contextlib.suppress(OSError):
                    os.kill(writer, signal.SIGKILL)
            parent.stdin.close()
            parent.kill()
            parent.wait(timeout=30)
    res.tried += (f"; {len(seen)} records acknowledged, restarts recovered {recovered} and "
                  f"discarded {discarded} leftovers of a kill mid-write")
    return res


def _check_dir(d: Path) -> tuple[list[str], dict[int, tuple[int, int]], int]:
    """(bad files, seq -> (run, i) of each complete record, bytes on disk)."""
    from sidecar.evidence.safetensors_io import SafetensorsError, loads

    names = set(os.listdir(d))
    bad = [n for n in names if not n.endswith((".json", ".safetensors"))]
    ondisk: dict[int, tuple[int, int]] = {}
    total = 0
    for n in names:
        total += (d / n).stat().st_size
        if n.endswith(".safetensors") and n.removesuffix(".safetensors") + ".json" not in names:
            bad.append(n)  # tensors without their record
        if not n.endswith(".json"):
            continue
        try:
            rec = json.loads((d / n).read_text())
            ondisk[int(rec["seq"])] = (rec["run"], rec["i"])
            spec = rec["tensors"]
            data = (d / spec["file"]).read_bytes()
            tensors, _ = loads(data)
            if n != f"anomaly-{rec['seq']:08d}.json" or len(data) != spec["bytes"] \
                    or hashlib.sha256(data).hexdigest() != spec["sha256"] \
                    or sorted(tensors) != spec["names"]:
                bad.append(n)
        except (ValueError, KeyError, OSError, SafetensorsError):
            bad.append(n)  # a partial record, or one without its tensors
    return bad, ondisk, total
