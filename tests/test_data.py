"""The --data layer: text specs, the token-window protocol, image specs (all on local files, offline)."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import corpus
import numpy as np
import pytest
import torch
from PIL import Image

from hf_rebasin.sources import data
from hf_rebasin.sources.data import DataError, load_token_windows, read_images, read_texts, split_text, token_windows


@pytest.fixture(scope="module")
def bpe_tokenizer():
    """A real byte-level BPE (GPT-2 style pre-tokenisation, EOS), trained at test time on stdlib sources."""
    return corpus.bpe_tokenizer()


@pytest.fixture(scope="module")
def stdlib_text() -> str:
    return corpus.train_text(1_000_000)


@pytest.fixture
def offline(monkeypatch):
    """Offline mode as a user would set it; datasets/huggingface_hub read these at import, so patch them too."""
    import datasets
    import huggingface_hub.constants

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def write_jsonl(path: Path, records: list, blank_lines: bool = False) -> Path:
    lines = [json.dumps(r) for r in records]
    if blank_lines:
        lines.insert(1, "")
        lines.append("   ")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------------------ text


def test_txt_file_is_one_document(tmp_path):
    content = "First Citizen:\nBefore we proceed any further, hear me speak.\n"
    (tmp_path / "play.txt").write_text(content, encoding="utf-8")
    assert read_texts(str(tmp_path / "play.txt")) == [content]
    (tmp_path / "notes").write_text("no suffix is fine", encoding="utf-8")
    assert read_texts(str(tmp_path / "notes")) == ["no suffix is fine"]


def test_blank_or_binary_file_is_an_error(tmp_path):
    (tmp_path / "blank.txt").write_text("  \n\t\n", encoding="utf-8")
    with pytest.raises(DataError, match="contains no text"):
        read_texts(str(tmp_path / "blank.txt"))
    (tmp_path / "weights.bin").write_bytes(b"\x00\x01\x02binary")
    with pytest.raises(DataError, match="not a UTF-8 text file"):
        read_texts(str(tmp_path / "weights.bin"))


def test_folder_is_read_recursively_sorted_skipping_binary_and_hidden(tmp_path):
    root = tmp_path / "corpus"
    (root / "a" / "b").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "b.txt").write_text("bee", encoding="utf-8")
    (root / "a" / "z.md").write_text("# zed", encoding="utf-8")
    (root / "a" / "b" / "c.py").write_text("print('c')\n", encoding="utf-8")
    (root / "a" / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8
    (root / "empty.txt").write_text("", encoding="utf-8")
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main", encoding="utf-8")
    (root / ".hidden.txt").write_text("hidden", encoding="utf-8")
    assert read_texts(str(root)) == ["print('c')\n", "# zed", "bee"]


def test_folder_without_text_is_an_error(tmp_path):
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)))
    with pytest.raises(DataError, match="contains no text"):
        read_texts(str(tmp_path))


def test_jsonl_text_field(tmp_path):
    records = [{"text": "one", "id": 1}, {"text": "two", "id": 2}, {"text": "", "id": 3}]
    path = write_jsonl(tmp_path / "docs.jsonl", records, blank_lines=True)
    assert read_texts(str(path)) == ["one", "two"]  # blank lines and empty documents dropped
    other = write_jsonl(tmp_path / "other.jsonl", [{"body": "alpha"}, {"body": "beta"}])
    assert read_texts(str(other), text_field="body") == ["alpha", "beta"]
    array = tmp_path / "array.json"
    array.write_text(json.dumps([{"text": "x"}, {"text": "y"}]), encoding="utf-8")
    assert read_texts(str(array)) == ["x", "y"]


def test_jsonl_missing_field_names_the_fields_that_exist(tmp_path):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"content": "a", "meta": {}}])
    with pytest.raises(DataError) as error:
        read_texts(str(path))
    message = str(error.value)
    assert "'text'" in message and "['content', 'meta']" in message and "--text-field" in message
    with pytest.raises(DataError, match="not text"):
        read_texts(str(path), text_field="meta")


def test_jsonl_bad_line_names_the_line(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "ok"}\n{"text": broken}\n', encoding="utf-8")
    with pytest.raises(DataError, match="line 2"):
        read_texts(str(path))


@pytest.mark.parametrize("spec", ["./missing.txt", "missing.jsonl", "/no/such/folder", "data/train/part",
                                  "~/surely-missing-corpus.txt"])
def test_missing_local_path_is_no_such_file_not_a_hub_lookup(spec, monkeypatch, tmp_path):
    import datasets

    def no_hub(*args, **kwargs):
        raise AssertionError(f"load_dataset called for a local-looking spec {spec!r}")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    with pytest.raises(DataError, match="no such file"):
        read_texts(spec)
    with pytest.raises(DataError, match="no such file"):
        read_images(spec, input_size=(3, 4, 4), mean=(0, 0, 0), std=(1, 1, 1))


def test_local_datasets_loader_specs(tmp_path):
    """json:/text:/csv: specs run the real datasets.load_dataset code path on local files."""
    jsonl = write_jsonl(tmp_path / "docs.jsonl", [{"text": "alpha"}, {"text": "beta"}, {"text": "gamma"}])
    assert read_texts(f"json:{jsonl}") == ["alpha", "beta", "gamma"]
    assert read_texts(f"json:{jsonl}:train") == ["alpha", "beta", "gamma"]
    write_jsonl(tmp_path / "more.jsonl", [{"text": "delta"}])
    assert sorted(read_texts(f"json:{tmp_path}/*.jsonl")) == ["alpha", "beta", "delta", "gamma"]

    lines = tmp_path / "lines.txt"
    lines.write_text("line one\nline two\n", encoding="utf-8")
    assert read_texts(f"text:{lines}") == ["line one", "line two"]  # the text loader yields one row per line

    table = tmp_path / "table.csv"
    table.write_text("title,body\nA,first body\nB,second body\n", encoding="utf-8")
    assert read_texts(f"csv:{table}", text_field="body") == ["first body", "second body"]
    with pytest.raises(DataError) as error:
        read_texts(f"csv:{table}")
    assert "['title', 'body']" in str(error.value)
    with pytest.raises(DataError, match="neither an existing local path"):
        read_texts(f"json:{jsonl}:validation")  # that loader only makes a train split


def test_hub_spec_maps_to_load_dataset_arguments(monkeypatch):
    import datasets

    calls = []

    def recording_load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return datasets.Dataset.from_dict({"text": ["a", "", "b"], "other": [1, 2, 3]})

    monkeypatch.setattr(datasets, "load_dataset", recording_load_dataset)
    assert read_texts("wikitext:wikitext-103-raw-v1:test") == ["a", "b"]
    read_texts("wikitext:wikitext-2-raw-v1", split="validation")
    read_texts("Salesforce/wikitext:wikitext-2-raw-v1:train", split="validation")  # the spec's split wins
    read_texts("roneneldan/TinyStories")
    assert calls == [
        (("wikitext", "wikitext-103-raw-v1"), {"split": "test"}),
        (("wikitext", "wikitext-2-raw-v1"), {"split": "validation"}),
        (("Salesforce/wikitext", "wikitext-2-raw-v1"), {"split": "train"}),
        (("roneneldan/TinyStories",), {"split": "test"}),
    ]
    with pytest.raises(DataError, match=r"no column 'body'.*\['text', 'other'\]"):
        read_texts("wikitext:wikitext-103-raw-v1", text_field="body")


def test_bad_hub_id_offline_is_a_quick_data_error(offline):
    start = time.perf_counter()
    with pytest.raises(DataError) as error:
        read_texts("no-such-org/no-such-dataset-hf-rebasin:default:test")
    assert time.perf_counter() - start < 10
    message = str(error.value)
    assert "neither an existing local path nor a loadable datasets spec" in message
    assert "no-such-org/no-such-dataset-hf-rebasin" in message and "offline" in message
    with pytest.raises(DataError, match="NAME\\[:CONFIG\\[:SPLIT\\]\\]"):
        read_texts("a:b:c:d")


def test_saved_dataset_folder(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": ["one", "two"]}).save_to_disk(str(tmp_path / "single"))
    assert read_texts(str(tmp_path / "single")) == ["one", "two"]
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["t"]}),
                                   "test": datasets.Dataset.from_dict({"text": ["held out"]})})
    splits.save_to_disk(str(tmp_path / "splits"))
    assert read_texts(str(tmp_path / "splits")) == ["held out"]
    assert read_texts(str(tmp_path / "splits"), split="train") == ["t"]
    with pytest.raises(DataError, match="has splits"):
        read_texts(str(tmp_path / "splits"), split="validation")


# ---------------------------------------------------------------------------------------------------- tokens


def test_token_windows_on_real_text(bpe_tokenizer, stdlib_text):
    documents = list(split_text(stdlib_text))
    # the protocol written out plainly: whole-document tokenisation, EOS between documents
    per_document = [bpe_tokenizer(d, add_special_tokens=False, verbose=False)["input_ids"] for d in documents]
    eos = bpe_tokenizer.eos_token_id
    stream = per_document[0] + [eos] + per_document[1] + [eos] + per_document[2]
    seq_len = 256
    windows = token_windows(documents, bpe_tokenizer, seq_len)
    assert windows.dtype == torch.long
    assert windows.shape == (len(stream) // seq_len, seq_len)
    assert windows.flatten().tolist() == stream[: windows.numel()]  # consecutive, non-overlapping slices

    assert all(eos not in ids for ids in per_document)
    eos_positions = (windows.flatten() == eos).nonzero().flatten().tolist()
    first, second = len(per_document[0]), len(per_document[1])
    assert eos_positions == [first, first + 1 + second]

    for max_tokens in (seq_len, 1000, 10 * seq_len + 7, len(stream) + 5):
        capped = token_windows(documents, bpe_tokenizer, seq_len, max_tokens=max_tokens)
        assert capped.shape[0] == math.floor(min(len(stream), max_tokens) / seq_len)
        assert torch.equal(capped, windows[: capped.shape[0]])


def test_chunked_tokenisation_matches_whole_document(bpe_tokenizer, stdlib_text, monkeypatch):
    text = stdlib_text[:60_000] + "\n\n  indented  \n\ntrailing spaces   \nlast"
    whole = bpe_tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    monkeypatch.setattr(data, "_CHUNK_CHARS", 150)  # hundreds of pieces (several batches of them)
    monkeypatch.setattr(data, "_PROGRESS_MIN_CHARS", 1000)  # the progress-bar path too
    assert len(data._chunks(text, 150)) > 4 * data._BATCH_PIECES
    assert "".join(data._chunks(text, 150)) == text
    assert token_windows([text], bpe_tokenizer, 1).flatten().tolist() == whole


def test_too_little_text_says_how_many_tokens(bpe_tokenizer):
    n = len(bpe_tokenizer("To be, or not to be", add_special_tokens=False)["input_ids"])
    with pytest.raises(DataError) as error:
        token_windows(["To be, or not to be"], bpe_tokenizer, 64)
    message = str(error.value)
    assert f"only {n} tokens" in message and "64" in message and "--seq-len" in message
    assert token_windows(["To be, or not to be"], bpe_tokenizer, n).shape == (1, n)
    with pytest.raises(DataError, match="smaller than --seq-len"):
        token_windows(["To be, or not to be"], bpe_tokenizer, 4, max_tokens=3)


class CharTokenizer:
    """A tokenizer without an EOS token: one id per character."""

    eos_token_id = None

    def __call__(self, texts, add_special_tokens=True, verbose=True):
        assert add_special_tokens is False
        return {"input_ids": [[ord(c) for c in text] for text in texts]}


def test_no_eos_when_tokenizer_has_none():
    windows = token_windows(["abc", "defg"], CharTokenizer(), 3)
    assert windows.tolist() == [[97, 98, 99], [100, 101, 102]]


def test_load_token_windows_record(tmp_path, bpe_tokenizer, stdlib_text):
    path = tmp_path / "sample.txt"
    path.write_text(stdlib_text[:20_000], encoding="utf-8")
    windows, record = load_token_windows(str(path), bpe_tokenizer, seq_len=128, max_tokens=2000)
    assert windows.shape == (15, 128)
    assert record == {"spec": str(path), "tokens": 15 * 127, "input_tokens": 15 * 128, "seq_len": 128, "windows": 15}
    stream = bpe_tokenizer(stdlib_text[:20_000], add_special_tokens=False, verbose=False)["input_ids"]
    assert windows.flatten().tolist() == stream[: 15 * 128]


def test_split_text_is_contiguous(stdlib_text):
    train, val, test = split_text(stdlib_text)
    assert train + val + test == stdlib_text
    assert len(train) == math.floor(len(stdlib_text) * 0.9)
    assert len(train) + len(val) == math.floor(len(stdlib_text) * 0.95)
    assert split_text("abcdefghij", (0.5, 0.3, 0.2)) == ("abcde", "fgh", "ij")
    with pytest.raises(ValueError, match="summing to 1"):
        split_text("abc", (0.5, 0.5, 0.5))


# ---------------------------------------------------------------------------------------------------- images

MEAN = (0.5, 0.4, 0.3)
STD = (0.25, 0.2, 0.1)


def make_image_folder(root: Path) -> dict:
    """Two classes of solid-colour PNGs (sizes differ from the model's); returns the colours by file."""
    colours = {"cat/0.png": (255, 0, 0), "cat/1.png": (10, 200, 30), "cat/2.png": (0, 0, 255),
               "dog/0.png": (128, 128, 128), "dog/1.png": (40, 80, 120), "dog/2.png": (250, 250, 5)}
    for name, colour in colours.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (12, 10), colour).save(root / name)
    (root / ".thumbnails").mkdir()
    Image.new("RGB", (4, 4)).save(root / ".thumbnails" / "x.png")
    return colours


def test_image_folder_shapes_labels_and_normalisation(tmp_path):
    colours = make_image_folder(tmp_path)
    images, labels, record = read_images(str(tmp_path), input_size=(3, 8, 6), mean=MEAN, std=STD)
    assert images.dtype == torch.float32 and images.shape == (6, 3, 8, 6)
    assert labels.dtype == torch.long and labels.tolist() == [0, 0, 0, 1, 1, 1]
    assert record == {"spec": str(tmp_path), "examples": 6}
    for i, colour in enumerate(colours.values()):
        expected = (torch.tensor(colour, dtype=torch.float32) / 255 - torch.tensor(MEAN)) / torch.tensor(STD)
        assert torch.allclose(images[i], expected.view(3, 1, 1).expand(3, 8, 6), atol=1e-5)

    few, few_labels, few_record = read_images(str(tmp_path), input_size=(3, 8, 6), mean=MEAN, std=STD,
                                              max_examples=2)
    assert few_labels.tolist() == [0, 1] and few_record["examples"] == 2  # evenly spaced: both classes
    assert torch.equal(few, images[[0, 3]])


def test_image_folder_resizes_and_converts_channels(tmp_path):
    gradient = np.tile(np.arange(0, 240, 15, dtype=np.uint8), (16, 1))  # 16x16, values vary along x
    (tmp_path / "only").mkdir()
    Image.fromarray(np.stack([gradient] * 3, axis=-1)).save(tmp_path / "only" / "g.png")
    images, labels, _ = read_images(str(tmp_path), input_size=(1, 4, 8), mean=(0.0,), std=(1.0,))
    assert images.shape == (1, 1, 4, 8) and labels.tolist() == [0]
    expected = np.asarray(Image.fromarray(gradient).resize((8, 4), Image.BICUBIC), dtype=np.float32) / 255
    assert np.allclose(images[0, 0].numpy(), expected, atol=1e-6)
    assert torch.all(images[0, 0, :, 1:] > images[0, 0, :, :-1])  # still increasing along the width


def test_image_folder_errors(tmp_path):
    flat = tmp_path / "flat"
    flat.mkdir()
    Image.new("RGB", (4, 4)).save(flat / "a.png")
    with pytest.raises(DataError, match="one sub-folder per class"):
        read_images(str(flat), input_size=(3, 4, 4), mean=MEAN, std=STD)

    empty = tmp_path / "empty"
    (empty / "cls").mkdir(parents=True)
    (empty / "cls" / "readme.txt").write_text("no images", encoding="utf-8")
    with pytest.raises(DataError, match="contains no images"):
        read_images(str(empty), input_size=(3, 4, 4), mean=MEAN, std=STD)

    broken = tmp_path / "broken"
    (broken / "cls").mkdir(parents=True)
    (broken / "cls" / "bad.png").write_bytes(b"not a png at all")
    with pytest.raises(DataError, match="bad.png.*not a readable image"):
        read_images(str(broken), input_size=(3, 4, 4), mean=MEAN, std=STD)

    make_image_folder(tmp_path / "ok")
    with pytest.raises(DataError, match="one value per channel"):
        read_images(str(tmp_path / "ok"), input_size=(3, 4, 4), mean=(0.5,), std=(0.5,))


def test_npz_float_images_are_used_as_given(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.normal(size=(5, 3, 4, 4)).astype(np.float32)
    labels = np.array([0, 2, 1, 1, 0])
    np.savez(tmp_path / "pre.npz", images=images, labels=labels)
    got, got_labels, record = read_images(str(tmp_path / "pre.npz"), input_size=(3, 4, 4), mean=MEAN, std=STD)
    assert got.dtype == torch.float32 and torch.equal(got, torch.from_numpy(images))
    assert got_labels.dtype == torch.long and got_labels.tolist() == labels.tolist()
    assert record == {"spec": str(tmp_path / "pre.npz"), "examples": 5}


def test_npz_uint8_images_are_scaled_and_normalised(tmp_path):
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, size=(4, 3, 5, 5), dtype=np.uint8)
    np.savez(tmp_path / "raw.npz", images=images, labels=np.arange(4))
    got, _, _ = read_images(str(tmp_path / "raw.npz"), input_size=(3, 5, 5), mean=MEAN, std=STD)
    expected = (images.astype(np.float64) / 255 - np.array(MEAN)[:, None, None]) / np.array(STD)[:, None, None]
    assert np.allclose(got.numpy(), expected, atol=1e-5)

    np.savez(tmp_path / "last.npz", images=images.transpose(0, 2, 3, 1), labels=np.arange(4))  # (N, H, W, C)
    channel_last, _, _ = read_images(str(tmp_path / "last.npz"), input_size=(3, 5, 5), mean=MEAN, std=STD)
    assert torch.equal(channel_last, got)

    gray = images[:, 0]
    np.savez(tmp_path / "gray.npz", images=gray, labels=np.arange(4))  # (N, H, W)
    got_gray, _, _ = read_images(str(tmp_path / "gray.npz"), input_size=(1, 5, 5), mean=(0.5,), std=(0.5,))
    assert got_gray.shape == (4, 1, 5, 5)
    assert np.allclose(got_gray[:, 0].numpy(), (gray / 255 - 0.5) / 0.5, atol=1e-5)


def test_sklearn_digits_npz_round_trip(tmp_path):
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = digits.images.astype(np.float32)  # (1797, 8, 8), values 0..16
    np.savez(tmp_path / "digits.npz", images=images, labels=digits.target)
    got, labels, record = read_images(str(tmp_path / "digits.npz"), input_size=(1, 8, 8), mean=(0.0,), std=(1.0,))
    assert got.shape == (1797, 1, 8, 8) and record["examples"] == 1797
    assert torch.equal(got[:, 0], torch.from_numpy(images))
    assert labels.tolist() == digits.target.tolist()
    few, few_labels, _ = read_images(str(tmp_path / "digits.npz"), input_size=(1, 8, 8), mean=(0.0,), std=(1.0,),
                                     max_examples=10)
    keep = [i * 1797 // 10 for i in range(10)]
    assert torch.equal(few, got[keep]) and few_labels.tolist() == digits.target[keep].tolist()


def test_npz_errors(tmp_path):
    np.savez(tmp_path / "keys.npz", x=np.zeros((2, 1, 4, 4)), y=np.zeros(2))
    with pytest.raises(DataError, match=r"'images' and 'labels'.*\['x', 'y'\]"):
        read_images(str(tmp_path / "keys.npz"), input_size=(1, 4, 4), mean=(0,), std=(1,))

    np.savez(tmp_path / "shape.npz", images=np.zeros((2, 3, 4, 4), np.float32), labels=np.zeros(2, int))
    with pytest.raises(DataError) as error:
        read_images(str(tmp_path / "shape.npz"), input_size=(3, 8, 8), mean=MEAN, std=STD)
    assert "(3, 4, 4)" in str(error.value) and "(3, 8, 8)" in str(error.value)

    np.savez(tmp_path / "labels.npz", images=np.zeros((3, 1, 4, 4), np.float32), labels=np.zeros(2, int))
    with pytest.raises(DataError, match="'labels' has shape"):
        read_images(str(tmp_path / "labels.npz"), input_size=(1, 4, 4), mean=(0,), std=(1,))

    np.savez(tmp_path / "none.npz", images=np.zeros((0, 1, 4, 4), np.float32), labels=np.zeros(0, int))
    with pytest.raises(DataError, match="contains no images"):
        read_images(str(tmp_path / "none.npz"), input_size=(1, 4, 4), mean=(0,), std=(1,))

    np.save(tmp_path / "single.npy", np.zeros(3))
    (tmp_path / "single.npy").rename(tmp_path / "single.npz")
    with pytest.raises(DataError, match="single array"):
        read_images(str(tmp_path / "single.npz"), input_size=(1, 4, 4), mean=(0,), std=(1,))

    (tmp_path / "text.npz").write_text("hello", encoding="utf-8")
    with pytest.raises(DataError, match="not a readable .npz"):
        read_images(str(tmp_path / "text.npz"), input_size=(1, 4, 4), mean=(0,), std=(1,))

    (tmp_path / "photo.jpg").write_bytes(b"\xff\xd8\xff")
    with pytest.raises(DataError, match="not an image data set"):
        read_images(str(tmp_path / "photo.jpg"), input_size=(1, 4, 4), mean=(0,), std=(1,))


def test_datasets_image_specs_match_the_image_folder(tmp_path):
    """imagefolder:DIR goes through datasets.load_dataset; a save_to_disk folder through load_from_disk."""
    import datasets

    make_image_folder(tmp_path / "pets")
    direct = read_images(str(tmp_path / "pets"), input_size=(3, 8, 8), mean=MEAN, std=STD)
    via_loader = read_images(f"imagefolder:{tmp_path / 'pets'}", input_size=(3, 8, 8), mean=MEAN, std=STD)
    assert torch.equal(via_loader[0], direct[0]) and torch.equal(via_loader[1], direct[1])
    assert via_loader[2] == {"spec": f"imagefolder:{tmp_path / 'pets'}", "examples": 6}

    rows = {"img": [Image.new("L", (3, 3), v) for v in (0, 51, 255)], "labels": [2, 0, 1]}
    datasets.Dataset.from_dict(rows, features=datasets.Features(
        {"img": datasets.Image(), "labels": datasets.Value("int64")})).save_to_disk(str(tmp_path / "saved"))
    images, labels, _ = read_images(str(tmp_path / "saved"), input_size=(1, 3, 3), mean=(0.2,), std=(0.5,))
    assert labels.tolist() == [2, 0, 1]
    assert torch.allclose(images[:, 0, 0, 0], (torch.tensor([0, 51, 255]) / 255 - 0.2) / 0.5, atol=1e-6)

    datasets.Dataset.from_dict({"pixels": [[0.0]], "y": [1]}).save_to_disk(str(tmp_path / "columns"))
    with pytest.raises(DataError, match=r"image column.*\['pixels', 'y'\]"):
        read_images(str(tmp_path / "columns"), input_size=(1, 3, 3), mean=(0,), std=(1,))


def test_bad_image_hub_id_offline(offline):
    with pytest.raises(DataError, match="neither an existing local path"):
        read_images("no-such-org/no-such-images-hf-rebasin", input_size=(3, 4, 4), mean=MEAN, std=STD)
