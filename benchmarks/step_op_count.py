"""Aten ops of one dual step and of a plain training step, counted on the CPU for any checkout of the project
(to compare commits with one yardstick; `cuda_step_counts.py` counts the current code under CUDA's rules).

    git worktree add /tmp/before 6750703
    .venv/bin/python benchmarks/step_op_count.py /tmp/before      # the code of that commit
    .venv/bin/python benchmarks/step_op_count.py .                # this checkout

Pythia-70M shape (random init), batch 2 × 64, fp32 on the CPU, both models' learned elements at the identity
(the default start), `PathLoss` (the whole-model loss), AdamW as torch picks it on the CPU (foreach) on both
sides.  Counted in the second step (the first creates AdamW's state): aten ops that are not views, the ops that
would make a host wait for a GPU (`_local_scalar_dense`, `_linalg_check_errors`, `nonzero`, `unique`; on the CPU
AdamW's own step counter and the forward's `torch.unique` of the batch also read values, the latter because no
token ids are passed here), and ops with a float64 operand.
"""
from __future__ import annotations

import collections
import copy
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
checkout = Path(sys.argv[1] if len(sys.argv) > 1 else HERE.parent).resolve()
sys.path.insert(0, str(checkout))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

import hf_rebasin  # noqa: E402
from hf_rebasin.match.learned import PathLoss  # noqa: E402
from hf_rebasin.match.params import SymmetryParams  # noqa: E402
from hf_rebasin.sources import models  # noqa: E402

WAITS = {"_local_scalar_dense", "nonzero", "_unique2", "_linalg_check_errors"}


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops, self.waits, self.float64 = 0, collections.Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "aten" and not func.is_view:
            self.ops += 1
            name = func.__name__.split(".")[0]
            if name in WAITS:
                self.waits[name] += 1
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            self.float64 += any(t.dtype == torch.float64 for t in tensors)
        return func(*args, **(kwargs or {}))


def counted(step) -> Count:
    step()
    with Count() as count:
        step()
    return count


def main() -> int:
    from merge_size import make_checkpoint  # (after hf_rebasin: it puts this repository first on the path)
    assert Path(hf_rebasin.__file__).resolve().is_relative_to(checkout), hf_rebasin.__file__
    with tempfile.TemporaryDirectory() as tmp:
        folders = [make_checkpoint("70m", seed, Path(tmp) / f"seed{seed}", tokenizer=False) for seed in (1, 2)]
        template = models.load(folders[0])
        graphs = [models.canonicalise(models.load(f)).materialise() for f in folders]
        x = torch.randint(0, 50_000, (2, 64), generator=torch.Generator().manual_seed(0))
        path = PathLoss(graphs, {"0": SymmetryParams(graphs[0].spec), "1": SymmetryParams(graphs[1].spec)}, template,
                        template.task)
        optimizer = torch.optim.AdamW([p for p in path.parameters() if p.requires_grad], lr=1e-3)

        def dual():
            path(x, None, 0.3).backward()
            optimizer.step()
            optimizer.zero_grad()

        model = copy.deepcopy(template.model)
        for p in model.parameters():
            p.requires_grad_(True)
        plain_optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def plain():
            logits = model(input_ids=x, use_cache=False).logits[:, :-1].float()
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).backward()
            plain_optimizer.step()
            plain_optimizer.zero_grad()

        d, p = counted(dual), counted(plain)
        print(f"{checkout}: dual step {d.ops} aten ops (plain step {p.ops}: {d.ops / p.ops:.2f}x); value reads "
              f"{dict(d.waits)}; float64 ops {d.float64}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
