"""Learned matching under `accelerate launch` (used by tests/test_learned.py).

    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \
        --mixed_precision no --dynamo_backend no tests/learned_ddp_script.py A B TEXT OUT [options]

Trains dual (or lm) matching of tiny models A and B on token windows of TEXT and writes, from the
main process, OUT.safetensors (both transforms) and OUT.json (number of processes, log, endpoint bytes per
process).  --fsdp shards the endpoints over the processes, --gradient-checkpointing recomputes layers."""
from __future__ import annotations

import argparse
import json
import os

import torch


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

    from hf_rebasin import models
    from hf_rebasin.data import load_token_windows
    from hf_rebasin.evaluation import EvalData
    from hf_rebasin.match.learned import is_main_process, learn
    from hf_rebasin.match.weight import weight_matching
    from hf_rebasin.options import MergeOptions

    a, b = models.load(args.a), models.load(args.b)
    windows, info = load_token_windows(args.text, AutoTokenizer.from_pretrained(args.a), args.seq_len, 4096)
    train = EvalData("causal-lm", windows, None, info)
    options = MergeOptions(method=args.method, steps=args.steps, lr=args.lr, learn_batch_size=args.batch_size,
                           grad_accum=args.grad_accum, eval_every=0, device="cpu", fsdp=args.fsdp,
                           gradient_checkpointing=args.gradient_checkpointing)
    graphs = [models.canonicalise(a), models.canonicalise(b)]
    result = learn(graphs, weight_matching(*graphs, progress=False), a, train, None, options, progress=False)
    if is_main_process():
        from accelerate import PartialState
        tensors = {f"a.{k}": v for k, v in result.transform_a.to_tensors().items()}
        tensors.update({f"b.{k}": v for k, v in result.transform_b.to_tensors().items()})
        save_file(tensors, args.out + ".safetensors")
        report = {"num_processes": PartialState().num_processes, "world_size_env": os.environ.get("WORLD_SIZE"),
                  "log": result.log[-3:], "endpoint_storage": result.settings["endpoint_storage"]}
        with open(args.out + ".json", "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
