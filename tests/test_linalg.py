"""The closed-form solvers weight matching is built on, against their definitions."""
import itertools

import pytest
import torch

from hf_rebasin.core import symmetry
from hf_rebasin.match import linalg


@pytest.mark.parametrize("d", [2, 3, 16, 257])
def test_procrustes_fixing_ones_is_the_constrained_maximiser(d):
    gen = torch.Generator().manual_seed(d)
    m = torch.randn(d, d, generator=gen, dtype=torch.float64)
    g = linalg.procrustes_fixing_ones(m)
    ones = torch.ones(d, dtype=torch.float64)
    assert torch.allclose(g @ g.T, torch.eye(d, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(g @ ones, torch.sign(ones @ m @ ones) * ones, atol=1e-12)
    # the textbook construction: Procrustes in an explicit basis of the complement of 1
    q = linalg.ones_complement(d)
    textbook = q @ linalg.procrustes(q.T @ m @ q) @ q.T + torch.sign(ones @ m @ ones) * torch.outer(ones, ones) / d
    assert torch.allclose(g, textbook, atol=1e-10)
    overlap = float((g * m).sum())
    for _ in range(20):  # no other rotation of the constrained group does better
        r = symmetry.random_rotation_fixing_ones(d, gen).double()
        assert float((r * m).sum()) <= overlap + 1e-9


def test_assignment_is_optimal_and_the_solvers_agree(monkeypatch):
    pytest.importorskip("lapjv", reason="the optional fast solver: pip install hf-rebasin[fast]")
    gen = torch.Generator().manual_seed(0)
    small = torch.randn(6, 6, generator=gen)
    best = max(itertools.permutations(range(6)), key=lambda p: float(small[list(range(6)), list(p)].sum()))
    assert linalg.assignment(small).tolist() == list(best)
    big = torch.randn(2 * linalg.LAPJV_FROM, 2 * linalg.LAPJV_FROM, generator=gen)
    found = {}
    for solver in ("scipy", "lapjv"):
        monkeypatch.setattr(linalg, "SOLVER", solver)
        found[solver] = linalg.assignment(big)
    assert sorted(found["lapjv"].tolist()) == list(range(len(big)))
    assert torch.equal(found["scipy"], found["lapjv"])
