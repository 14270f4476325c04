"""`--train-data self` / `--match-data self`: sequences sampled from the endpoint models, cached as a token file.
Determinism under a seed, the cache reused and sampled again when its record does not match, every model's
share present (each share re-sampled alone), activation matching and learned matching end to end, the content
check against the evaluation data, image models refused by name, and the options a run would ignore refused."""
from __future__ import annotations

import gc
import json
import re
import subprocess
import weakref
from types import SimpleNamespace

import pytest
import torch
from conftest import HF_REBASIN, short_dual

from hf_rebasin.errors import OptionError
from hf_rebasin.options import MergeOptions
from hf_rebasin.run_data import endpoint_loader, sampling_dtype
from hf_rebasin.sources import models as sources
from hf_rebasin.sources.self_samples import (
    CARRIED,
    CHAIN,
    Sampling,
    draw,
    drawn_tokens,
    sample_sequences,
    sampled_data,
    start_token,
    weights_digest,
)
from hf_rebasin.sources.token_files import metadata_path, vocabulary_digest

SEQ_LEN = 16


@pytest.fixture(scope="module")
def pair(learned_pair):
    return learned_pair


@pytest.fixture(scope="module")
def loaded(pair):
    return [sources.load(pair[0]), sources.load(pair[1])]


@pytest.fixture(scope="module")
def tokenizer(loaded):
    return loaded[0].backend.tokenizer(loaded[0].folder)


def sampling(loaded, tokenizer, **changes) -> Sampling:
    settings = dict(models=tuple(weights_digest(m.files.files) for m in loaded),
                    vocabulary_digest=vocabulary_digest(tokenizer), windows=11, seq_len=SEQ_LEN, temperature=1.0,
                    top_p=1.0, seed=0, start_token=start_token(tokenizer),
                    vocab_size=len(tokenizer), batch=4)
    return Sampling(**{**settings, **changes})


class Loader:
    """The models to sample from, one at a time as the pipeline loads them (endpoint_loader): counts the sampling runs
    that asked for them (a reused file asks for none), and records the dtype of each model and how many models
    loaded before it were still alive when it was loaded (the device holds one at a time: 0 every time)."""

    def __init__(self, loaded, dtype=torch.float32):
        self.load, self.calls, self.alive, self.held, self.dtypes = endpoint_loader(loaded, "cpu", dtype), 0, [], [], []

    def __call__(self, k):
        gc.collect()
        self.held.append(sum(ref() is not None for ref in self.alive))
        self.calls += k == 0
        model = self.load(k)
        self.dtypes.append({p.dtype for p in model.parameters()})
        self.alive.append(weakref.ref(model))
        return model


class Counter:
    """A progress bar that only counts."""

    def __init__(self):
        self.n = 0

    def update(self, k):
        self.n += k


def sample(loaded, tokenizer, folder, **changes):
    loader = Loader(loaded)
    data = sampled_data(loader, sampling(loaded, tokenizer, **changes), tokenizer, folder, progress=False)
    return data, loader.calls


def file_bytes(data) -> bytes:
    return data.inputs.path.read_bytes()


def test_same_seed_same_tokens_other_seed_other_tokens(loaded, tokenizer, tmp_path):
    first, _ = sample(loaded, tokenizer, tmp_path / "one")
    again, _ = sample(loaded, tokenizer, tmp_path / "two")
    other, _ = sample(loaded, tokenizer, tmp_path / "three", seed=1)
    assert first.inputs.path.name == again.inputs.path.name  # named by the settings, not by the folder
    assert file_bytes(first) == file_bytes(again) and first.inputs.digest() == again.inputs.digest()
    assert file_bytes(first) != file_bytes(other) and first.inputs.digest() != other.inputs.digest()
    assert first.inputs.path.name != other.inputs.path.name
    windows = first.inputs[:]
    assert windows.shape == (11, SEQ_LEN) and first.info["tokens"] == 11 * (SEQ_LEN - 1)
    assert (windows[:, 0] == start_token(tokenizer)).all()  # every sequence starts with the start token
    assert len(set(map(tuple, windows.tolist()))) == 11  # and then goes its own way


def test_the_file_is_reused_and_sampled_again_when_its_record_differs(loaded, tokenizer, tmp_path):
    first, calls = sample(loaded, tokenizer, tmp_path)
    assert calls == 1 and first.info["reused"] is False
    path, stamp, content = first.inputs.path, first.inputs.path.stat().st_mtime_ns, file_bytes(first)
    again, calls = sample(loaded, tokenizer, tmp_path)
    assert calls == 0 and again.info["reused"] is True  # no model loaded, nothing sampled
    assert path.stat().st_mtime_ns == stamp and file_bytes(again) == content

    hotter, calls = sample(loaded, tokenizer, tmp_path, temperature=1.5)  # other settings: another file
    assert calls == 1 and hotter.inputs.path != path and path.stat().st_mtime_ns == stamp
    assert hotter.info["sampling"]["temperature"] == 1.5

    record = json.loads(metadata_path(path).read_text())  # a record that does not match the file's name
    record["sampling"]["temperature"] = 0.5
    metadata_path(path).write_text(json.dumps(record))
    resampled, calls = sample(loaded, tokenizer, tmp_path)
    assert calls == 1 and resampled.info["reused"] is False and file_bytes(resampled) == content
    assert json.loads(metadata_path(path).read_text())["sampling"]["temperature"] == 1.0

    import numpy as np  # a file cut short (its record intact) is sampled again too
    np.save(path, np.load(path)[:-SEQ_LEN])
    restored, calls = sample(loaded, tokenizer, tmp_path)
    assert calls == 1 and file_bytes(restored) == content


def test_each_model_writes_its_share_interleaved(loaded, tokenizer, tmp_path):
    """Window i comes from model i mod 2 (model A one more of the 11): sampled alone, each model gives exactly
    its windows of the file."""
    data, _ = sample(loaded, tokenizer, tmp_path)
    settings = sampling(loaded, tokenizer)
    assert data.info["per_model"] == [6, 5]
    windows = data.inputs[:]
    for k, model in enumerate(m.backend.load_model(m) for m in loaded):
        generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + k)
        alone = torch.cat(list(sample_sequences(model, settings.shares()[k], settings, generator, "cpu")))
        assert torch.equal(windows[k::2], alone)
    swapped, _ = sample(loaded[::-1], tokenizer, tmp_path / "swapped")  # the other model's share differs
    assert not torch.equal(swapped.inputs[:][1::2][:5], windows[0::2][:5])


def test_one_model_at_a_time_in_the_sampling_precision(loaded, tokenizer, tmp_path):
    """Each model is loaded only once the one before is gone (never two on the device), in the precision asked for;
    bf16 is a setting of its own (another file), and fp32 files keep the name they had before precision was one."""
    for dtype, precision in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        loader = Loader(loaded, dtype)
        settings = sampling(loaded, tokenizer, precision=precision)
        data = sampled_data(loader, settings, tokenizer, tmp_path, progress=False)
        assert loader.held == [0, 0] and loader.dtypes == [{dtype}, {dtype}]
        assert data.inputs[:].shape == (11, SEQ_LEN) and data.info["peak_memory"] is None  # (a CUDA figure)
    names = sorted(p.name for p in tmp_path.glob("self-*.npy"))
    assert len(names) == 2 and not list(tmp_path.glob(".self-shares-*"))  # the shares' scratch files are gone
    assert "precision" not in sampling(loaded, tokenizer).record()
    assert sampling(loaded, tokenizer, precision="bf16").record()["precision"] == "bf16"


def test_self_samples_in_the_learning_precision():
    """bf16 on CUDA (auto), fp32 on the CPU (auto), as --learn-precision says otherwise."""
    from unittest import mock
    assert sampling_dtype(MergeOptions(method="dual"), "cpu") == torch.float32
    assert sampling_dtype(MergeOptions(method="dual", learn_precision="bf16"), "cpu") == torch.bfloat16
    with mock.patch("hf_rebasin.match.learned.bf16_supported", return_value=True):
        assert sampling_dtype(MergeOptions(method="dual"), "cuda:0") == torch.bfloat16
        assert sampling_dtype(MergeOptions(method="dual", learn_precision="fp32"), "cuda:0") == torch.float32


def test_a_chain_of_windows_continues_one_text_and_holds_what_the_model_read(loaded, tokenizer):
    """chain = 3, carried = 6: a text's next window begins with the last 6 tokens of the one before, and every
    token after those is what the model draws from that window alone (greedy, top-p tiny: the argmax of a full
    forward pass without the cache), so a window holds exactly the context it was sampled from."""
    settings = sampling(loaded, tokenizer, chain=3, carried=6, top_p=1e-6, batch=2)
    model = loaded[0].backend.load_model(loaded[0])
    bar = Counter()
    batches = list(sample_sequences(model, 7, settings, torch.Generator().manual_seed(0), "cpu", bar))
    assert [len(b) for b in batches] == [2, 2, 2, 1]  # 2 texts of 3 windows, then a text cut to its first window
    assert bar.n == drawn_tokens(7, settings) == 2 * (15 + 2 * 10) + 15  # the progress bar's total
    first, second, third = batches[:3]
    assert (first[:, 0] == settings.start_token).all() and (batches[3][:, 0] == settings.start_token).all()
    assert torch.equal(second[:, :6], first[:, -6:]) and torch.equal(third[:, :6], second[:, -6:])
    assert (second[:, 0] != settings.start_token).any()  # the continuations begin in the middle of a text
    for window in (first, second, third):
        with torch.no_grad():
            greedy = model(input_ids=window).logits[:, :-1, :settings.vocab_size].argmax(-1)
        begins = 1 if window is first else 6
        assert torch.equal(window[:, begins:], greedy[:, begins - 1:])
    with pytest.raises(ValueError, match="carries 1 to seq_len - 1"):
        sampling(loaded, tokenizer, chain=2, carried=0)


def test_chained_samples_are_deterministic_and_cached_by_their_chain(loaded, tokenizer, tmp_path):
    chained, _ = sample(loaded, tokenizer, tmp_path, chain=4, carried=8)
    again, calls = sample(loaded, tokenizer, tmp_path, chain=4, carried=8)
    single, _ = sample(loaded, tokenizer, tmp_path)
    assert calls == 0 and file_bytes(again) == file_bytes(chained)
    assert single.inputs.path != chained.inputs.path and chained.info["sampling"]["chain"] == 4
    windows = chained.inputs[:]
    for k in (0, 1):  # each model samples 4 texts together (batch 4): their first windows, then the next ones
        own = windows[k::2]
        assert (own[:4, 0] == start_token(tokenizer)).all() and torch.equal(own[4, :8], own[0, -8:])


def test_top_p_keeps_the_most_probable_tokens_only():
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]])).repeat(2000, 1)
    generator = torch.Generator().manual_seed(0)
    drawn = draw(logits, 1.0, 0.7, generator).flatten()
    assert set(drawn.tolist()) == {1, 3}  # 0.5 + 0.3 reach 0.7; the rest never drawn
    assert 0.55 < (drawn == 1).float().mean() < 0.70  # renormalised: 0.5 / 0.8 = 0.625
    assert set(draw(logits, 1.0, 1e-6, generator).flatten().tolist()) == {1}  # the most probable always stays
    assert set(draw(logits, 1.0, 1.0, generator).flatten().tolist()) == {0, 1, 2, 3}
    cold = draw(logits, 0.05, 1.0, generator).flatten()
    assert (cold == 1).float().mean() > 0.99


def test_activation_matching_on_self_samples_from_the_command_line(pair, tmp_path):
    a, b, root = pair
    argv = [*HF_REBASIN, "barrier", str(a), str(b), "--method", "am", "--match-data", "self", "--data",
            str(root / "heldout.txt"), "--seq-len", "32", "--max-eval-tokens", "1024", "--lambdas", "3",
            "--am-batches", "2", "--batch-size", "4", "--learn-seed", "3",
            "--self-samples-dir", str(tmp_path / "cache")]
    for run in ("first", "rerun"):
        done = subprocess.run([*argv, "--json", str(tmp_path / f"{run}.json")], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    first, rerun = (json.loads((tmp_path / f"{run}.json").read_text()) for run in ("first", "rerun"))
    samples = first["settings"]["self_samples"]
    assert samples["windows"] == 2 * 4 and samples["tokens"] == 8 * 31 and samples["per_model"] == [4, 4]
    assert samples["sampling"]["seed"] == 3 and samples["sampling"]["temperature"] == 1.0
    assert samples["reused"] is False and rerun["settings"]["self_samples"]["reused"] is True
    assert rerun["settings"]["self_samples"]["digest"] == samples["digest"]
    assert first["settings"]["batches"] == 2  # activation matching read every sampled window
    assert "sample_s" in first["timings"] and list(first["timings"]).index("sample_s") < list(
        first["timings"]).index("match_s")
    assert rerun["barrier"] == first["barrier"]  # the same samples, the same matching
    assert len(list((tmp_path / "cache").glob("self-*.npy"))) == 1


def test_learned_matching_on_self_samples_reports_them_and_never_evaluates_on_them(pair, tmp_path, capsys):
    cache = tmp_path / "cache"
    assert short_dual(pair, tmp_path / "out", "--train-data", "self", "--self-samples-dir", str(cache),
                      "--self-temperature", "0.8", "--max-train-tokens", "1024") == 0
    report = json.loads((tmp_path / "out" / "barrier.json").read_text())
    samples = report["settings"]["self_samples"]
    assert samples["windows"] == 1024 // 32 and samples["sampling"]["temperature"] == 0.8
    assert samples["sampling"]["chain"] == CHAIN and samples["sampling"]["carried"] == CARRIED
    assert report["settings"]["train_data"]["spec"] == "self"
    assert report["settings"]["train_data"]["digest"] == samples["digest"] != report["data"]["digest"]
    card = (tmp_path / "out" / "README.md").read_text()
    assert "sampled from the models" in card and samples["digest"] in card and "temperature 0.8" in card
    assert CARRIED == 1 and f"over up to {CHAIN} windows, the next beginning with the last token of" in card
    assert re.search(r"\*\*Time\*\*: load [\d.]+ s, sample [\d.]+ s, match [\d.]+ s", card)
    # on self samples the target is the models' own prediction by default (--soft-targets 1), recorded and carded
    assert report["settings"]["learned"]["soft_targets"] == 1.0
    assert "the target 1 × the models' own prediction at the step's λ, mixed, and 0 × the sampled next token" in card

    # the samples are compared with the evaluation data by content, like any training data: evaluated on the
    # sampled file itself, every training window is found there and the run is refused
    (sampled,) = cache.glob("self-*.npy")
    a, b, _ = pair
    from hf_rebasin.cli import main
    code = main(["barrier", str(a), str(b), "--method", "dual", "--data", str(sampled), "--seq-len", "32",
                 "--lambdas", "3", "--steps", "4", "--learn-batch-size", "8", "--eval-every", "0", "--train-data",
                 "self", "--self-samples-dir", str(cache), "--self-temperature", "0.8", "--max-train-tokens", "1024"])
    assert code == 2
    err = capsys.readouterr().err
    assert "are also in the evaluation data" in err and "--train-data" in err


def test_image_models_are_refused_by_name(tiny_dirs, tmp_path, capsys):
    from hf_rebasin.cli import main
    for flag, method in (("--match-data", "am"), ("--train-data", "dual")):
        code = main(["barrier", str(tiny_dirs["vit"]), str(tiny_dirs["vit"]), "--method", method, flag, "self",
                     "--data", str(tmp_path / "images.npz")])
        err = capsys.readouterr().err
        assert code == 2 and f"{flag} self" in err and "cannot generate images" in err, err
    # nor do they sample by default, so the sampling options are refused for them as for any run that samples nothing
    code = main(["barrier", str(tiny_dirs["vit"]), str(tiny_dirs["vit"]), "--method", "dual", "--self-temperature",
                 "0.7", "--data", str(tmp_path / "images.npz")])
    err = capsys.readouterr().err
    assert code == 2 and "--self-temperature is for --train-data / --match-data self" in err, err
    assert MergeOptions(method="dual", self_temperature=0.7).ignored() == {}  # a language model would use it


@pytest.mark.parametrize("options, flag", [
    (dict(method="wm", train_data="self"), "--train-data"),
    (dict(method="wm", match_data="self"), "--match-data"),
    (dict(method="am", train_data="self"), "--train-data"),
    (dict(method="wm", self_temperature=0.7), "--self-temperature"),
    (dict(method="dual", train_data="corpus.txt", self_top_p=0.9), "--self-top-p"),
    (dict(method="am", learn_seed=3), "--learn-seed"),
    (dict(method="dual", train_data="corpus.txt", match_data="self"), "--match-data"),
], ids=lambda value: str(value))
def test_options_a_run_would_ignore_are_refused(options, flag):
    with pytest.raises(OptionError, match=flag):
        MergeOptions(**options).check()


def test_options_that_self_sampling_uses_are_accepted():
    for options in (dict(method="am", match_data="self", learn_seed=3, self_temperature=0.7),
                    dict(method="dual", train_data="self", self_top_p=0.9, learn_seed=2),
                    dict(method="lm", match_data="self", self_temperature=1.2)):
        MergeOptions(**options).check()
        assert MergeOptions(**options).self_sampled()
    assert not MergeOptions(method="dual", train_data="corpus.txt").self_sampled()


def test_language_models_learn_on_self_samples_unless_given_data():
    """The default of lm/dual without --train-data and --match-data, for language models only (BENCHMARKS.md,
    "`self` by default")."""
    for method in ("dual", "lm"):
        default = MergeOptions(method=method)
        assert default.self_sampled() and default.self_sampled("causal-lm") and default.self_by_default("causal-lm")
        assert default.soft_target_share("causal-lm") == 1.0
        assert not default.self_sampled("image-classification") and not default.self_by_default("image-classification")
        assert default.soft_target_share("image-classification") == 0.0
        for given in (dict(train_data="corpus.txt"), dict(match_data="corpus.txt")):
            assert not MergeOptions(method=method, **given).self_sampled()
        assert MergeOptions(method=method, train_data="self").self_sampled()
        assert not MergeOptions(method=method, train_data="self").self_by_default()
    for method in ("wm", "am", "raw"):  # am matches on --data unless told; the others read no data
        assert not MergeOptions(method=method).self_sampled()


def test_dual_without_training_data_samples_an_eighth_of_its_steps(pair, tmp_path, capsys):
    """`merge A B --method dual --data D`: trains on `self` (said on stderr, in barrier.json and the card),
    sampling an eighth of the windows its steps draw plus the held-out ones, and evaluates on all of D."""
    from hf_rebasin.match.alignment import DEFAULT_HOLDOUT
    from hf_rebasin.options import SELF_SAMPLE_SHARE
    cache = tmp_path / "cache"
    assert short_dual(pair, tmp_path / "out", "--self-samples-dir", str(cache)) == 0
    err = capsys.readouterr().err
    steps, batch = 4, 8  # short_dual's
    windows = -(-steps * batch // SELF_SAMPLE_SHARE) + DEFAULT_HOLDOUT
    assert f"no --train-data: --method dual trains on {windows:,} windows of 32 tokens sampled from the models" in err
    report = json.loads((tmp_path / "out" / "barrier.json").read_text())
    samples = report["settings"]["self_samples"]
    # tokens: predicted tokens (a window of 32 predicts 31)
    assert SELF_SAMPLE_SHARE == 8 and samples["windows"] == windows and samples["tokens"] == windows * 31
    assert report["settings"]["train_data"]["spec"] == "self" and report["settings"]["learned"]["soft_targets"] == 1.0
    assert any(note.startswith(f"no --train-data: learned matching trained on {windows * 31:,} predicted tokens of "
                               "text sampled")
               for note in report["notes"])
    assert "part" not in report["data"] and report["data"]["input_tokens"] == 2048  # all of --data is evaluated
    assert report["data"]["tokens"] == 2048 // 32 * 31
    card = (tmp_path / "out" / "README.md").read_text()
    assert "sampled from the models themselves" in card and "no --train-data" in card
    # --max-train-tokens raises the sample up to one pass over the steps (and caps it below that)
    assert short_dual(pair, tmp_path / "full", "--self-samples-dir", str(cache), "--max-train-tokens", "99999") == 0
    full = json.loads((tmp_path / "full" / "barrier.json").read_text())["settings"]["self_samples"]
    assert full["windows"] == steps * batch + DEFAULT_HOLDOUT


def test_soft_targets_default_to_the_models_own_prediction_on_self_samples_only():
    assert MergeOptions(method="dual", train_data="self").soft_target_share("causal-lm") == 1.0
    assert MergeOptions(method="lm", match_data="self").soft_target_share("causal-lm") == 1.0
    assert MergeOptions(method="dual", train_data="corpus.txt").soft_target_share("causal-lm") == 0.0
    assert MergeOptions(method="dual", train_data="self", soft_targets=0.25).soft_target_share("causal-lm") == 0.25
    assert MergeOptions(method="dual", train_data="corpus.txt", soft_targets=0.5).soft_target_share("causal-lm") == 0.5
    assert MergeOptions(method="dual", train_data="self").soft_target_share("image-classification") == 0.0
    with pytest.raises(OptionError, match="--soft-targets must be in"):
        MergeOptions(method="dual", train_data="self", soft_targets=1.5).check()
    with pytest.raises(OptionError, match="--soft-targets"):  # learned matching only
        MergeOptions(method="wm", soft_targets=0.5).check()


def test_data_self_is_refused(pair, capsys):
    from hf_rebasin.cli import main
    a, b, _ = pair
    assert main(["barrier", str(a), str(b), "--data", "self"]) == 2
    assert "never on samples" in capsys.readouterr().err


class OlderCacheKeyword(torch.nn.Module):
    """A model as transformers releases before the `cache` keyword call it (5.17, the GPU machines' release): the
    KV cache in and out as `past_key_values` only; a `cache` keyword would be a TypeError."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, past_key_values=None, use_cache=True):
        out = self.model(input_ids=input_ids, cache=past_key_values, use_cache=use_cache)
        return SimpleNamespace(logits=out.logits, past_key_values=out.cache)


def test_sampling_speaks_the_cache_keyword_of_the_installed_transformers(loaded, tokenizer):
    """The same tokens from a model whose forward names its KV cache `past_key_values` (out.cache raised an
    AttributeError there, so `self` failed on transformers 5.17)."""
    settings = sampling(loaded, tokenizer, batch=2)
    model = loaded[0].backend.load_model(loaded[0])
    draws = [list(sample_sequences(m, 3, settings, torch.Generator().manual_seed(0), "cpu"))
             for m in (model, OlderCacheKeyword(model))]
    assert all(torch.equal(a, b) for a, b in zip(*draws, strict=True)) and len(draws[0]) == 2
