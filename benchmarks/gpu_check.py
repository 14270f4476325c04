"""GPU check of dual learned matching at published sizes: step cost, throughput, peak memory, exactness.

    python benchmarks/gpu_check.py                  # on a GPU: Pythia-160M and Pythia-1B configs, 40 dual steps each
    .venv/bin/python benchmarks/gpu_check.py --device cpu --configs 14m --steps 4 --batch 2 --seq 64   # CPU smoke run
    python benchmarks/gpu_check.py --soft-targets 1 # the same with the target of `self` data (--soft-targets 1)

First, on the CPU and in seconds, one dual step of every config runs under CUDA's rules (hf_rebasin/match/cuda_rules.py:
fake CUDA tensors under CUDA's autocast, the dtype rules and the host syncs of a GPU): a step CUDA would reject
stops the script before any GPU time is spent, and the step's aten ops, launches and syncs are printed.

For each config: two random-init checkpoints with the exact published Pythia config, stored in fp16 (written
shard by shard, as in merge_size.py), loaded and canonicalised by the library; then the library's own
learned-matching loop (`hf_rebasin.match.learned.learn`, the code `--method dual` runs) for --steps steps at
batch --batch × --seq tokens with --learn-precision bf16 (endpoints stored in bf16, symmetry parameters and
AdamW state in fp32, autocast forward), from the identity (random models have nothing for weight matching
to find, and the check is about the learned step).  Printed per config:

* the median dual step (after two warm-up steps) against a plain training step of one model with trainable fp32
  weights under the same autocast at the same batch (forward, backward and the same fused AdamW over all its
  weights), on the same device, and tokens/s of the dual step;
* peak memory: torch.cuda.max_memory_allocated of the learned run and of the plain step (peak RSS on CPU);
* exactness: each model's loss on a held batch, in fp32, before and after applying its learned transform
  (an exact symmetry: the change must be at rounding level, < 1e-3 nats, else the row says CHANGED);
* the hours a real pair needs at a budget of --budget-steps steps of the same batch (Li & Shen train dual
  matching for tens of thousands of steps at 16 × 512 tokens; 20,000 is the default assumption);
* sampling: tokens/s of the sampler `--train-data self` runs (64 texts at once, KV cache, the model as the pipeline
  loads it: fp32), and what `merge A B --method dual` without --train-data would spend at its default steps and
  batch (300 × 64 windows of --seq tokens) sampling its `self` windows (an eighth of them, plus the held-out ones)
  against training (the measured step scaled linearly to 64 windows).

Exit status 1 if any exactness check fails.  Takes about 3 minutes on one H100-class GPU (mostly writing
and reading the 1B checkpoints); --work keeps the checkpoints between runs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from merge_size import PYTHIA, make_checkpoint  # noqa: E402

from hf_rebasin.core.symmetry import Transform, apply  # noqa: E402
from hf_rebasin.evaluation.barrier import evaluate  # noqa: E402
from hf_rebasin.match import Alignment  # noqa: E402
from hf_rebasin.match.cuda_rules import check_step  # noqa: E402
from hf_rebasin.match.learned import learn  # noqa: E402
from hf_rebasin.match.train_loop import make_optimizer  # noqa: E402
from hf_rebasin.options import MergeOptions  # noqa: E402
from hf_rebasin.pipeline import self_sample_windows  # noqa: E402
from hf_rebasin.sources import models  # noqa: E402
from hf_rebasin.sources.eval_data import EvalData  # noqa: E402
from hf_rebasin.sources.self_samples import SAMPLE_BATCH, Sampling, drawn_tokens, sample_sequences  # noqa: E402

EXACT_NATS = 1e-3


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def peak_gib(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30


def plain_step_seconds(loaded, x: torch.Tensor, device: str, precision: str, repeats: int = 5) -> tuple[float, float]:
    """(median seconds, peak GiB) of a training step of one model with trainable weights: forward, backward and the
    optimiser learned matching uses (make_optimizer: fused AdamW on CUDA)."""
    model = loaded.backend.load_model(loaded).to(device).train()
    for p in model.parameters():
        p.requires_grad_(True)
    optimizer = make_optimizer(list(model.parameters()), 1e-5, torch.device(device))
    autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=precision == "bf16")
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        with autocast:
            logits = model(input_ids=x, use_cache=False).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        times.append(time.perf_counter() - start)
    peak = peak_gib(device)
    del model, logits, loss, optimizer
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return statistics.median(times[1:]), peak


def sampling_tokens_per_s(loaded, seq: int, device: str, vocab: int) -> float:
    """Tokens/s of the sampler `--train-data self` runs (sources/self_samples.py: SAMPLE_BATCH texts at once with the
    model's KV cache, the model as the pipeline loads it), over one batch of SAMPLE_BATCH windows of `seq` tokens."""
    model = loaded.backend.load_model(loaded).to(device)
    sampling = Sampling(models=("timing",), vocabulary_digest="timing", windows=SAMPLE_BATCH, seq_len=seq,
                        temperature=1.0, top_p=1.0, seed=0, start_token=0, vocab_size=vocab)
    generator = torch.Generator(device=device).manual_seed(0)
    synchronize(device)
    start = time.perf_counter()
    for _ in sample_sequences(model, SAMPLE_BATCH, sampling, generator, device):
        pass
    synchronize(device)
    seconds = time.perf_counter() - start
    del model
    return drawn_tokens(SAMPLE_BATCH, sampling) / seconds


def loss_of(graph, template, batch: EvalData, device: str) -> float:
    model = models.instantiate(graph, template)
    loss = evaluate(model, batch, batch_size=len(batch.inputs), device=device)["loss"]
    del model
    return loss


def check(name: str, work: Path, args) -> dict:
    folders = [make_checkpoint(name, seed, work / f"pythia-{name}-seed{seed}", tokenizer=False) for seed in (1, 2)]
    loaded = [models.load(f) for f in folders]
    graphs = [models.canonicalise(m).materialise() for m in loaded]
    vocab = PYTHIA[name][4]
    gen = torch.Generator().manual_seed(0)
    train = EvalData("causal-lm", torch.randint(0, vocab, (args.batch * args.steps, args.seq), generator=gen))
    held = EvalData("causal-lm", torch.randint(0, vocab, (2, args.seq), generator=gen))
    x = train.inputs[:args.batch].to(args.device)

    plain_s, plain_peak = plain_step_seconds(loaded[0], x, args.device, args.precision)

    options = MergeOptions(method="dual", steps=args.steps, learn_batch_size=args.batch, eval_every=0,
                           learn_precision=args.precision, device=args.device,
                           gradient_checkpointing=args.gradient_checkpointing, soft_targets=args.soft_targets,
                           checkpoint_dir=str(work / "checkpoints"))
    stamps: list[float] = []
    start = Alignment([Transform.identity(g.spec) for g in graphs])
    began = time.perf_counter()
    def stamp(done, loss):  # the loop itself never waits for the GPU inside a run of steps: wait here to time them
        synchronize(args.device)
        stamps.append(time.perf_counter())

    result = learn(graphs, start, loaded[0], train, None, options, progress=False, on_step=stamp)
    learn_s = time.perf_counter() - began
    step_times = [b - a for a, b in zip(stamps, stamps[1:])][1:]  # the first two steps are warm-up
    dual_s = statistics.median(step_times)
    changes = [abs(loss_of(apply(g, t), loaded[0], held, args.device) - loss_of(g, loaded[0], held, args.device))
               for g, t in zip(graphs, result.transforms)]
    moved = max(float((t.rotation - torch.eye(t.rotation.shape[0])).abs().max()) for t in result.transforms)
    tokens_per_s = args.batch * args.seq / dual_s
    # what `merge A B --method dual` (no --train-data: `self`) would spend at its default steps and batch, from the
    # measured rates: sampling its windows, and its steps (the step time scaled linearly from --batch)
    sample_rate = sampling_tokens_per_s(loaded[0], args.seq, args.device, vocab)
    defaults = MergeOptions(method="dual")
    sampled = self_sample_windows(defaults, args.seq) * args.seq
    default_sample_s = sampled / sample_rate
    default_train_s = defaults.steps * dual_s * defaults.learn_batch_size / args.batch
    return {"config": f"pythia-{name}", "params": sum(v.numel() for v in graphs[0].params.values()),
            "device": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
            "precision": args.precision + (" + checkpointing" if args.gradient_checkpointing else "")
            + (f" + soft targets {args.soft_targets:g}" if args.soft_targets else ""),
            "batch": args.batch, "seq": args.seq, "steps": args.steps,
            "plain_step_s": plain_s, "dual_step_s": dual_s, "ratio": dual_s / plain_s,
            "tokens_per_s": tokens_per_s, "learn_wall_s": learn_s,
            "peak_gib_dual": result.settings["peak_memory"]["GiB"], "peak_gib_plain": plain_peak,
            "peak_memory_kind": result.settings["peak_memory"]["what"],
            "rotation_moved": moved, "endpoint_loss_change": max(changes),
            "exact": max(changes) < EXACT_NATS,
            "budget_steps": args.budget_steps, "budget_hours": args.budget_steps * dual_s / 3600,
            "sample_tokens_per_s": sample_rate, "default_self_tokens": sampled, "default_sample_s": default_sample_s,
            "default_train_s": default_train_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="160m,1b", help=f"comma-separated, of {', '.join(PYTHIA)}")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--budget-steps", type=int, default=20_000)
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="the layer-by-layer loss with layers recomputed in the backward (merge's flag)")
    parser.add_argument("--soft-targets", type=float, default=0.0,
                        help="merge's --soft-targets: the endpoints' own prediction in the target (one more forward "
                             "per model per step)")
    parser.add_argument("--work", help="folder for the checkpoints (default: a temporary one)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    if args.steps < 4:
        parser.error("--steps must be at least 4 (two warm-up steps, then the timed ones)")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        for name in args.configs.split(","):  # CUDA's rules first, on the CPU: a step a GPU would reject stops here
            folders = [make_checkpoint(name, seed, work / f"pythia-{name}-seed{seed}", tokenizer=False)
                       for seed in (1, 2)]
            template = models.load(folders[0])
            graphs = [models.canonicalise(models.load(f)).materialise() for f in folders]
            counts = check_step(template, graphs, method="dual", layered=args.gradient_checkpointing,
                                precision=args.precision, soft_targets=args.soft_targets).total.summary()
            print(json.dumps({"config": f"pythia-{name}", "simulated_cuda_step": counts}), flush=True)
            del template, graphs
        rows = []
        for name in args.configs.split(","):
            row = check(name, work, args)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n| config | device | precision | batch × seq | plain f+b s | dual step s | ratio | tokens/s | "
          f"peak GiB dual / plain | endpoint Δloss | hours at {args.budget_steps} steps | sampled tokens/s | "
          "`self` at the defaults: sample s / train s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['device']} | {r['precision']} | {r['batch']} × {r['seq']} | "
              f"{r['plain_step_s']:.3f} | {r['dual_step_s']:.3f} | {r['ratio']:.2f} | {r['tokens_per_s']:.0f} | "
              f"{r['peak_gib_dual']:.2f} / {r['peak_gib_plain']:.2f} | {r['endpoint_loss_change']:.1e}"
              f"{'' if r['exact'] else ' CHANGED'} | {r['budget_hours']:.1f} | {r['sample_tokens_per_s']:.0f} | "
              f"{r['default_sample_s']:.0f} / {r['default_train_s']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
