"""Learned matching under `accelerate launch` (used by tests/test_learned.py).

    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \
        --mixed_precision no --dynamo_backend no tests/learned_ddp_script.py A B TEXT OUT [options]

Trains dual (or lm) matching of tiny models A and B on token windows of TEXT (the method as the pipeline runs
it: weight matching, then learning) and writes, from the main process, OUT.safetensors (both transforms) and
OUT.json (number of processes, log, endpoint bytes per process); every process writes OUT.rank<R>.json: its
weight-matching calls, a digest of the symmetry parameters it starts training from, their number, and the
sizes of the all-reduces of every step.  --fsdp shards the endpoints over the processes,
--gradient-checkpointing recomputes layers."""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("text")
    parser.add_argument("out")
    parser.add_argument("--method", default="dual")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--lr", type=float, default=2e-2)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from hf_rebasin.match import METHODS, MatchContext, train_loop, weight
    from hf_rebasin.match.learned import exact_digest, is_main_process
    from hf_rebasin.options import MergeOptions
    from hf_rebasin.sources import models
    from hf_rebasin.sources.data import load_token_windows
    from hf_rebasin.sources.eval_data import EvalData

    record = {"weight_matching_calls": 0, "all_reduce_sizes_per_step": []}
    all_reduces = []  # numel of every all_reduce since the last step ended
    original_weight_matching, original_all_reduce = weight.weight_matching, dist.all_reduce

    def weight_matching(*args, **kwargs):
        record["weight_matching_calls"] += 1
        return original_weight_matching(*args, **kwargs)

    def all_reduce(tensor, *args, **kwargs):
        all_reduces.append(tensor.numel())
        return original_all_reduce(tensor, *args, **kwargs)

    weight.weight_matching, dist.all_reduce = weight_matching, all_reduce

    def step_done(step, loss):
        record["all_reduce_sizes_per_step"].append(list(all_reduces))
        all_reduces.clear()

    original_train = train_loop.train_transforms

    def recorded_train(path_loss, *args, **kwargs):
        record["start_parameters"] = exact_digest(path_loss.learned_state())
        record["learned_parameters"] = sum(p.numel() for p in path_loss.parameters() if p.requires_grad)
        all_reduces.clear()
        return original_train(path_loss, *args, **{**kwargs, "on_step": step_done})

    train_loop.train_transforms = recorded_train

    a, b = models.load(args.a), models.load(args.b)
    windows, info = load_token_windows(args.text, AutoTokenizer.from_pretrained(args.a), args.seq_len, 4096)
    train = EvalData("causal-lm", windows, None, info)
    options = MergeOptions(method=args.method, steps=args.steps, lr=args.lr, learn_batch_size=args.batch_size,
                           grad_accum=args.grad_accum, eval_every=0, device="cpu", fsdp=args.fsdp,
                           gradient_checkpointing=args.gradient_checkpointing)
    graphs = [models.canonicalise(a), models.canonicalise(b)]
    result = METHODS[args.method].run(graphs, MatchContext(options, template=a, train_data=train, progress=False))
    from accelerate import PartialState
    with open(f"{args.out}.rank{PartialState().process_index}.json", "w") as f:
        json.dump(record, f)
    if is_main_process():
        tensors = {f"a.{k}": v for k, v in result.transform_a.to_tensors().items()}
        tensors.update({f"b.{k}": v for k, v in result.transform_b.to_tensors().items()})
        save_file(tensors, args.out + ".safetensors")
        report = {"num_processes": PartialState().num_processes, "world_size_env": os.environ.get("WORLD_SIZE"),
                  "log": result.log[-3:], "endpoint_storage": result.settings["endpoint_storage"]}
        with open(args.out + ".json", "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
