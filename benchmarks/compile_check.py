"""Does torch.compile help the layer step of learned matching?  A check on the CPU (inductor's C++ backend).

    .venv/bin/python benchmarks/compile_check.py              # Pythia-70M shape, one decoder layer, dual

The layer step is what the layer-by-layer loss (`--gradient-checkpointing`, `--fsdp`) runs for each decoder layer
and every step: B's layer under the learned group element (head maps, their inverses, the residual rotation and
scale), interpolated with A's and converted to the model's own tensors (`SymmetryParams.apply_layer`, `mix`,
`adapter.layer_from_canonical`).  Run eagerly and compiled (`torch.compile`, default mode) on the same inputs,
forward and backward of the sum of squares of the layer's tensors; printed: the largest difference of the outputs
and of the gradients of the symmetry parameters (compiled against eager, relative to the largest value), the aten
ops that are not views of one eager forward + backward (each a kernel launch on a GPU) against the loops inductor
generated for the same (the matrix products it calls out to not counted), the graphs and graph breaks
(torch._dynamo.explain), the time of one compilation, and the median time of a call eager and compiled.
"""
from __future__ import annotations

import argparse
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

from hf_rebasin.core.canonical import mix  # noqa: E402
from hf_rebasin.match.cuda_rules import Recorder  # noqa: E402
from hf_rebasin.match.params import SymmetryParams  # noqa: E402
from hf_rebasin.sources import models  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="70m", choices=list(PYTHIA))
    parser.add_argument("--layer", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--work", help="folder for the checkpoints (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        folders = [make_checkpoint(args.config, seed, work / f"seed{seed}", tokenizer=False) for seed in (1, 2)]
        template = models.load(folders[0])
        a, b = (models.canonicalise(models.load(f)) for f in folders)
        i, spec = args.layer, a.spec
        layer_a, layer_b = a.layer(i), b.layer(i)
    end = SymmetryParams(spec)
    with torch.no_grad():  # a group element away from the identity
        gen = torch.Generator().manual_seed(0)
        for p in end.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    adapter, config = template.adapter, template.config

    def layer_step(tensors_a, tensors_b):
        moved = end.apply_layer(tensors_b, i, end.element())
        state = adapter.layer_from_canonical(mix([tensors_a, moved], [0.6, 0.4]), config, spec, i)
        loss = sum((v.float() ** 2).sum() for v in state.values())
        grads = torch.autograd.grad(loss, list(end.parameters()))
        return state, grads

    def timed(fn, repeats):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn(layer_a, layer_b)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    eager_state, eager_grads = layer_step(layer_a, layer_b)
    with Recorder("cpu", strict=False) as recorder:
        layer_step(layer_a, layer_b)
    eager_launches = recorder.counts.launches

    import torch._inductor.metrics as metrics
    metrics.reset()
    compiled = torch.compile(layer_step)
    start = time.perf_counter()
    compiled_state, compiled_grads = compiled(layer_a, layer_b)
    compile_s = time.perf_counter() - start
    generated = metrics.generated_kernel_count
    explained = torch._dynamo.explain(layer_step)(layer_a, layer_b)

    def relative(x, y):
        x, y = x.detach().double(), y.detach().double()
        return float((x - y).abs().max() / y.abs().max().clamp_min(1e-30))

    out_diff = max(relative(compiled_state[k], eager_state[k]) for k in eager_state)
    grad_diff = max(relative(c, e) for c, e in zip(compiled_grads, eager_grads))
    eager_s, compiled_s = timed(layer_step, args.repeats), timed(compiled, args.repeats)
    print(f"Pythia-{args.config} shape, layer {i}, forward + backward of one layer step, CPU "
          f"({torch.get_num_threads()} threads)")
    print("| | eager | compiled |\n|---|---|---|")
    print(f"| kernels (eager: aten ops that are not views; compiled: loops inductor generated, the matrix products "
          f"it calls out to not counted) | {eager_launches} | {generated} |")
    print(f"| median seconds per call | {eager_s:.4f} | {compiled_s:.4f} |")
    print(f"compile time {compile_s:.1f} s; graphs {explained.graph_count}, graph breaks "
          f"{explained.graph_break_count}; largest relative difference, compiled vs eager: outputs {out_diff:.1e}, "
          f"gradients {grad_diff:.1e}")
    return 0 if out_diff < 1e-5 and grad_diff < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
