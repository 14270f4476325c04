"""Token files: `hf-rebasin tokenize` writes the windows --data would make of the same text, read back
memory-mapped; learned matching on a token file follows the same trajectory as on the text; overlap with the
evaluation data is still found by content; a failure leaves nothing; a file made for another vocabulary is
refused by name."""
from __future__ import annotations

import hashlib
import json

import corpus
import numpy as np
import pytest
import torch
from conftest import short_dual
from safetensors.torch import load_file

from hf_rebasin import tokenize
from hf_rebasin.cli import main
from hf_rebasin.errors import DataError, UserError
from hf_rebasin.sources import data
from hf_rebasin.sources.token_files import TokenWindows, metadata_path, open_token_windows, write_token_file


@pytest.fixture(scope="module")
def tokenizer():
    return corpus.bpe_tokenizer()


@pytest.fixture(scope="module")
def documents():
    text = corpus.train_text(30_000)
    return [text[:9_000], text[9_000:9_500], text[9_500:]]


@pytest.fixture(scope="module")
def jsonl(documents, tmp_path_factory):
    path = tmp_path_factory.mktemp("docs") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(documents)))
    return path


@pytest.mark.parametrize("form", ["jsonl", "json-array", "folder", "datasets-json"])
def test_a_token_file_holds_the_windows_of_the_text(form, tokenizer, documents, jsonl, tmp_path):
    if form == "json-array":
        spec = tmp_path / "docs.json"
        spec.write_text(json.dumps([{"text": d} for d in documents]))
    elif form == "folder":
        spec = tmp_path / "texts"
        spec.mkdir()
        for i, d in enumerate(documents):
            (spec / f"{i:02d}.txt").write_text(d)
    else:
        spec = f"json:{jsonl}" if form == "datasets-json" else jsonl
    record = write_token_file(str(spec), tokenizer, tmp_path / "tokens.npy", progress=False)
    expected = data.token_windows(data.read_texts(str(spec)), tokenizer, 1)
    assert record["tokens"] == expected.numel() and record["dtype"] == "uint16"
    assert json.loads(metadata_path(tmp_path / "tokens.npy").read_text())["vocab_size"] == len(tokenizer)
    for seq_len in (1, 16, 37):
        reference = data.token_windows(data.read_texts(str(spec)), tokenizer, seq_len)
        windows = TokenWindows(tmp_path / "tokens.npy", seq_len)
        assert len(windows) == len(reference) and windows.shape == tuple(reference.shape)
        assert torch.equal(windows[:], reference)
    reference = data.token_windows(data.read_texts(str(spec)), tokenizer, 16, max_tokens=16 * 20 + 5)
    assert torch.equal(TokenWindows(tmp_path / "tokens.npy", 16, max_windows=20)[:], reference)


def test_token_windows_index_like_the_tensor(tokenizer, jsonl, tmp_path):
    write_token_file(str(jsonl), tokenizer, tmp_path / "t.npy", progress=False)
    windows, tensor = TokenWindows(tmp_path / "t.npy", 8), data.token_windows(data.read_texts(str(jsonl)), tokenizer, 8)
    index = torch.tensor([5, 0, 5, len(tensor) - 1])
    assert torch.equal(windows[index], tensor[index]) and windows[index].dtype == torch.long
    assert torch.equal(windows[3], tensor[3]) and torch.equal(windows[-1], tensor[-1])
    assert torch.equal(windows[2:40:3], tensor[2:40:3]) and torch.equal(windows[10:4], tensor[10:4])
    assert torch.equal(torch.stack(list(windows)), tensor)
    assert windows.digest() == hashlib.sha256(tensor.numpy().tobytes()).hexdigest()[:16]
    chosen = windows.select(torch.tensor([7, 2, 9, 4]))  # a view, as the held-out split makes it
    assert len(chosen) == 4 and torch.equal(chosen[:], tensor[[7, 2, 9, 4]]) and torch.equal(chosen[-1], tensor[4])
    assert torch.equal(chosen[torch.tensor([3, 0])], tensor[[4, 7]]) and torch.equal(torch.stack(list(chosen)),
                                                                                     tensor[[7, 2, 9, 4]])
    with pytest.raises(IndexError):
        windows[len(tensor)]


def test_tokenize_caps_replaces_only_when_asked_and_leaves_nothing_on_failure(tokenizer, jsonl, tmp_path):
    write_token_file(str(jsonl), tokenizer, tmp_path / "capped.npy", max_tokens=1000, progress=False)
    assert len(np.load(tmp_path / "capped.npy")) == 1000
    bad = tmp_path / "bad.jsonl"
    bad.write_text(jsonl.read_text() + "{not json\n")
    with pytest.raises(DataError, match="line 4 is not valid JSON"):
        write_token_file(str(bad), tokenizer, tmp_path / "out" / "tokens.npy", progress=False)
    assert list((tmp_path / "out").iterdir()) == []  # no token file, no .json, no partial files
    with pytest.raises(DataError, match="written as .npy"):
        write_token_file(str(jsonl), tokenizer, tmp_path / "tokens.bin", progress=False)


def test_a_token_file_for_another_tokenizer_is_refused(tokenizer, jsonl, tmp_path):
    write_token_file(str(jsonl), tokenizer, tmp_path / "t.npy", tokenizer_name="bpe-512", progress=False)
    assert len(open_token_windows(str(tmp_path / "t.npy"), 16, len(tokenizer), tokenizer=tokenizer)[0]) > 0
    other = corpus.train_bpe_tokenizer([corpus.train_text(100_000)], 300, model_max_length=1 << 20)
    with pytest.raises(DataError, match="tokenizer of 'bpe-512'") as error:
        open_token_windows(str(tmp_path / "t.npy"), 16, len(tokenizer), tokenizer=other)
    assert "hf-rebasin tokenize" in str(error.value)
    np.save(tmp_path / "big.npy", np.array([1, 2, 5000, 3] * 8, dtype=np.int32))
    with pytest.raises(DataError, match="token id 5000"):
        open_token_windows(str(tmp_path / "big.npy"), 4, len(tokenizer))
    np.save(tmp_path / "floats.npy", np.zeros((4, 4), dtype=np.float32))
    with pytest.raises(DataError, match="one flat array of integer token ids"):
        open_token_windows(str(tmp_path / "floats.npy"), 4, len(tokenizer))


@pytest.fixture(scope="module")
def pair(learned_pair):
    return learned_pair


def dual(pair, out, train, *extra):
    return short_dual(pair, out, "--train-data", str(train), *extra)


def test_learning_on_a_token_file_follows_the_same_trajectory_as_on_the_text(pair, tmp_path, capsys):
    a, _, root = pair
    assert main(["tokenize", str(root / "train.txt"), "--model", str(a), "--out", str(tmp_path / "train.npy")]) == 0
    assert "--train-data" in capsys.readouterr().out
    assert dual(pair, tmp_path / "from-text", root / "train.txt") == 0
    assert dual(pair, tmp_path / "from-tokens", tmp_path / "train.npy") == 0
    text_run, token_run = (json.loads((tmp_path / name / "barrier.json").read_text())
                           for name in ("from-text", "from-tokens"))
    assert token_run["settings"]["train_data"]["memory_mapped"] is True
    assert token_run["settings"]["train_data"]["digest"] == text_run["settings"]["train_data"]["digest"]
    assert token_run["settings"]["train_data"]["tokens"] == text_run["settings"]["train_data"]["tokens"]
    learned = [load_file(tmp_path / name / "transforms.safetensors") for name in ("from-text", "from-tokens")]
    assert learned[0].keys() == learned[1].keys()
    assert all(torch.equal(learned[0][k], learned[1][k]) for k in learned[0])
    assert token_run["loss"] == text_run["loss"]


def test_a_token_file_of_the_evaluation_text_is_refused_as_overlap(pair, tmp_path, capsys):
    a, _, root = pair
    tokenize(root / "heldout.txt", a, tmp_path / "heldout.npy", progress=False)
    with pytest.raises(UserError, match="exists"):
        tokenize(root / "heldout.txt", a, tmp_path / "heldout.npy", progress=False)
    assert dual(pair, tmp_path / "out", tmp_path / "heldout.npy") == 2
    assert "are also in the evaluation data" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
