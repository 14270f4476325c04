"""The memory plan's estimate (hf_rebasin/match/memory_plan.py) against the count of the project's own dual step on fake
tensors (hf_rebasin/match/memory_count.py), at published Pythia configs, and the plan it makes for 24, 40 and 80 GB.

    .venv/bin/python benchmarks/memory_plan_check.py --configs 160m,1b,6.9b [--batches 64,16] [--seq 512]

Every row: dual, bf16, soft targets (the defaults on `self` text), whole or with --gradient-checkpointing; the
count is minutes for the larger configs on a CPU (fake tensors: no memory is allocated).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from merge_size import config_of  # noqa: E402

from hf_rebasin.match.memory_count import config_template, count_step, meta_graph  # noqa: E402
from hf_rebasin.match.memory_plan import GIB, MemoryPlanError, estimate_peak, plan_memory, step_shape  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="160m,1b,6.9b")
    parser.add_argument("--batches", default="64,16")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--no-count", action="store_true", help="the estimates and plans alone (seconds)")
    args = parser.parse_args()
    print("| config | windows | checkpointing | count GiB | estimate GiB | estimate / count | count s |")
    print("|---|---|---|---|---|---|---|")
    plans = []
    for name in args.configs.split(","):
        template = config_template(config_of(name))
        graph = meta_graph(template)
        shape = step_shape(graph.spec, {k: tuple(v.shape) for k, v in graph.params.items()}, 2, "dual")
        for batch in map(int, args.batches.split(",")):
            for ckpt in (False, True):
                estimate = estimate_peak(shape, micro_batch=batch, seq_len=args.seq, checkpointing=ckpt,
                                         value_bytes=2, soft_targets=True)
                if args.no_count:
                    count, seconds = None, 0.0
                else:
                    start = time.perf_counter()
                    count = count_step(template, batch=batch, seq=args.seq, checkpointing=ckpt).peak_bytes
                    seconds = time.perf_counter() - start
                shown = "-" if count is None else f"{count / GIB:.1f}"
                ratio = "-" if count is None else f"{estimate / count:.3f}"
                print(f"| Pythia-{name} | {batch} x {args.seq} | {'on' if ckpt else 'off'} | {shown} | "
                      f"{estimate / GIB:.1f} | {ratio} | {seconds:.0f} |", flush=True)
        for gigabytes in (24, 40, 80):
            try:
                plan = plan_memory(shape, device="cuda", batch=64, processes=1, seq_len=args.seq, precision="bf16",
                                   soft_targets=True, free=gigabytes * 10**9, source="pretended")
                plans.append(f"Pythia-{name}, {gigabytes} GB: {plan.line().removeprefix('hf-rebasin: memory plan: ')}")
            except MemoryPlanError as error:
                plans.append(f"Pythia-{name}, {gigabytes} GB: error: {error}")
    print()
    print("\n".join(f"* {line}" for line in plans))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
