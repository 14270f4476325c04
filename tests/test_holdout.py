"""Learned matching's held-out selection (the windows that choose the returned parameters) is made of whole
documents kept out of training: no held-out window shares a document with a window trained on, for windows in
memory and memory-mapped alike, and barrier.json records how the selection was made."""
from __future__ import annotations

import json

import numpy as np
import torch

from hf_rebasin.match.learned import split_holdout
from hf_rebasin.sources.eval_data import EvalData
from hf_rebasin.sources.splits import held_out_documents

EOS, SEQ = 0, 16


def _documents(seed: int, n_docs: int = 120) -> np.ndarray:
    """A token stream of documents of 3 to 80 tokens (shorter and longer than a window), each ended by EOS."""
    rng = np.random.default_rng(seed)
    return np.concatenate([np.append(rng.integers(1, 99, rng.integers(3, 80)), EOS) for _ in range(n_docs)])


def _windows(stream: np.ndarray) -> torch.Tensor:
    n = len(stream) // SEQ
    return torch.from_numpy(stream[:n * SEQ].astype(np.int64)).view(n, SEQ)


def _document_of_each_token(windows: torch.Tensor, eos: int = EOS) -> np.ndarray:
    """[windows, seq_len]: the document of every token (an EOS belongs to the document it ends)."""
    flat = windows.reshape(-1).numpy()
    return (np.cumsum(flat == eos) - (flat == eos)).reshape(windows.shape)


def _check_disjoint(windows, kept, held, eos: int = EOS):
    docs = _document_of_each_token(windows, eos)
    trained = set(docs[kept].reshape(-1).tolist())
    for window in held:
        assert not set(docs[window].tolist()) & trained, window
    assert not set(kept) & set(held)


def test_no_held_out_window_shares_a_document_with_a_training_window():
    for seed in range(5):
        windows = _windows(_documents(seed))
        for n in (1, 8, 32):
            kept, held, record = held_out_documents(EvalData("causal-lm", windows), n, EOS)
            assert len(held) == n and record["held_out"] == n and record["how"].startswith("whole documents")
            _check_disjoint(windows, kept, held)
            assert len(kept) + len(held) + record["dropped"] == len(windows)
        # spread over the data, not one block
        assert held[0] < len(windows) // 4 and held[-1] >= 3 * len(windows) // 4


def test_a_linspace_selection_would_have_shared_documents():
    """What the held-out selection used to be (every k-th window): documents longer than a window are trained on
    and held out at once."""
    windows = _windows(_documents(0))
    held = torch.linspace(0, len(windows) - 1, 32).round().long().tolist()
    docs = _document_of_each_token(windows)
    trained = set(docs[[w for w in range(len(windows)) if w not in held]].reshape(-1).tolist())
    assert any(set(docs[w].tolist()) & trained for w in held)


def test_memory_mapped_training_windows_split_the_same(tmp_path):
    from hf_rebasin.sources.token_files import TokenWindows
    stream = _documents(7)
    np.save(tmp_path / "train.npy", stream.astype(np.uint16))
    mapped = EvalData("causal-lm", TokenWindows(tmp_path / "train.npy", SEQ))
    in_memory = EvalData("causal-lm", _windows(stream))
    assert held_out_documents(mapped, 16, EOS) == held_out_documents(in_memory, 16, EOS)
    fit, held, record = split_holdout(mapped, 16, EOS)
    assert len(held.inputs) == 16 and len(fit.inputs) == len(in_memory.inputs) - 16 - record["dropped"]


def test_independent_examples_and_text_without_boundaries():
    windows = _windows(np.random.default_rng(1).integers(1, 99, 64 * SEQ))
    sampled = EvalData("causal-lm", windows, info={"spec": "self"})
    kept, held, record = held_out_documents(sampled, 8, EOS)  # `self` windows are sampled one by one
    assert held[0] == 0 and held[-1] == 63 and len(held) == 8 and record["dropped"] == 0
    kept, held, record = held_out_documents(EvalData("causal-lm", windows), 8, EOS)  # one document
    assert held == list(range(56, 64)) and kept == list(range(55)) and record["dropped"] == 1


def test_barrier_json_records_the_held_out_documents(learned_pair, tmp_path, monkeypatch):
    from conftest import short_dual

    from hf_rebasin.match import learned
    from hf_rebasin.sources.splits import eos_token_id
    _, _, root = learned_pair
    lines = root.joinpath("train.txt").read_text().splitlines()
    train = tmp_path / "train.jsonl"  # many short documents
    train.write_text("".join(json.dumps({"text": "\n".join(lines[k:k + 6])}) + "\n" for k in range(0, len(lines), 6)))
    seen = {}

    def splitting(data, n, eos):
        seen["data"], seen["eos"] = data, eos
        seen["split"] = held_out_documents(data, n, eos)
        return split_holdout(data, n, eos)

    monkeypatch.setattr(learned, "split_holdout", splitting)
    assert short_dual(learned_pair, tmp_path / "out", "--train-data", str(train), "--holdout", "16") == 0
    report = json.loads((tmp_path / "out" / "barrier.json").read_text())
    record = report["settings"]["holdout"]
    assert record["how"] == "whole documents kept out of training" and record["held_out"] == 16
    assert record["documents"] >= 1 and record == seen["split"][2]
    from hf_rebasin.sources import models
    assert seen["eos"] == eos_token_id(models.load(learned_pair[0])) is not None
    kept, held, _ = seen["split"]
    _check_disjoint(seen["data"].inputs, kept, held, seen["eos"])


def test_documents_recorded_by_the_data_are_held_out_whole():
    """Windows whose documents the data records (--protocol li-shen: articles joined without EOS)."""
    rng = np.random.default_rng(3)
    units = np.repeat(np.arange(40), rng.integers(1, 6, 40)).tolist()
    windows = torch.zeros(len(units), SEQ, dtype=torch.long)  # no EOS anywhere: only the record tells
    kept, held, record = held_out_documents(EvalData("causal-lm", windows, units=units), 8, EOS)
    assert len(held) == 8 and record["how"].startswith("whole documents")
    # window w holds text of documents units[w] .. units[w + 1] (the next one may start inside it)
    touches = [set(range(units[w], (units + units[-1:])[w + 1] + 1)) for w in range(len(units))]
    trained = set().union(*(touches[w] for w in kept))
    assert not any(touches[w] & trained for w in held)
    assert len(kept) + len(held) + record["dropped"] == len(units)


def test_documents_too_long_to_hold_out_whole():
    """Two documents: holding one out whole would take half the data or more: the last windows instead, recorded."""
    stream = np.concatenate([np.append(np.full(40 * SEQ, 5), EOS), np.full(20 * SEQ, 6)])
    windows = _windows(stream)
    kept, held, record = held_out_documents(EvalData("causal-lm", windows), 4, EOS)
    assert record["how"].startswith("documents too long to hold out whole")
    assert held == list(range(len(windows) - 4, len(windows))) and kept == list(range(len(windows) - 5))
