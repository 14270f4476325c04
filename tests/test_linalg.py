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


def test_best_signed_permutation_is_the_maximiser_of_the_overlap():
    """tr(G^T M) + tr(|G|^T M_gain) over the signed permutations: the assignment on |M| + M_gain with the signs of
    the matched entries equals the brute-force optimum over all 2^d d! elements, and recovers a planted one."""
    gen = torch.Generator().manual_seed(0)
    d = 4
    for _ in range(5):
        m, m_gain = torch.randn(d, d, generator=gen, dtype=torch.float64), torch.rand(d, d, generator=gen,
                                                                                      dtype=torch.float64)
        overlap = lambda g, m=m, m_gain=m_gain: float((g * m).sum() + (g.abs() * m_gain).sum())
        best = max(overlap(torch.eye(d, dtype=torch.float64)[list(p)] * torch.tensor(s, dtype=torch.float64)[:, None])
                   for p in itertools.permutations(range(d)) for s in itertools.product((-1.0, 1.0), repeat=d))
        g = linalg.best_signed_permutation_matrix(m, m_gain)
        assert torch.equal(g.abs().sum(0), torch.ones(d, dtype=torch.float64)) and overlap(g) == pytest.approx(best)
    planted = symmetry.random_signed_permutation(16, gen)
    noisy = planted + 0.1 * torch.randn(16, 16, generator=gen, dtype=torch.float64)
    assert torch.equal(linalg.best_signed_permutation_matrix(noisy, torch.zeros(16, 16, dtype=torch.float64)), planted)
