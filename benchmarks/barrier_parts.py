"""Where a pair's barrier lives after matching: the loss at the midpoint taken apart by part of the model.

    .venv/bin/python benchmarks/barrier_parts.py --pair neox-stdlib-long --method dual --seq-len 128 \
        --train-data runs/pairs/neox-stdlib-long/train.npy

Matches the cached pair (benchmarks/pairs.py) with the library (`hf_rebasin.barrier`, the method's defaults),
applies each model's transform to its canonical form (A', B') and evaluates on the pair's test split:

* the endpoints A' and B' and the midpoint M = (A' + B') / 2 (its excess over the endpoints' mean is the
  barrier at λ = 0.5);
* for each part, A' with that part replaced by the part of M, minus A', and the same from B': what averaging
  this part alone costs, seen from either end.

Parts: the token embedding, each layer's attention (q, k, v, o and their biases), each layer's FFN, and the
rest (final norm and the unembedding).  A point that mixes parts of an endpoint and M is on no path; the figures
say which parts the averaging breaks, not a barrier.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))


def part_of(key: str) -> str:
    match = re.match(r"layers\.(\d+)\.(attn|mlp)\.", key)
    if match:
        return f"layer {match.group(1)} {'attention' if match.group(2) == 'attn' else 'FFN'}"
    return "embedding" if key.startswith("embed.") else "final norm and unembedding"


def aligned_pair(name: str, method: str, seq_len: int, max_eval_tokens: int, train_data: str | None = None):
    """Match the cached pair with the library at the method's defaults: (pair paths, the result, the loaded models,
    their aligned canonical forms A' and B', the pair's test windows)."""
    import pairs

    import hf_rebasin
    from hf_rebasin.core.symmetry import apply
    from hf_rebasin.sources import models
    from hf_rebasin.sources.eval_data import load_eval_data

    pair = pairs.get_pair(name)
    a, b = str(pair["model_a"]), str(pair["model_b"])
    options = dict(method=method, data=str(pair["test_data"]), seq_len=seq_len, max_eval_tokens=max_eval_tokens,
                   lambdas=3)
    if method in ("lm", "dual"):
        options["train_data"] = train_data or str(pair["train_data"])
    result = hf_rebasin.barrier([a, b], **options)
    loaded = [models.load(source) for source in (a, b)]
    aligned = [apply(models.canonicalise(m).materialise(), t) for m, t in zip(loaded, result.transforms)]
    test = load_eval_data(options["data"], loaded[0], seq_len=seq_len, max_tokens=max_eval_tokens,
                          max_examples=None)
    return pair, result, loaded, aligned, test


def main() -> None:
    import torch

    from hf_rebasin.core.canonical import interpolate
    from hf_rebasin.evaluation.barrier import evaluate
    from hf_rebasin.sources import models

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="neox-stdlib-long")
    parser.add_argument("--method", default="dual")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--max-eval-tokens", type=int, default=65536)
    parser.add_argument("--train-data", help="for lm/dual (default: the pair's train split)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    _, result, loaded, aligned, data = aligned_pair(args.pair, args.method, args.seq_len, args.max_eval_tokens,
                                                    args.train_data)
    mid = interpolate(aligned, [0.5, 0.5])

    def loss(graph) -> float:
        return evaluate(models.instantiate(graph, loaded[0]), data, batch_size=16)["loss"]

    loss_a, loss_b, loss_mid = loss(aligned[0]), loss(aligned[1]), loss(mid)
    parts = sorted({part_of(k) for k in mid.params}, key=lambda p: (p != "embedding", p.startswith("final"), p))
    rows = []
    for part in parts:
        keys = [k for k in mid.params if part_of(k) == part]
        costs = [loss(end.replace(params={**end.params, **{k: mid.params[k] for k in keys}})) - end_loss
                 for end, end_loss in zip(aligned, (loss_a, loss_b))]
        rows.append({"part": part, "from_a": costs[0], "from_b": costs[1]})
        print(json.dumps(rows[-1]), flush=True)
    excess = loss_mid - (loss_a + loss_b) / 2
    print(f"\n{args.pair}, {args.method}: loss A' {loss_a:.4f}, B' {loss_b:.4f}, midpoint {loss_mid:.4f} "
          f"(excess {excess:.4f}; the library's barrier {result.barrier:.4f})")
    print("\n| part | A' with this part of M, − A' | B' with this part of M, − B' |\n|---|---|---|")
    for row in rows:
        print(f"| {row['part']} | {row['from_a']:+.3f} | {row['from_b']:+.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"pair": args.pair, "method": args.method, "loss_a": loss_a,
                                               "loss_b": loss_b, "loss_mid": loss_mid, "barrier": result.barrier,
                                               "parts": rows}, indent=1))


if __name__ == "__main__":
    main()
