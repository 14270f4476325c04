"""GPU check of dual learned matching at the Pythia-160M and 1B configs: speed, memory against the plan, `self`
sampling, and the example pair's barrier on the GPU against the CPU.

    python3 benchmarks/gpu_check.py                 # on a GPU: 160m and 1b (sized for < 8 min on an H100; unrun)
    python3 benchmarks/gpu_check.py --quick         # 160m only, fewer steps
    .venv/bin/python benchmarks/gpu_check.py --dry-run   # every part on the CPU, tiny (tests/test_gpu_check.py)

On the GPU machine (Python 3.12, torch 2.11, transformers 5.17, no package index), with the wheels that
benchmarks/gpu_wheels.sh downloads into .whl/ carried along, the one command is (lines joined by "; "):

    P="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --ignore-requires-python --upgrade"
    $P --target /tmp/site $(ls .whl/*.whl | grep -v hf_rebasin) && $P --target /tmp/hf .whl/hf_rebasin-*.whl || exit
    export PYTHONPATH=/tmp/site
    (cd /tmp && PYTHONPATH=/tmp/hf:/tmp/site python3 -c "import hf_rebasin, datasets, lm_eval")
    PYTHONUNBUFFERED=1 timeout 500 python3 benchmarks/gpu_check.py --json $OUT/gpu_check.json 2>&1 | tee \
      $OUT/gpu_check.log

Models are built on the device directly (benchmarks/device_models.py: parameters on the meta device, then drawn
on the GPU; nothing written to disk, no model copy on the host); their canonical graphs stay on the host, as a
pipeline run keeps them.  Per config, in bf16 unless --precision says otherwise:

* plain: one model's training step (forward, backward, fused AdamW over its weights) at the papers' 16 × 512;
* `self` sampling: the package's sampler (`sample_sequences`, SAMPLE_BATCH texts with the KV cache) on one model
  held in the learning precision, one batch: tokens/s and peak memory, and the seconds `merge A B --method dual`
  at its defaults would spend sampling its windows against the seconds its 300 steps take (the step measured
  below);
* learned matching (`hf_rebasin.match.learned.learn`, the loop `--method dual` runs), --steps steps each, timed
  after two warm-up steps: (a) the defaults (64 windows of 512 tokens a step, soft targets as on `self` text,
  and the memory plan the package makes for the device), (b) the papers' 16 × 512 whole-model step without soft
  targets.  Printed: tokens/s, torch.cuda.max_memory_allocated against the plan's estimate (barrier.json's
  "memory_plan": "n/a" where the package records none), seconds per 1,000 steps and the hours of 20,000 and
  50,000 steps.

Agreement: `merge model-a model-b --method dual` of the bundled example pair (--train-data the held-out text,
split into halves by the pipeline), once on the GPU in bf16 and once on the CPU in fp32, same settings and seed:
the barriers must agree within AGREE_NATS (see there).

A part that fails is recorded (its exception, one line, and the traceback on stderr) and the others still run;
exit status 1 if any part failed or the barriers disagree.  Elapsed seconds are printed per part."""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from device_models import build_on_device, canonical_graph, template_for  # noqa: E402

from hf_rebasin.core.symmetry import Transform  # noqa: E402
from hf_rebasin.match import Alignment  # noqa: E402
from hf_rebasin.match.learned import autocast_dtype, learn  # noqa: E402
from hf_rebasin.match.memory_plan import free_memory, plan_memory, step_shape  # noqa: E402
from hf_rebasin.match.train_loop import make_optimizer  # noqa: E402
from hf_rebasin.options import MergeOptions  # noqa: E402
from hf_rebasin.run_data import self_sample_windows  # noqa: E402
from hf_rebasin.sources.eval_data import EvalData, default_seq_len  # noqa: E402
from hf_rebasin.sources.self_samples import (  # noqa: E402
    SAMPLE_BATCH,
    Sampling,
    chain_settings,
    drawn_tokens,
    sample_sequences,
)

# The example pair's dual barrier, GPU bf16 against CPU fp32, may differ by this many nats.  The two runs see the
# same data split, seed and λ draws; they differ in the learning precision (bf16 endpoints and forward: relative
# rounding 2^-8 per op) and in the kernels, and the barrier itself is evaluated in fp32 on both.  Measured on the
# CPU (2-core machine, 2026-12-07), bf16 against fp32 at the same seed: 2.1e-4 nats after 30 steps of 16 × 128
# tokens (16,384 evaluation tokens: 0.5096 against 0.5094), 2.2e-3 and 2.5e-3 at the dry-run's 2 steps of 4 × 32
# and 512 evaluation tokens.  0.01 nats (2 % of the barrier) passes that rounding noise with room for a GPU's other
# kernels, and is small against what the methods change on this pair (raw 1.385, wm 0.489: BENCHMARKS.md).
AGREE_NATS = 0.01
PLAN_KEYS = ("estimated_peak_bytes", "free_bytes", "micro_batch", "accumulation", "gradient_checkpointing",
             "sampling_peak_bytes")
GIB = 2**30


class Clock:
    """Seconds since the script began (wall, and this process's CPU), printed with each part's name."""

    def __init__(self):
        self.began, self.cpu = time.perf_counter(), time.process_time()

    def mark(self, what: str) -> None:
        print(f"[{time.perf_counter() - self.began:7.1f} s, cpu {time.process_time() - self.cpu:6.1f} s] {what}",
              flush=True)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: str) -> int:
    """torch.cuda.max_memory_allocated on a GPU; the process's peak resident set on the CPU (not comparable)."""
    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated(device))
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def release(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def attempt(results: dict, key: str, run, *args):
    """run(*args) stored under results[key]; a failure is recorded as {"error": one line} and printed whole."""
    try:
        results[key] = run(*args)
    except Exception as error:  # noqa: BLE001 - every failure on the GPU is a result to record
        traceback.print_exc()
        results[key] = {"error": f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"}
    return results[key]


def random_windows(vocab: int, windows: int, seq: int, seed: int) -> EvalData:
    gen = torch.Generator().manual_seed(seed)
    return EvalData("causal-lm", torch.randint(0, vocab, (windows, seq), generator=gen))


# --- the parts ---------------------------------------------------------------------------------------

def plain_step(model, batch: int, seq: int, vocab: int, device: str, precision: str, repeats: int) -> dict:
    """A training step of one model with trainable fp32 weights (forward under the autocast learned matching
    uses, backward, fused AdamW on CUDA): median seconds after one warm-up step, and peak memory."""
    model.train().requires_grad_(True)
    optimizer = make_optimizer(list(model.parameters()), 1e-5, torch.device(device))
    autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=precision == "bf16")
    x = random_windows(vocab, batch, seq, 0).inputs.to(device)
    reset_peak(device)
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
    model.eval().requires_grad_(False)
    del optimizer, logits, loss
    return {"batch": batch, "seq": seq, "step_s": statistics.median(times[1:]), "peak_bytes": peak_bytes(device)}


def sampling_rate(model, seq: int, vocab: int, device: str) -> dict:
    """The package's `self` sampler on `model` (as it is: in the learning precision), one batch of SAMPLE_BATCH
    windows of `seq` tokens: tokens/s and peak memory."""
    sampling = Sampling(models=("timing",), vocabulary_digest="timing", windows=SAMPLE_BATCH, seq_len=seq,
                        temperature=1.0, top_p=1.0, seed=0, start_token=0, vocab_size=vocab)
    generator = torch.Generator(device=device).manual_seed(0)
    release(device)
    reset_peak(device)
    synchronize(device)
    start = time.perf_counter()
    for _ in sample_sequences(model, SAMPLE_BATCH, sampling, generator, device):
        pass
    synchronize(device)
    seconds = time.perf_counter() - start
    return {"tokens_per_s": drawn_tokens(SAMPLE_BATCH, sampling) / seconds, "seconds": seconds,
            "peak_bytes": peak_bytes(device), "dtype": str(next(model.parameters()).dtype).replace("torch.", "")}


def default_self_tokens(seq: int) -> int:
    """Tokens `merge A B --method dual` samples at its defaults (both models together), as the pipeline draws
    them (run_data.self_sample_windows, chains of windows)."""
    windows = self_sample_windows(MergeOptions(method="dual"), seq)
    sampling = Sampling(models=("a", "b"), vocabulary_digest="", windows=windows, seq_len=seq, temperature=1.0,
                        top_p=1.0, seed=0, start_token=0, vocab_size=2, **chain_settings())
    return sum(drawn_tokens(share, sampling) for share in sampling.shares())


def planned(options: MergeOptions, graphs, seq: int) -> tuple[MergeOptions, dict | None]:
    """The options with the memory plan that `merge` makes before its first step (pipeline -> memory_plan.plan_run,
    here from the graphs' shapes: learn() is called directly), and the plan; (options, None) where the package
    plans nothing (the CPU of the dry run)."""
    device = torch.device(options.resolved_device())
    free = free_memory(device, options.memory_bytes())
    if free is None:
        return options, None
    shape = step_shape(graphs[0].spec, {k: tuple(v.shape) for k, v in graphs[0].params.items()}, len(graphs),
                       options.method)
    plan = plan_memory(shape, device=options.resolved_device(), batch=options.learn_batch_size, processes=1,
                       seq_len=seq, precision="bf16" if autocast_dtype(options, device) == torch.bfloat16 else "fp32",
                       soft_targets=options.soft_target_share("causal-lm") > 0, free=free[0], source=free[1],
                       min_accumulation=options.grad_accum, checkpointing=options.gradient_checkpointing)
    print(f"  {plan.line()}", flush=True)
    options = dataclasses.replace(options, grad_accum=plan.accumulation,
                                  gradient_checkpointing=plan.gradient_checkpointing)
    return options, plan.to_dict()


def learned_run(setting: str, graphs, template, seq: int, args, work: Path) -> dict:
    """learn() for --steps steps at `setting` ("defaults" or "papers"), timed per step after two warm-up steps."""
    common = dict(method="dual", steps=args.steps, device=args.device, checkpoint_dir=str(work / "checkpoints"))
    if setting == "defaults":
        options = MergeOptions(**common)
    else:
        options = MergeOptions(**common, learn_batch_size=args.papers_batch, soft_targets=0.0, eval_every=0,
                               learn_precision=args.precision, gradient_checkpointing=False)
    options, plan = planned(options, graphs, seq)
    vocab = graphs[0].spec.n_out
    train = random_windows(vocab, options.learn_batch_size * args.steps + 64, seq, 1)
    stamps: list[float] = []

    def stamp(done, loss):  # the loop never waits for the GPU between its loss reads: wait here to time steps
        synchronize(args.device)
        stamps.append(time.perf_counter())

    start = Alignment([Transform.identity(g.spec) for g in graphs])
    began = time.perf_counter()
    result = learn(graphs, start, template, train, None, options, progress=False, on_step=stamp)
    wall = time.perf_counter() - began
    peak = peak_bytes(args.device)
    step_s = statistics.median([b - a for a, b in zip(stamps, stamps[1:])][1:])
    row = {"setting": setting, "batch": options.learn_batch_size, "seq": seq,
           "precision": str(result.settings["learned"]["learn_precision"]),
           "soft_targets": options.soft_target_share("causal-lm"), "steps": args.steps, "step_s": step_s,
           "tokens_per_s": options.learn_batch_size * seq / step_s, "s_per_1000_steps": 1000 * step_s,
           "hours": {str(n): n * step_s / 3600 for n in args.budget_steps}, "learn_wall_s": wall,
           "peak_bytes": peak, "memory_plan": {k: plan.get(k) for k in PLAN_KEYS} if isinstance(plan, dict) else None,
           "default_steps": MergeOptions(method="dual").steps}
    del result
    release(args.device)
    return row


def check_config(name: str, args, work: Path, clock: Clock) -> dict:
    template = template_for(name, work / f"config-{name}")
    vocab, seq = template.config.vocab_size, args.seq or default_seq_len(template)
    out: dict = {"config": f"pythia-{name}", "seq": seq}
    clock.mark(f"pythia-{name}: building model A on {args.device}")
    model = build_on_device(template, 1, args.device)
    out["params"] = sum(p.numel() for p in model.parameters())
    graphs = [canonical_graph(model, template)]
    clock.mark(f"pythia-{name}: plain step, {args.papers_batch} x {seq}")
    attempt(out, "plain", plain_step, model, args.papers_batch, seq, vocab, args.device, args.precision,
            args.plain_repeats)
    release(args.device)
    clock.mark(f"pythia-{name}: `self` sampling, {SAMPLE_BATCH} x {seq}")
    sample_dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    attempt(out, "sampling", sampling_rate, model.to(sample_dtype), seq, vocab, args.device)
    del model
    release(args.device)
    clock.mark(f"pythia-{name}: building model B")
    model = build_on_device(template, 2, args.device)
    graphs.append(canonical_graph(model, template))
    del model
    release(args.device)
    for setting in ("defaults", "papers"):
        clock.mark(f"pythia-{name}: learned matching, {setting}, {args.steps} steps")
        attempt(out, setting, learned_run, setting, graphs, template, seq, args, work)
    out["self_tokens_at_defaults"] = default_self_tokens(seq)
    return out


def agreement(args, work: Path) -> dict:
    """The example pair's dual barrier on --device in --precision, and on the CPU in fp32."""
    from hf_rebasin.assets import example_pair
    from hf_rebasin.pipeline import run
    pair = example_pair()
    held = str(pair / "heldout.txt")
    barriers = {}
    for device, precision in ((args.device, args.precision), ("cpu", "fp32")):
        options = MergeOptions(method="dual", data=held, train_data=held, seq_len=args.agree_seq,
                               max_eval_tokens=args.agree_tokens, steps=args.agree_steps,
                               learn_batch_size=args.agree_batch, device=device, learn_precision=precision,
                               lambdas=args.agree_lambdas, holdout=args.agree_holdout,
                               checkpoint_dir=str(work / "agree-checkpoints"))
        began = time.perf_counter()
        result = run([str(pair / "model-a"), str(pair / "model-b")], options, progress=False)
        barriers[f"{device} {precision}"] = {"barrier": result.barrier, "seconds": time.perf_counter() - began}
        release(args.device)
    first, second = barriers.values()
    difference = abs(first["barrier"] - second["barrier"])
    return {"runs": barriers, "difference": difference, "tolerance": AGREE_NATS, "agree": difference <= AGREE_NATS,
            "settings": f"{args.agree_steps} steps x {args.agree_batch} x {args.agree_seq}, "
                        f"{args.agree_tokens} evaluation tokens"}


# --- the report ----------------------------------------------------------------------------------------

def gib(value) -> str:
    return "n/a" if value is None else f"{value / GIB:.2f}"


def plan_text(plan: dict | None) -> tuple[str, str, str]:
    """(estimate GiB, free GiB, micro-batch x accumulation and checkpointing) of a memory plan, or n/a."""
    if not plan:
        return "n/a", "n/a", "n/a"
    layout = f"{plan.get('micro_batch', '?')} x {plan.get('accumulation', '?')}" + (
        ", checkpointing" if plan.get("gradient_checkpointing") else "")
    return gib(plan.get("estimated_peak_bytes")), gib(plan.get("free_bytes")), layout


def print_tables(rows: list[dict], agreed: dict | None, budgets: list[int], device_name: str) -> None:
    hours = " | ".join(f"h at {n:,}" for n in budgets)
    print(f"\nDevice: {device_name}; torch {torch.__version__}; transformers {transformers_version()}\n")
    print(f"| config | setting | batch x seq | plan: micro x accum | s/step | tokens/s | s per 1,000 steps | {hours} "
          "| peak GiB | plan estimate GiB | free GiB |")
    print("|---|---|---|---|---|---|---|" + "---|" * len(budgets) + "---|---|---|")
    for row in rows:
        for setting in ("defaults", "papers"):
            r = row.get(setting, {})
            if "error" in r:
                print(f"| {row['config']} | {setting} | FAILED: {r['error']} |")
                continue
            estimate, free, layout = plan_text(r.get("memory_plan"))
            print(f"| {row['config']} | {setting} | {r['batch']} x {r['seq']} | {layout} | {r['step_s']:.3f} | "
                  f"{r['tokens_per_s']:,.0f} | {r['s_per_1000_steps']:,.0f} | "
                  + " | ".join(f"{r['hours'][str(n)]:.1f}" for n in budgets)
                  + f" | {gib(r['peak_bytes'])} | {estimate} | {free} |")
    print("\n| config | plain step s (16 x 512) | dual/plain (papers) | sampling tokens/s | sampling peak GiB | "
          "plan's sampling estimate GiB | `self` at the defaults: sample s / train s |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        plain, sampling, defaults, papers = (row.get(k, {}) for k in ("plain", "sampling", "defaults", "papers"))
        plain_s = f"{plain['step_s']:.3f}" if "step_s" in plain else f"FAILED: {plain.get('error')}"
        ratio = f"{papers['step_s'] / plain['step_s']:.2f}" if "step_s" in plain and "step_s" in papers else "n/a"
        if "tokens_per_s" in sampling:
            rate, sample_peak = f"{sampling['tokens_per_s']:,.0f} ({sampling['dtype']})", gib(sampling["peak_bytes"])
            sample_s = row["self_tokens_at_defaults"] / sampling["tokens_per_s"]
        else:
            rate, sample_peak, sample_s = f"FAILED: {sampling.get('error')}", "n/a", None
        plan = (defaults.get("memory_plan") or {}) if isinstance(defaults, dict) else {}
        train_s = defaults["default_steps"] * defaults["step_s"] if "step_s" in defaults else None
        versus = (f"{'n/a' if sample_s is None else f'{sample_s:,.0f}'} / "
                  f"{'n/a' if train_s is None else f'{train_s:,.0f}'}")
        print(f"| {row['config']} | {plain_s} | {ratio} | {rate} | {sample_peak} | "
              f"{gib(plan.get('sampling_peak_bytes'))} | {versus} |")
    if agreed is not None:
        if "error" in agreed:
            print(f"\nAgreement (example pair, dual): FAILED: {agreed['error']}")
        else:
            runs = ", ".join(f"{k}: {v['barrier']:.4f} ({v['seconds']:.0f} s)" for k, v in agreed["runs"].items())
            print(f"\nAgreement (example pair, dual, {agreed['settings']}): barrier {runs}; difference "
                  f"{agreed['difference']:.2e} nats, tolerance {agreed['tolerance']} -> "
                  f"{'AGREE' if agreed['agree'] else 'DISAGREE'}")


def transformers_version() -> str:
    import transformers
    return transformers.__version__


def failures(rows: list[dict], agreed: dict | None) -> list[str]:
    found = [f"{row['config']} {key}" for row in rows for key in ("plain", "sampling", "defaults", "papers")
             if "error" in row.get(key, {})]
    if agreed is not None and ("error" in agreed or not agreed["agree"]):
        found.append("agreement")
    return found


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="160m,1b", help="comma-separated Pythia configs (merge_size.PYTHIA)")
    parser.add_argument("--steps", type=int, default=10, help="learned-matching steps per run (2 are warm-up)")
    parser.add_argument("--papers-batch", type=int, default=16, help="windows per step of the papers' run")
    parser.add_argument("--seq", type=int, default=None, help="window length (default the package's: 512)")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--budget-steps", default="20000,50000", help="steps whose hours are projected")
    parser.add_argument("--plain-repeats", type=int, default=5)
    parser.add_argument("--agree-steps", type=int, default=50)
    parser.add_argument("--agree-batch", type=int, default=16)
    parser.add_argument("--agree-seq", type=int, default=128)
    parser.add_argument("--agree-tokens", type=int, default=16384)
    parser.add_argument("--agree-lambdas", type=int, default=None)
    parser.add_argument("--agree-holdout", type=int, default=None)
    parser.add_argument("--no-agreement", action="store_true", help="skip the example pair's GPU/CPU check")
    parser.add_argument("--quick", action="store_true", help="160m alone, 6 steps, 20 agreement steps")
    parser.add_argument("--dry-run", action="store_true",
                        help="every part on the CPU at a tiny config and shapes, in seconds (CI runs it)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if args.quick:
        args.configs, args.steps, args.agree_steps = "160m", 6, 20
    if args.dry_run:
        args.device, args.configs, args.steps, args.seq, args.papers_batch = "cpu", "tiny", 3, 16, 4
        args.plain_repeats, args.agree_steps, args.agree_batch, args.agree_seq = 1, 2, 4, 32
        args.agree_tokens, args.agree_lambdas, args.agree_holdout = 512, 3, 0
    if args.steps < 3:
        parser.error("--steps must be at least 3 (two warm-up steps, then the timed ones)")
    args.budget_steps = [int(n) for n in args.budget_steps.split(",")]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    clock = Clock()
    device_name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    clock.mark(f"gpu_check on {device_name} ({args.precision}), configs {args.configs}, {args.steps} steps a run")
    rows, agreed = [], None
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in args.configs.split(","):
            row = check_config(name, args, work, clock)
            rows.append(row)
            print(json.dumps(row), flush=True)
        if not args.no_agreement:
            clock.mark("agreement: the example pair's dual barrier, "
                       f"{args.device} {args.precision} against cpu fp32")
            agreed = attempt({}, "agreement", agreement, args, work)
            print(json.dumps(agreed), flush=True)
    clock.mark("done")
    print_tables(rows, agreed, args.budget_steps, device_name)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device_name, "rows": rows, "agreement": agreed}, indent=1))
    failed = failures(rows, agreed)
    if failed:
        print(f"\nFAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
