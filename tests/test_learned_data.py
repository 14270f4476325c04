"""What learned matching trains on, and what the report says about it: training data that overlaps the
evaluation data is found by content and refused, --data alone is split into disjoint halves, digests and the
number of learned parameters are recorded, and the signed excess is reported at every λ."""
from __future__ import annotations

import json

import pytest
from conftest import short_dual


@pytest.fixture(scope="module")
def pair(learned_pair):
    return learned_pair


dual = short_dual


def test_training_on_the_evaluation_data_is_refused_by_content(pair, tmp_path, capsys):
    _, _, root = pair
    copy = tmp_path / "same-text-other-name.txt"  # the same content under another name is still the same data
    copy.write_text((root / "heldout.txt").read_text())
    assert dual(pair, tmp_path / "out", "--train-data", str(copy)) == 2
    err = capsys.readouterr().err
    assert "are also in the evaluation data" in err and "--allow-train-on-eval" in err
    assert not (tmp_path / "out").exists()
    assert dual(pair, tmp_path / "out", "--train-data", str(copy), "--allow-train-on-eval") == 0
    report = json.loads((tmp_path / "out" / "barrier.json").read_text())
    assert any("partly in-sample" in note for note in report["notes"])


def test_data_alone_is_split_into_disjoint_halves(pair, tmp_path):
    assert dual(pair, tmp_path / "out") == 0
    report = json.loads((tmp_path / "out" / "barrier.json").read_text())
    assert any("split by example into disjoint halves" in note for note in report["notes"])
    train, held_out = report["settings"]["train_data"], report["data"]
    assert held_out["tokens"] == 1024 and train["tokens"] == 1024 and held_out["part"] == "eval half"
    assert train["digest"] != held_out["digest"]
    card = (tmp_path / "out" / "README.md").read_text()
    assert "disjoint halves" in card and "`learned_parameters`" in card


def test_report_counts_learned_parameters_and_keeps_the_signed_excess(pair, tmp_path):
    _, _, root = pair
    assert dual(pair, tmp_path / "out", "--train-data", str(root / "train.txt")) == 0
    report = json.loads((tmp_path / "out" / "barrier.json").read_text())
    settings = report["settings"]
    assert 0 < settings["learned_parameters"] < settings["model_parameters"]
    assert settings["model_parameters"] == sum(
        int(__import__("math").prod(shape)) for shape in _canonical_shapes(pair[0]).values())
    ends = report["endpoint_loss"]
    expected = [loss - ((1 - lam) * ends[0] + lam * ends[1]) for lam, loss in zip(report["lambdas"], report["loss"])]
    assert report["excess"] == pytest.approx(expected) and report["barrier"] == pytest.approx(max(expected))
    assert report["schema_version"] == 2


def _canonical_shapes(folder):
    from hf_rebasin.sources import models
    return models.canonicalise(models.load(folder)).shapes
