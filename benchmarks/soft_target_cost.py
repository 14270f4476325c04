"""Step time of learned matching's path loss with and without --soft-targets, on a cached pair's models: one
forward and backward of 64 windows of 128 tokens at λ = 0.5 (random group elements), median of 5 after a warm-up,
the two settings interleaved; and one endpoint's forward alone.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/soft_target_cost.py runs/pairs/neox-stdlib-long
"""
from __future__ import annotations

import argparse
import time

import torch

from hf_rebasin.core import symmetry
from hf_rebasin.match.learned import PathLoss
from hf_rebasin.match.params import SymmetryParams
from hf_rebasin.sources import models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pair", help="a folder holding model-a and model-b (benchmarks/pairs.py caches them)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = [models.load(f"{args.pair}/model-{x}") for x in "ab"]
    graphs = [models.canonicalise(m).materialise() for m in loaded]
    ends = {str(k): SymmetryParams(g.spec, symmetry.random_transform(g.spec, seed=3 + k)) for k, g in enumerate(graphs)}
    path = PathLoss(graphs, ends, loaded[0], "causal-lm")
    vocab = graphs[0].spec.n_out
    x = torch.randint(0, vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    rows = torch.unique(x)

    def step(share: float) -> float:
        path.soft_targets = share
        start = time.perf_counter()
        path(x, None, 0.5, rows).backward()
        return time.perf_counter() - start

    times: dict[float, list[float]] = {0.0: [], 1.0: []}
    for _ in range(args.repeats + 1):
        for share, seconds in times.items():
            seconds.append(step(share))
    median = {share: sorted(seconds[1:])[args.repeats // 2] for share, seconds in times.items()}
    with torch.no_grad():
        path.endpoint_logits(x, 0, rows)
        start = time.perf_counter()
        path.endpoint_logits(x, 0, rows)
        endpoint = time.perf_counter() - start
    print(f"step: {median[0.0]:.3f} s hard, {median[1.0]:.3f} s soft ({median[1.0] / median[0.0]:.2f}x); "
          f"one endpoint's forward {endpoint:.3f} s")


if __name__ == "__main__":
    main()
