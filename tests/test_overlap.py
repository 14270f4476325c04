"""What a method fits on never includes what it is evaluated on: activation matching given --data alone splits it
by document (as lm and dual do), and overlap is found by shared n-grams of token ids (a shifted copy too), refused
above 1 % unless --allow-overlap, and recorded in barrier.json."""
from __future__ import annotations

import json

import numpy as np
import pytest

from hf_rebasin.sources.overlap import token_overlap


def _stream(n, seed):
    return np.random.default_rng(seed).integers(0, 50_000, n)


def test_a_shifted_copy_is_found_whole():
    evaluated = _stream(4096, 0)
    shifted = np.concatenate([_stream(3, 1), evaluated, _stream(5, 2)])
    assert token_overlap([shifted], evaluated) == (4096, 4096)
    # read in chunks that cut n-grams apart: the same
    assert token_overlap(np.array_split(shifted, 7), evaluated) == (4096, 4096)


def test_a_partial_copy_covers_its_share():
    evaluated = _stream(4000, 0)
    fit = np.concatenate([_stream(777, 3), evaluated[1000:2000], _stream(500, 4)])
    assert token_overlap([fit], evaluated) == (1000, 4000)
    # one shared 13-gram covers its 13 tokens
    assert token_overlap([evaluated[100:113]], evaluated) == (13, 4000)
    assert token_overlap([evaluated[100:112]], evaluated) == (0, 4000)


def test_disjoint_text_shares_nothing():
    assert token_overlap([_stream(100_000, 5)], _stream(4096, 6)) == (0, 4096)


@pytest.fixture(scope="module")
def pair(learned_pair):
    return learned_pair


def _am(pair, out, *extra, data=None) -> int:
    from hf_rebasin.cli import main
    a, b, root = pair
    return main(["merge", str(a), str(b), "--method", "am", "--data", str(data or root / "heldout.txt"),
                 "--seq-len", "32", "--max-eval-tokens", "2048", "--lambdas", "3", "--am-batches", "2",
                 "--out", str(out), *extra])


def test_am_with_data_alone_never_matches_on_an_evaluated_window(pair, tmp_path, monkeypatch):
    from hf_rebasin import pipeline
    from hf_rebasin.match import activation
    seen = {}
    match, evaluate = activation.activation_matching, pipeline.evaluate_points

    def matching(*args, data, **kwargs):
        seen["matched"] = data.inputs.clone()
        return match(*args, data=data, **kwargs)

    def evaluating(graphs, weights, template, data, *args, **kwargs):
        seen["evaluated"] = data.inputs.clone()
        return evaluate(graphs, weights, template, data, *args, **kwargs)

    monkeypatch.setattr(activation, "activation_matching", matching)
    monkeypatch.setattr(pipeline, "evaluate_points", evaluating)
    assert _am(pair, tmp_path / "out") == 0
    matched, evaluated = ({tuple(row.tolist()) for row in seen[k]} for k in ("matched", "evaluated"))
    assert matched and evaluated and not matched & evaluated
    report = json.loads((tmp_path / "out" / "barrier.json").read_text())
    assert report["data"]["part"] == "eval half" and report["data"]["windows"] == len(seen["evaluated"])
    assert report["settings"]["match_data"]["windows"] == len(seen["matched"])
    assert report["settings"]["match_data"]["digest"] != report["data"]["digest"]
    assert report["settings"]["overlap"]["share"] == 0.0
    assert any("--data was split into disjoint halves" in note for note in report["notes"])
    card = (tmp_path / "out" / "README.md").read_text()
    assert "disjoint halves" in card and "`overlap.share`" in card


def test_a_shifted_copy_of_the_evaluation_text_is_refused(pair, tmp_path, capsys):
    _, _, root = pair
    shifted = tmp_path / "shifted.txt"  # the same text two characters later: no window is identical
    shifted.write_text("# " + (root / "heldout.txt").read_text())
    assert _am(pair, tmp_path / "out", "--match-data", str(shifted)) == 2
    err = capsys.readouterr().err
    assert "--method am would fit on its own evaluation data" in err and "--allow-overlap" in err
    assert not (tmp_path / "out").exists()
    assert _am(pair, tmp_path / "out", "--match-data", str(shifted), "--allow-overlap") == 0
    report = json.loads((tmp_path / "out" / "barrier.json").read_text())
    overlap = report["settings"]["overlap"]
    assert overlap["allowed"] is True and overlap["share"] > 0.9
    assert any(note.startswith("--allow-overlap:") for note in report["notes"])
