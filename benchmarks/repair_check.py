"""Does REPAIR (Jordan et al. 2022, "REPAIR: REnormalizing Permuted Activations for Interpolation Repair") lower
what matching leaves?  One command:

    .venv/bin/python benchmarks/repair_check.py --pair neox-stdlib-long --method dual \
        --train-data runs/pairs/neox-stdlib-long/train.npy [--points mlp,attn]

Matches the cached pair (benchmarks/pairs.py) with the library at the method's defaults, builds the aligned
endpoints A', B' and their midpoint M, then, layer by layer from the bottom, rescales and shifts each unit of the
chosen linear layers of M (`mlp`: the FFN's input projection, per FFN unit before the GELU; `attn`: the attention's
output projection, per residual coordinate) so that its output's mean and standard deviation over the pair's
validation files equal the mean of A''s and B''s.  Each layer's statistics are taken after the layers below it were
corrected.  Prints the midpoint's excess over the endpoints' mean loss on the test files before and after, and
per corrected layer the median of the midpoint's standard deviation over the target's before its correction.
GPT-NeoX pairs only (the FFN and attention modules are named by GPT-NeoX's layout).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))


def corrected_layers(model, points: str) -> list:
    chosen = []
    for layer in model.gpt_neox.layers:
        if "mlp" in points:
            chosen.append(layer.mlp.dense_h_to_4h)
        if "attn" in points:
            chosen.append(layer.attention.dense)
    return chosen


@torch.no_grad()
def output_stats(model, linear, inputs: torch.Tensor, batch_size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard deviation, per output unit, of one linear layer of the model over the token windows."""
    sums = [0, 0.0, 0.0]

    def record(module, args, out):
        z = out.reshape(-1, out.shape[-1]).double()
        sums[0] += z.shape[0]
        sums[1] = sums[1] + z.sum(0)
        sums[2] = sums[2] + (z * z).sum(0)

    hook = linear.register_forward_hook(record)
    try:
        for start in range(0, len(inputs), batch_size):
            model(input_ids=inputs[start:start + batch_size])
    finally:
        hook.remove()
    mean = sums[1] / sums[0]
    return mean, (sums[2] / sums[0] - mean * mean).clamp_min(1e-12).sqrt()


@torch.no_grad()
def repair(mid, ends: list, points: str, inputs: torch.Tensor) -> list[float]:
    """Correct the midpoint in place, layer by layer, toward the endpoints' mean statistics; the median, per
    corrected layer, of the midpoint's standard deviation over the target's before its correction."""
    targets = [[output_stats(end, linear, inputs) for linear in corrected_layers(end, points)] for end in ends]
    collapse = []
    for i, linear in enumerate(corrected_layers(mid, points)):
        mean, std = output_stats(mid, linear, inputs)
        target_mean = (targets[0][i][0] + targets[1][i][0]) / 2
        target_std = (targets[0][i][1] + targets[1][i][1]) / 2
        collapse.append(round(float((std / target_std).median()), 3))
        scale = target_std / std
        linear.weight.mul_(scale[:, None].to(linear.weight.dtype))
        linear.bias.copy_((scale * (linear.bias.double() - mean) + target_mean).to(linear.bias.dtype))
    return collapse


def main() -> None:
    from barrier_parts import aligned_pair

    from hf_rebasin.core.canonical import interpolate
    from hf_rebasin.evaluation.barrier import evaluate
    from hf_rebasin.sources import models
    from hf_rebasin.sources.eval_data import load_eval_data

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="neox-stdlib-long")
    parser.add_argument("--method", default="dual")
    parser.add_argument("--train-data", help="for lm/dual (default: the pair's train split)")
    parser.add_argument("--points", default="mlp", help="mlp, attn or mlp,attn (default mlp)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--max-eval-tokens", type=int, default=65536)
    parser.add_argument("--stats-tokens", type=int, default=32768, help="validation tokens the statistics use")
    args = parser.parse_args()
    pair, result, loaded, aligned, test = aligned_pair(args.pair, args.method, args.seq_len, args.max_eval_tokens,
                                                       args.train_data)
    stats = load_eval_data(str(pair["val_data"]), loaded[0], seq_len=args.seq_len, max_tokens=args.stats_tokens,
                           max_examples=None).inputs
    ends = [models.instantiate(g, loaded[0]) for g in aligned]
    mid = models.instantiate(interpolate(aligned, [0.5, 0.5]), loaded[0])
    end_loss = sum(evaluate(m, test, batch_size=16)["loss"] for m in ends) / 2
    before = evaluate(mid, test, batch_size=16)["loss"] - end_loss
    collapse = repair(mid, ends, args.points, stats)
    after = evaluate(mid, test, batch_size=16)["loss"] - end_loss
    print(json.dumps({"pair": args.pair, "method": args.method, "points": args.points, "library_barrier":
                      result.barrier, "excess_before": round(before, 4), "excess_after": round(after, 4),
                      "std_over_target_before": collapse}))


if __name__ == "__main__":
    main()
