"""What learned matching trains on, and what the report says about it: training data that overlaps the
evaluation data is found by content and refused, image data given as --data alone is split into disjoint halves
(language models sample `self` instead: test_self_data.py), digests and the
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


def test_training_data_that_names_the_evaluation_set_is_split_into_disjoint_halves(pair, tmp_path):
    """A language model told to train on the --data set itself trains on the first half of its documents and is
    evaluated on the other half (without --train-data it would sample `self`: test_self_data.py)."""
    _, _, root = pair
    assert dual(pair, tmp_path / "out", "--train-data", str(root / "heldout.txt")) == 0
    report = json.loads((tmp_path / "out" / "barrier.json").read_text())
    assert any(note.startswith("--train-data is the --data set: --data was split into disjoint halves (")
               for note in report["notes"])
    assert "self_samples" not in report["settings"] and report["settings"]["learned"]["soft_targets"] == 0.0
    train, held_out = report["settings"]["train_data"], report["data"]
    assert held_out["part"] == "eval half" and train["digest"] != held_out["digest"]
    assert 0 < train["tokens"] and 0 < held_out["tokens"] and train["tokens"] + held_out["tokens"] <= 2048
    card = (tmp_path / "out" / "README.md").read_text()
    assert "disjoint halves" in card and "`learned_parameters`" in card
    # --allow-train-on-eval trains on all of it instead, and says the barrier is in-sample
    assert dual(pair, tmp_path / "in", "--train-data", str(root / "heldout.txt"), "--allow-train-on-eval") == 0
    report = json.loads((tmp_path / "in" / "barrier.json").read_text())
    assert "part" not in report["data"] and any("partly in-sample" in note for note in report["notes"])


def test_image_data_alone_is_split_into_disjoint_halves(tiny_dirs, image_file, tmp_path):
    """Image classifiers cannot sample their own data: with --data alone it is split, at random under --learn-seed,
    one half trains and the other is evaluated (language models sample `self` instead: test_self_data.py)."""
    from hf_rebasin import tiny
    from hf_rebasin.cli import main
    other = tiny.make_tiny("vit", tmp_path / "vit-2", seed=2)
    assert main(["merge", str(tiny_dirs["vit"]), str(other), "--method", "dual", "--data", str(image_file),
                 "--lambdas", "3", "--steps", "2", "--learn-batch-size", "8", "--eval-every", "0",
                 "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "barrier.json").read_text())
    assert any("split into disjoint halves (" in note for note in report["notes"])
    assert "self_samples" not in report["settings"] and report["settings"]["learned"]["soft_targets"] == 0.0
    train, held_out = report["settings"]["train_data"], report["data"]
    assert held_out["part"] == "eval half" and train["digest"] != held_out["digest"]
    assert train["examples"] + held_out["examples"] == 48 and min(train["examples"], held_out["examples"]) > 0
    card = (tmp_path / "out" / "README.md").read_text()
    assert "disjoint halves" in card and "`learned_parameters`" in card


def _windows_of_documents(lengths, seq_len=4, eos=0):
    """Windows of documents of the given token lengths joined by EOS; document k's tokens are all k + 1."""
    import torch
    ids = []
    for k, length in enumerate(lengths):
        ids += ([eos] if k else []) + [k + 1] * length
    n = len(ids) // seq_len
    return torch.tensor(ids[:n * seq_len]).view(n, seq_len)


class _Tokenizer:
    eos_token_id = 0


class _Template:
    folder = None

    class backend:
        @staticmethod
        def tokenizer(folder):
            return _Tokenizer()


def test_text_is_split_by_document_never_window_by_window():
    """The split the issue asked for: no document has text on both sides (neighbouring windows of one document
    are nearly the same text), the training half comes first, and one long document is cut in the middle."""
    from hf_rebasin.sources.eval_data import EvalData
    from hf_rebasin.sources.splits import split_in_halves
    windows = _windows_of_documents([10, 14, 9, 12, 11, 15])
    train, held_out, how = split_in_halves(EvalData("causal-lm", windows, None, {"tokens": windows.numel()}),
                                           _Template, seed=0)
    documents = lambda part: {int(t) for t in part.inputs.flatten()} - {0}
    assert documents(train) and documents(held_out) and not documents(train) & documents(held_out)
    assert max(documents(train)) < min(documents(held_out)) and "by document" in how
    assert abs(len(train.inputs) - len(held_out.inputs)) <= len(windows) // 2
    single = _windows_of_documents([40])
    train, held_out, how = split_in_halves(EvalData("causal-lm", single, None, {}), _Template, seed=0)
    assert train.inputs.tolist() == single[:5].tolist() and held_out.inputs.tolist() == single[5:].tolist()
    assert "one document" in how


def test_images_are_split_at_random_under_the_seed():
    import torch

    from hf_rebasin.sources.eval_data import EvalData
    from hf_rebasin.sources.splits import split_in_halves
    images, labels = torch.arange(20.0).view(20, 1, 1, 1), torch.arange(20) // 10  # sorted by class, as a folder is
    data = EvalData("image-classification", images, labels, {"examples": 20})
    train, held_out, _ = split_in_halves(data, _Template, seed=0)
    seen = {int(x) for x in train.inputs.flatten()}
    assert len(train.inputs) == len(held_out.inputs) == 10 and not seen & {int(x) for x in held_out.inputs.flatten()}
    assert set(train.labels.tolist()) == {0, 1}  # both classes on both sides, unlike contiguous halves
    again, _, _ = split_in_halves(data, _Template, seed=0)
    other, _, _ = split_in_halves(data, _Template, seed=1)
    assert again.inputs.tolist() == train.inputs.tolist() and other.inputs.tolist() != train.inputs.tolist()


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
    assert report["schema_version"] == 3


def _canonical_shapes(folder):
    from hf_rebasin.sources import models
    return models.canonicalise(models.load(folder)).shapes
