"""The memory a spill of an aligned model adds: two random-init checkpoints with a published Pythia config (fp16,
written shard by shard, cached under --work), B under a random group element (a residual rotation included)
spilled to fp32 files the way a large merge does it, the process's RssAnon sampled every 50 ms.

    .venv/bin/python benchmarks/spill_memory.py --config 1b [--work runs/size]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from merge_size import PYTHIA, make_checkpoint  # noqa: E402

from hf_rebasin.core.symmetry import apply, random_transform  # noqa: E402
from hf_rebasin.sources.checkpoints import SpilledGraph, canonical_bytes  # noqa: E402
from hf_rebasin.sources.models import canonicalise, load  # noqa: E402

GIB = 2**30


def anonymous_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="1b", choices=sorted(PYTHIA))
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "size")
    args = parser.parse_args()
    folder = args.work / f"pythia-{args.config}-b"
    if not folder.exists():
        make_checkpoint(args.config, 2, folder)
    graph = canonicalise(load(str(folder)))
    moved = apply(graph, random_transform(graph.spec, seed=1))
    peak, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], anonymous_bytes())
            time.sleep(0.05)

    base = anonymous_bytes()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.work) as spill:
        SpilledGraph(moved, Path(spill) / "model")
        seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    print(f"pythia-{args.config}: spilled {canonical_bytes(graph) / GIB:.2f} GiB (fp32) in {seconds:.0f} s; "
          f"RssAnon before {base / GIB:.2f} GiB, peak {peak[0] / GIB:.2f} GiB, "
          f"the spill added {(peak[0] - base) / GIB:.2f} GiB")


if __name__ == "__main__":
    main()
