"""Cost of one learned-matching step against one ordinary training step of one model.

    .venv/bin/python benchmarks/step_time.py [--config pythia-14m|pythia-70m] [--batch 8] [--seq 128]

Builds two random models with the shapes of EleutherAI/pythia-14m (or -70m), then, at the same batch,
compares (1) forward + backward of one model with trainable weights (a training step without the
optimiser), (2) one dual step (both endpoints' symmetry parameters: transform both graphs, interpolate,
export to the state dict, functional_call forward, backward into the symmetry parameters), (3) one lm
step, and (4, 5) the dual step computed layer by layer (what --fsdp runs) without and with gradient
checkpointing (--gradient-checkpointing).  Times come from one process that runs the modes in interleaved
rounds (best and median of --repeats); memory from one fresh process per mode: CUDA max_memory_allocated on
a GPU, peak RSS on the CPU, and on both the bytes autograd saves for the backward.  Prints a Markdown row;
issue 14's target is a dual/plain ratio <= 1.3.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CONFIGS = {  # the shapes of the Pythia suite (vocabulary padded to 50304 as in the released checkpoints)
    "pythia-14m": dict(hidden_size=128, num_hidden_layers=6, num_attention_heads=4, intermediate_size=512),
    "pythia-70m": dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, intermediate_size=2048),
}
COMMON = dict(vocab_size=50304, max_position_embeddings=2048, rotary_pct=0.25, use_parallel_residual=True,
              tie_word_embeddings=False)


def make_pair(config_name: str, folder: Path) -> None:
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    for seed in (0, 1):
        torch.manual_seed(seed)
        GPTNeoXForCausalLM(GPTNeoXConfig(**CONFIGS[config_name], **COMMON)).save_pretrained(folder / f"m{seed}")


def build_step(mode: str, folder: Path, batch: int, seq: int, device: str):
    """A closure running one step of the mode: plain forward + backward of model A, or a dual / lm step."""
    import torch

    from hf_rebasin.match.learned import PathLoss
    from hf_rebasin.match.params import SymmetryParams
    from hf_rebasin.sources import models
    a = models.load(folder / "m0")
    x = torch.randint(0, 50304, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    autocast = torch.bfloat16 if device.startswith("cuda") else None
    if mode == "plain":
        model = a.model.to(device).train()
        for p in model.parameters():
            p.requires_grad_(True)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16) if autocast else _Null():
                logits = model(input_ids=x, use_cache=False).logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
            loss.backward()
            model.zero_grad(set_to_none=True)
        return step
    graph_a, graph_b = models.canonicalise(a), models.canonicalise(models.load(folder / "m1"))
    ends = {"1": SymmetryParams(graph_b.spec)}
    if mode.startswith("dual"):
        ends["0"] = SymmetryParams(graph_a.spec)
    if mode in ("dual", "lm"):
        path = PathLoss([graph_a, graph_b], ends, a, "causal-lm", autocast).to_device(device)
    else:  # layer by layer (what --gradient-checkpointing and --fsdp run)
        from hf_rebasin.match.layered import LayeredPathLoss
        path = LayeredPathLoss([graph_a, graph_b], ends, a, "causal-lm", autocast,
                               checkpointing=mode == "dual-checkpointed").to_device(device)
    params = [p for p in path.parameters() if p.requires_grad]

    def step():
        path(x, None, 0.5).backward()
        for p in params:
            p.grad = None
    return step


def memory(mode: str, folder: Path, batch: int, seq: int, device: str) -> dict:
    """Peak memory of one mode (run alone in its own process) and what autograd saves for the backward."""
    import torch
    step = build_step(mode, folder, batch, seq, device)
    saved = saved_for_backward(step)  # also the warm-up
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"mode": mode, "peak_bytes": peak, "saved_bytes": saved}


def timing(folder: Path, batch: int, seq: int, repeats: int, device: str) -> dict:
    """Step times of the three modes, interleaved round by round so that changing load on the machine
    falls on all of them alike."""
    import torch
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    steps = {mode: build_step(mode, folder, batch, seq, device) for mode in MODES}
    for step in steps.values():
        step()  # warm-up
    times = {mode: [] for mode in MODES}
    for _ in range(repeats):
        for mode, step in steps.items():
            sync()
            start = time.perf_counter()
            step()
            sync()
            times[mode].append(time.perf_counter() - start)
    return {mode: {"min_s": min(t), "median_s": statistics.median(t), "times": t} for mode, t in times.items()}


def saved_for_backward(step) -> int:
    """Bytes of the distinct storages autograd keeps for the backward during one step (activations and, in
    learned matching, the transformed and interpolated weights; frozen weights it only references count too)."""
    import torch
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step()
    return sum(storages.values())


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


MODES = ("plain", "dual", "lm", "dual-layered", "dual-checkpointed")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=tuple(CONFIGS), default="pythia-14m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: "timing" or a mode's memory, as JSON
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.worker:
        folder = Path(args.folder)
        out = (timing(folder, args.batch, args.seq, args.repeats, device) if args.worker == "timing"
               else memory(args.worker, folder, args.batch, args.seq, device))
        print(json.dumps(out))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        make_pair(args.config, folder)
        results = {}
        for worker in ("timing", *MODES):
            command = [sys.executable, __file__, "--worker", worker, "--folder", str(folder), "--config", args.config,
                       "--batch", str(args.batch), "--seq", str(args.seq), "--repeats", str(args.repeats),
                       "--threads", str(args.threads), "--device", device]
            run = subprocess.run(command, capture_output=True, text=True,
                                 env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
            if run.returncode != 0:
                print(run.stderr[-3000:], file=sys.stderr)
                return 1
            results[worker] = json.loads(run.stdout.strip().splitlines()[-1])
    t = results["timing"]
    mib = lambda b: b / 2**20
    ms = lambda mode: f"{t[mode]['min_s'] * 1e3:.0f} ({t[mode]['median_s'] * 1e3:.0f})"
    def ratio(mode: str) -> str:
        return f"{t[mode]['min_s'] / t['plain']['min_s']:.2f} ({t[mode]['median_s'] / t['plain']['median_s']:.2f})"
    memory_kind = "CUDA max allocated" if device.startswith("cuda") else "peak RSS"
    where = device if device.startswith("cuda") else f"cpu, {args.threads} thread(s)"
    params = sum(p.numel() for p in __import__("transformers").GPTNeoXForCausalLM(
        __import__("transformers").GPTNeoXConfig(**CONFIGS[args.config], **COMMON)).parameters()) / 1e6
    print(f"step times: best of {args.repeats} interleaved rounds (median in brackets)")
    learned = MODES[1:]
    print("| model | device | batch × seq | plain f+b, ms | " + " | ".join(f"{m} step, ms | {m} ratio" for m in learned)
          + f" | {memory_kind}, MiB: {' / '.join(MODES)} | saved for backward, MiB: {' / '.join(MODES)} |")
    print("|---|---|---|---|" + "---|---|" * len(learned) + "---|---|")
    print(f"| {args.config} shape, {params:.1f}M params | {where} | {args.batch} × {args.seq} | {ms('plain')} | "
          + " | ".join(f"{ms(m)} | {ratio(m)}" for m in learned) + " | "
          + " / ".join(f"{mib(results[m]['peak_bytes']):.0f}" for m in MODES) + " | "
          + " / ".join(f"{mib(results[m]['saved_bytes']):.0f}" for m in MODES) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
