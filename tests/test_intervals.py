"""The bootstrap intervals of barrier.json (evaluation/intervals.py): documents resampled together, widths that
shrink like 1/sqrt(n), nominal coverage of a known mean, and the report, card and plot that carry them."""
from __future__ import annotations

import json
import math

import numpy as np

from hf_rebasin.evaluation.intervals import path_intervals, units_of

WEIGHTS = [(1.0, 0.0), (0.5, 0.5), (0.0, 1.0)]
MEANS = np.array([2.0, 2.5, 2.2])  # the loss at λ = 0, 0.5, 1: a barrier of 0.4


def _synthetic(n, rng):
    """Per-window losses of n windows of one predicted token each at the three points."""
    return MEANS[:, None] + rng.standard_normal((3, n)), np.ones(n)


def _width(interval):
    return interval[1] - interval[0]


def test_the_interval_shrinks_like_one_over_root_n():
    rng = np.random.default_rng(1)
    widths = {}
    for n in (400, 6400):
        loss, count = _synthetic(n, rng)
        result = path_intervals(loss, count, np.arange(n), WEIGHTS, [0, 2])
        widths[n] = _width(result["loss_interval"][1]), _width(result["barrier_interval"])
    for k in range(2):
        assert 3.4 < widths[400][k] / widths[6400][k] < 4.6  # sqrt(16) = 4
    # and the loss interval is about 2 x 1.96 / sqrt(n) wide (unit variance)
    assert abs(widths[6400][0] - 2 * 1.96 / 80) < 0.1 * 2 * 1.96 / 80


def test_the_interval_covers_a_known_mean_at_its_nominal_rate():
    rng = np.random.default_rng(2)
    simulations, covered = 200, 0
    for s in range(simulations):
        loss, count = _synthetic(100, rng)
        result = path_intervals(loss, count, np.arange(100), WEIGHTS, [0, 2], seed=s)
        low, high = result["loss_interval"][1]
        covered += low <= MEANS[1] <= high
    tolerance = 3 * math.sqrt(simulations * 0.95 * 0.05)  # three binomial standard deviations
    assert abs(covered - 0.95 * simulations) <= tolerance, covered


def test_seeded_and_the_barrier_interval_holds_the_barrier():
    rng = np.random.default_rng(3)
    loss, count = _synthetic(200, rng)
    first = path_intervals(loss, count, np.arange(200), WEIGHTS, [0, 2], resamples=300, seed=7)
    assert first == path_intervals(loss, count, np.arange(200), WEIGHTS, [0, 2], resamples=300, seed=7)
    assert first != path_intervals(loss, count, np.arange(200), WEIGHTS, [0, 2], resamples=300, seed=8)
    assert first["bootstrap"] == {"resamples": 300, "seed": 7, "level": 0.95, "units": 200}
    point = loss.mean(axis=1)
    barrier = max(point[k] - (WEIGHTS[k][0] * point[0] + WEIGHTS[k][1] * point[2]) for k in range(3))
    assert first["barrier_interval"][0] < barrier < first["barrier_interval"][1]


def test_windows_of_one_document_are_resampled_together():
    eos = 0
    windows = np.array([[5, 5, 5], [5, 0, 6], [6, 6, 6], [6, 6, 0], [7, 7, 7]])
    assert units_of(windows, eos).tolist() == [0, 0, 1, 1, 2]
    assert units_of(windows[[0, 2, 4]], eos).tolist() == [0, 1, 2]  # no boundary: each window its own unit
    # one document's windows always drawn together: a resample's loss is an average of whole documents
    loss = np.array([[1.0, 1.0, 3.0, 3.0, 8.0]] * 3)
    result = path_intervals(loss, np.ones(5), units_of(windows, eos), WEIGHTS, [0, 2], resamples=200)
    assert result["bootstrap"]["units"] == 3
    assert result["loss_interval"][0][0] >= 1.0 and result["loss_interval"][0][1] <= 8.0


def test_report_card_and_plot_carry_the_intervals(tmp_path, text_file):
    from hf_rebasin import tiny
    from hf_rebasin.cli import main
    a, b = (tiny.make_tiny("gpt_neox", tmp_path / name, seed=seed) for name, seed in (("a", 1), ("b", 2)))
    out = tmp_path / "merged"
    assert main(["merge", str(a), str(b), "--method", "raw", "--out", str(out), "--lambdas", "3",
                 "--data", str(text_file), "--seq-len", "32", "--max-eval-tokens", "2048"]) == 0
    report = json.loads((out / "barrier.json").read_text())
    assert report["schema_version"] == 3 and len(report["loss_interval"]) == 3
    for loss, (low, high) in zip(report["loss"], report["loss_interval"]):
        assert low < loss < high
    low, high = report["barrier_interval"]
    assert low <= report["barrier"] <= high  # [0, 0] where every resample's path stays below the endpoint line
    assert report["bootstrap"]["resamples"] == 1000 and report["bootstrap"]["units"] > 1
    card = (out / "README.md").read_text()
    assert f"95 % interval [{low:.4f}, {high:.4f}]" in card and "loss, 95 % interval" in card
    assert (out / "barrier.png").stat().st_size > 0


def _two_methods(rng, n_docs=300, windows_per_doc=3, gap=0.3):
    """Per-window losses of two methods on the same documents: a document's difficulty (large, shared by both
    methods and by every point) plus small noise; the second method is `gap` nats worse at the midpoint only."""
    units = np.repeat(np.arange(n_docs), windows_per_doc)
    hard = 2.0 * rng.standard_normal(n_docs)[units]
    noise = lambda: 0.05 * rng.standard_normal((3, len(units)))
    first = MEANS[:, None] + hard + noise()
    second = first + np.array([0.0, gap, 0.0])[:, None] + noise()
    evaluation = {"window_count": np.ones(len(units)), "units": units, "weights": WEIGHTS, "vertices": [0, 2]}
    return {**evaluation, "window_loss": first}, {**evaluation, "window_loss": second}


def test_a_paired_difference_resamples_the_same_documents_for_both_methods():
    from hf_rebasin.evaluation.intervals import paired_difference
    first, second = _two_methods(np.random.default_rng(4))
    diff = paired_difference(second, first, point=1, resamples=500)
    barrier = lambda e: max(
        e["window_loss"][k].mean() - (WEIGHTS[k][0] * e["window_loss"][0].mean()
                                      + WEIGHTS[k][1] * e["window_loss"][2].mean()) for k in range(3))
    assert math.isclose(diff["barrier"], barrier(second) - barrier(first), abs_tol=1e-12)
    low, high = diff["barrier_interval"]
    assert low < diff["barrier"] < high and high - low < 0.02  # the shared difficulty cancels: a narrow interval
    assert abs(diff["barrier"] - 0.3) < high - low  # around the true gap
    assert diff["loss_interval"][0] < diff["loss"] < diff["loss_interval"][1]
    assert diff["bootstrap"]["paired"] and diff["bootstrap"]["units"] == 300
    # each method's own interval is wide (document difficulty): the unpaired intervals could not separate them
    single = path_intervals(first["window_loss"], first["window_count"], first["units"], WEIGHTS, [0, 2],
                            resamples=500)
    assert single["loss_interval"][1][1] - single["loss_interval"][1][0] > 10 * (high - low)
    # the same evaluation against itself: every resample gives exactly 0 (the same draws for both)
    assert paired_difference(first, first, point=1, resamples=200)["barrier_interval"] == [0.0, 0.0]


def test_a_paired_difference_refuses_different_windows():
    import pytest

    from hf_rebasin.evaluation.intervals import paired_difference
    first, second = _two_methods(np.random.default_rng(5))
    with pytest.raises(ValueError, match="same windows"):
        paired_difference(first, {**second, "units": np.arange(len(second["units"]))})


def test_the_barrier_table_prints_paired_differences():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import barrier_table
    first, second = _two_methods(np.random.default_rng(6))
    evaluations = {"wm": {**first, "digest": "x"}, "dual": {**second, "digest": "x"},
                   "am": {**second, "digest": "other windows"}}
    rows = barrier_table.paired_rows("pair", {k: {**v, "units": list(v["units"]), "weights": [list(w) for w in WEIGHTS]}
                                              for k, v in evaluations.items()})
    assert [r["difference"] for r in rows] == ["dual − wm"]  # am was evaluated on other windows: not paired
    table = barrier_table.paired_markdown(rows)
    low, high = rows[0]["barrier_interval"]
    assert f"| pair | dual − wm | {rows[0]['barrier']:+.3f} [{low:+.3f}, {high:+.3f}] |" in table
    assert 0.28 < low < high < 0.32
