"""Learned matching's training step under CUDA's rules, without a GPU (hf_rebasin/match/cuda_rules.py): every registered
adapter × lm/dual × whole-model/layer-by-layer × bf16/fp32 runs one step on simulated CUDA tensors under CUDA's
autocast; no op CUDA would reject, no host sync and no float64 op in this project's code."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from hf_rebasin import tiny
from hf_rebasin.adapters.moe import SparseMoe
from hf_rebasin.core import symmetry
from hf_rebasin.match.cuda_rules import (
    CudaRuleViolation,
    Recorder,
    autocast_has_rule,
    check_plain_step,
    check_step,
    simulated_cuda,
)
from hf_rebasin.match.params import Orthogonal
from hf_rebasin.sources import models

# transformers' mixture-of-experts forward asks the CUDA device for its capability (integrations/moe.py chooses a
# grouped matmul by it), which the simulated device cannot answer: the MoE classes' learned step is not checked here
KINDS = [kind for kind in tiny.kinds() if not isinstance(tiny.adapter_of(kind), SparseMoe)]


def test_cuda_autocast_has_no_linalg_rules_while_the_cpus_has():
    """The premise, read from the dispatcher: CPU autocast casts linalg_solve/inv to fp32, CUDA's leaves them alone
    (a bf16 weight then meets an fp32 map); both cast matmuls."""
    for op in ("aten::linalg_solve", "aten::linalg_inv_ex", "aten::_linalg_solve_ex", "aten::linalg_matrix_exp"):
        assert not autocast_has_rule(op, "cuda"), op
    assert autocast_has_rule("aten::linalg_solve", "cpu") and autocast_has_rule("aten::linalg_inv_ex", "cpu")
    assert autocast_has_rule("aten::mm", "cuda") and autocast_has_rule("aten::bmm", "cuda")


def test_the_harness_applies_cudas_rules_not_the_cpus():
    """The failure the project's first GPU run would have hit: solve(fp32 map, bf16 weight) under autocast passes on
    the CPU and is rejected under simulated CUDA."""
    maps, weight = torch.eye(4).expand(2, 4, 4), torch.randn(2, 4, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.linalg.solve(maps, weight.bfloat16()).dtype == torch.float32  # CPU autocast casts to fp32
    with simulated_cuda():
        m, w = maps.to("cuda"), weight.bfloat16().to("cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert (m[0] @ m[0]).dtype == torch.bfloat16  # CUDA's autocast is on
            with pytest.raises(RuntimeError, match="same dtype"):
                torch.linalg.solve(m, w)
            with Recorder("cuda"), pytest.raises(CudaRuleViolation, match="linalg_inv_ex with torch.bfloat16"):
                torch.linalg.inv_ex(w[:, :3, :3])


def test_the_harness_counts_syncs_copies_and_float64():
    with simulated_cuda():
        x = torch.ones(3)
        with Recorder("cuda", strict=False) as recorder:
            y = x.to("cuda")
            y.double()
            y.cpu()
            with pytest.raises(Exception):  # noqa: B017 - fake tensors cannot answer; the sync is counted first
                y.sum().item()
        counts = recorder.counts
        assert counts.host_to_device == 1 and sum(counts.float64.values()) == 1
        assert counts.syncs == {"device_to_host_copy": 1, "_local_scalar_dense": 1}
        with Recorder("cuda"), pytest.raises(CudaRuleViolation, match="host sync \\(nonzero\\)"):
            torch.nonzero(y)


@pytest.fixture(scope="module")
def pairs(tiny_dirs, tmp_path_factory):
    """kind -> (template, [graph A, graph B]) for every registered variant."""
    root = tmp_path_factory.mktemp("cuda_rules")
    out = {}
    for kind in KINDS:
        template = models.load(tiny_dirs[kind])
        b = models.load(tiny.make_tiny(kind, root / kind, seed=2))
        out[kind] = template, [models.canonicalise(template).materialise(), models.canonicalise(b).materialise()]
    return out


@pytest.fixture(scope="module")
def plain_model_syncs(pairs):
    """The host syncs of the model's own forward in a plain training step (transformers checks its position ids
    for packed sequences with one .all(): any training of the model pays it)."""
    return {kind: check_plain_step(template).total.model_syncs for kind, (template, _) in pairs.items()}


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("layered", [False, True], ids=["whole", "layered"])
@pytest.mark.parametrize("method", ["lm", "dual"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_learned_step_runs_under_cudas_rules(kind, method, layered, precision, pairs, plain_model_syncs):
    template, graphs = pairs[kind]
    report = check_step(template, graphs, method=method, layered=layered, precision=precision)  # strict: raises
    total = report.total
    assert sum(total.syncs.values()) == 0 and sum(total.float64.values()) == 0, report.where
    assert total.model_syncs == plain_model_syncs[kind]  # nothing beyond what the model's own forward does
    assert total.host_to_device == 2  # the batch: inputs and their token ids (LMs) or labels (classifiers)
    assert report.forward.launches > 0 and report.backward.launches > 0 and report.optimizer.launches > 0


@pytest.mark.parametrize("layered", [False, True], ids=["whole", "layered"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_soft_target_step_runs_under_cudas_rules(kind, layered, pairs, plain_model_syncs):
    """--soft-targets: the endpoints' forwards (no gradient) add no sync and no float64 op; the whole-model path runs
    them by one batched forward (one more run of the model, with its own syncs), the layered path one by one (two)."""
    template, graphs = pairs[kind]
    report = check_step(template, graphs, method="dual", layered=layered, soft_targets=0.5)  # strict: raises
    total = report.total
    assert sum(total.syncs.values()) == 0 and sum(total.float64.values()) == 0, report.where
    runs = 3 if layered else 2
    assert total.model_syncs == sum([plain_model_syncs[kind]] * runs, Counter())
    hard = check_step(template, graphs, method="dual", layered=layered)
    assert report.forward.launches > hard.forward.launches


@pytest.mark.parametrize("kind", KINDS)
def test_a_plain_init_step_with_permutations_runs_under_cudas_rules(kind, pairs):
    """--init plain: the learned elements start at a group element with head and FFN permutations."""
    template, graphs = pairs[kind]
    report = check_step(template, graphs, method="dual", init="plain")
    assert sum(report.total.syncs.values()) == 0 and sum(report.total.float64.values()) == 0, report.where


def test_fp32_orthogonal_parameterisations_stay_orthogonal_far_from_the_identity():
    """No float64 in a step: the start Q0 is kept as a fixed factor and S starts at zero, so fp32 Cayley and expm
    stay orthogonal to 1e-5 even for a start with eigenvalues next to -1 (rotations by nearly pi), where the old
    D·cayley(S) form needed a huge S."""
    gen = torch.Generator().manual_seed(0)
    n = 16
    basis = symmetry.random_orthogonal(n, gen)
    angle = math.pi - 1e-4
    block = torch.tensor([[math.cos(angle), math.sin(angle)], [-math.sin(angle), math.cos(angle)]], dtype=torch.float64)
    start = basis @ torch.block_diag(*[block] * (n // 2)) @ basis.T
    for kind in ("cayley", "expm"):
        orth = Orthogonal(n, kind=kind, start=start.float())
        assert all(p.dtype == torch.float32 for p in [*orth.parameters(), *orth.buffers()])
        assert (orth() - start).abs().max() < 1e-5, kind
        with torch.no_grad():
            orth.raw.normal_(generator=gen)
        value = orth()
        assert value.dtype == torch.float32
        assert (value.T @ value - torch.eye(n)).abs().max() < 1e-5, kind
