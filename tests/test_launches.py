"""A learned step's kernel launches (hf_rebasin/match/action.py): the action computed with the scalars folded into
the step's small matrices and the interpolation by foreach ops gives the plain action's point (core.symmetry, what
exports use) to fp32 rounding, and a step's launches stay within their measured multiple of a plain training step
under CUDA's rules (hf_rebasin/match/cuda_rules.py; BENCHMARKS.md, "Launches of a learned step")."""
from __future__ import annotations

import pytest
import torch

from hf_rebasin import tiny
from hf_rebasin.core import symmetry
from hf_rebasin.core.canonical import interpolate, residual_role
from hf_rebasin.match.action import Action, combine, graph_share
from hf_rebasin.match.blocks import read_block, read_keys
from hf_rebasin.match.cuda_rules import check_plain_step, check_step
from hf_rebasin.match.learned import tf32_matmuls
from hf_rebasin.match.path import stored
from hf_rebasin.sources import models

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("kind", tiny.kinds())
def test_the_folded_action_is_the_plain_action(kind, tiny_dirs, tmp_path):
    """(1 - w) A + w t(B), every residual write times r: from action.combine and from core.symmetry.apply."""
    a = models.canonicalise(models.load(tiny_dirs[kind])).materialise()
    b = models.canonicalise(models.load(tiny.make_tiny(kind, tmp_path / "b", seed=2))).materialise()
    t = symmetry.random_transform(b.spec, seed=3)
    if b.spec.scale_exact:
        t.scale = torch.tensor(1.3)
    factor, w = torch.tensor(0.8), 0.35
    blocked = stored(b, None)  # each layer's reads and writes in one block each (the learned step's layout)
    assert read_block([blocked.params[k] for k in read_keys(blocked.params, 0)]) is not None
    points = [combine([({}, a.params), graph_share(g, Action.of(t, w, factor, b.spec))], [1 - w, w], factor)
              for g in (b, blocked)]
    moved = symmetry.apply(b, symmetry.Transform(t.rotation, float(t.scale), t.head_perm, t.qk_maps, t.ov_maps,
                                                 t.ffn_perm, t.glu_scale, t.expert_perm, t.expert_unit_perm,
                                                 t.expert_glu_scale))
    expected = interpolate([a, moved], [1 - w, w]).params
    for point in points:
        assert point.keys() == expected.keys()
        for key, value in expected.items():
            value = value * factor if residual_role(key) == "write" else value
            assert (point[key] - value).abs().max() <= 1e-5 * (1 + value.abs().max()), key


def test_tf32_is_on_inside_the_block_only():
    before = torch.get_float32_matmul_precision()
    with tf32_matmuls(True):
        assert torch.get_float32_matmul_precision() == "high"
    assert torch.get_float32_matmul_precision() == before
    with tf32_matmuls(False):
        assert torch.get_float32_matmul_precision() == before


@pytest.fixture(scope="module")
def neox(tiny_dirs, tmp_path_factory):
    template = models.load(tiny_dirs["gpt_neox"])
    b = models.load(tiny.make_tiny("gpt_neox", tmp_path_factory.mktemp("launches") / "b", seed=2))
    return template, [models.canonicalise(m).materialise() for m in (template, b)]


# launches of a dual step over those of a plain training step of the model (forward, backward, fused AdamW), tiny
# GPT-NeoX under CUDA's rules: what was measured with each layer's reads and writes in one block and the soft target's
# endpoints run batched (2.62, 2.89, 3.06, 3.32; before: 2.78, 3.08, 3.29, 3.94; before the folded action 3.55, 3.87,
# 4.39, 7.20) and 3 % more; one more op per tensor (an elementwise product, a cast of a small matrix per use)
# exceeds them
BOUNDS = {("bf16", False, 0.0): 2.70, ("fp32", False, 0.0): 2.98, ("bf16", True, 0.0): 3.15, ("bf16", False, 1.0): 3.42}


@pytest.mark.parametrize(("precision", "layered", "soft"), list(BOUNDS))
def test_a_dual_step_launches_within_its_measured_multiple_of_a_plain_step(precision, layered, soft, neox):
    template, graphs = neox
    plain = check_plain_step(template, precision=precision).total.launches
    step = check_step(template, graphs, method="dual", layered=layered, precision=precision, soft_targets=soft)
    assert step.total.launches / plain <= BOUNDS[(precision, layered, soft)]
