"""Small-model training (hf_rebasin.training) and the bundled example pair (hf_rebasin/assets/example-pair)."""
from __future__ import annotations

import inspect
import json
import math
import os
from pathlib import Path

import pytest
import torch

from hf_rebasin import tiny
from hf_rebasin.assets import example_pair as example_pair_folder
from hf_rebasin.match.train_loop import lr_factor
from hf_rebasin.sources.data import read_texts, token_windows
from hf_rebasin.training import (
    causal_lm_loss,
    classifier_metrics,
    save_lm,
    save_vit,
    train_causal_lm,
    train_vit,
    write_atomically,
)

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = example_pair_folder()
# Measured on the bundled pair (hf_rebasin/assets/example-pair/README.md), 128-token windows of heldout.txt:
# model-a 3.715, model-b 3.718 nats/token, ln(1024) = 6.931; the plain average of their weights 5.034.
# Thresholds keep a margin.
EXAMPLE_LOSS_CEILING = 0.6 * math.log(1024)  # 4.16
EXAMPLE_MIN_RAW_GAP = 0.6  # raw average minus the worse endpoint: measured 1.32


@pytest.fixture(scope="module")
def char_data():
    """Real text (the source of two stdlib modules) as windows of the 97-symbol character tokenizer."""
    import difflib
    import json as json_module

    tokenizer = tiny.tiny_tokenizer(97)
    texts = [inspect.getsource(difflib), inspect.getsource(json_module.decoder)]
    return tokenizer, token_windows(texts, tokenizer, seq_len=32, max_tokens=32 * 256)


def tiny_neox(vocab_size: int = 97):
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                         rotary_pct=0.25, use_parallel_residual=True, max_position_embeddings=64,
                         vocab_size=vocab_size, tie_word_embeddings=False)


def state(model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    factors = [lr_factor(step, steps=100, warmup=10) for step in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(factors[:10], factors[1:10]))
    assert all(a >= b for a, b in zip(factors[9:], factors[10:]))
    assert factors[-1] == pytest.approx(0.1)


def test_train_causal_lm_learns_deterministically_and_seed_matters(char_data):
    from transformers import AutoModelForCausalLM

    _, windows = char_data
    torch.manual_seed(0)
    untrained = AutoModelForCausalLM.from_config(tiny_neox())
    before = causal_lm_loss(untrained, windows)
    settings = dict(steps=40, batch_size=16, lr=3e-3, warmup=4, progress=False)
    first = train_causal_lm(tiny_neox(), windows, seed=0, **settings)
    after = causal_lm_loss(first, windows)
    assert after < before - 1.0, (before, after)
    assert after < 0.8 * math.log(97)

    again = train_causal_lm(tiny_neox(), windows, seed=0, **settings)
    other = train_causal_lm(tiny_neox(), windows, seed=1, **settings)
    weights, weights_again, weights_other = state(first), state(again), state(other)
    assert all(torch.equal(weights[name], weights_again[name]) for name in weights)
    assert all(not torch.equal(weights[name], weights_other[name]) for name in weights if weights[name].dim() == 2)
    assert all(t.dtype == torch.float32 for t in weights.values())
    assert not first.training


def test_data_seed_changes_the_data_order_alone(char_data):
    """data_seed: one initialisation, another data order (a shared-initialisation pair); default = seed."""
    _, windows = char_data
    settings = dict(steps=1, batch_size=4, lr=1e-9, warmup=1, weight_decay=0.0, progress=False)
    init = state(train_causal_lm(tiny_neox(), windows, seed=0, **settings))  # one ~zero step: the initialisation
    init_other_order = state(train_causal_lm(tiny_neox(), windows, seed=0, data_seed=1, **settings))
    assert all(torch.allclose(init[n], init_other_order[n], atol=1e-6) for n in init)

    settings = dict(steps=5, batch_size=4, lr=3e-3, warmup=1, progress=False)
    default = state(train_causal_lm(tiny_neox(), windows, seed=0, **settings))
    same = state(train_causal_lm(tiny_neox(), windows, seed=0, data_seed=0, **settings))
    other = state(train_causal_lm(tiny_neox(), windows, seed=0, data_seed=1, **settings))
    assert all(torch.equal(default[n], same[n]) for n in default)
    assert any(not torch.allclose(default[n], other[n]) for n in default if default[n].dim() == 2)


def test_train_causal_lm_rejects_bad_windows(char_data):
    _, windows = char_data
    with pytest.raises(ValueError, match="vocab_size"):
        train_causal_lm(tiny_neox(vocab_size=50), windows, seed=0, steps=1, batch_size=2, lr=1e-3, progress=False)
    with pytest.raises(ValueError, match="token_windows"):
        train_causal_lm(tiny_neox(), windows.float(), seed=0, steps=1, batch_size=2, lr=1e-3, progress=False)
    with pytest.raises(ValueError, match="positions"):
        train_causal_lm(tiny_neox(), windows.reshape(-1, 128), seed=0, steps=1, batch_size=2, lr=1e-3,
                        progress=False)


def test_save_lm_reloads_with_stock_code_and_same_logits(char_data, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer, windows = char_data
    model = train_causal_lm(tiny_neox(), windows, seed=3, steps=3, batch_size=4, lr=1e-3, progress=False)
    out = save_lm(model, tokenizer, tmp_path / "lm")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lm"]  # no temporary folder left beside it
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # an ordinary folder, not mkdtemp's private one
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=windows[:4]).logits, reloaded(input_ids=windows[:4]).logits)
    text = "def f(x):\n    return x"
    assert AutoTokenizer.from_pretrained(out)(text)["input_ids"] == tokenizer(text)["input_ids"]

    save_lm(model, tokenizer, out)  # overwriting a finished folder is allowed and leaves no debris
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lm"]


def test_failed_write_leaves_the_target_untouched(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("old")

    def broken(folder: Path) -> None:
        (folder / "half.bin").write_bytes(b"x")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomically(target, broken)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in target.iterdir()) == ["keep.txt"]


def test_train_vit_learns_and_reloads_from_local_dir(tmp_path):
    import timm

    model_args = dict(in_chans=1, img_size=8, patch_size=4, embed_dim=16, depth=1, num_heads=2, num_classes=2)
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 2, (128,), generator=generator)
    images = torch.randn(128, 1, 8, 8, generator=generator) * 0.5
    images[:, :, :4] += (2 * labels - 1).float().view(-1, 1, 1, 1)  # class = sign of the top half
    loss_before, _ = classifier_metrics(timm.create_model("vit_tiny_patch16_224", **model_args), images, labels)
    settings = dict(steps=30, batch_size=32, lr=3e-3, warmup=3, max_shift=1, progress=False)
    model = train_vit(model_args, images, labels, seed=0, **settings)
    loss_after, accuracy = classifier_metrics(model, images, labels)
    assert loss_after < loss_before and accuracy > 0.9, (loss_before, loss_after, accuracy)
    again = train_vit(model_args, images, labels, seed=0, **settings)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))

    out = save_vit(model, model_args, tmp_path / "vit", model_config={"pretrained_cfg": {"tag": "test"}})
    reloaded = timm.create_model("local-dir:" + str(out), pretrained=True).eval()
    with torch.no_grad():
        assert torch.equal(model(images[:8]), reloaded(images[:8]))
    config = json.loads((out / "config.json").read_text())
    assert config["pretrained_cfg"]["input_size"] == [1, 8, 8] and config["pretrained_cfg"]["tag"] == "test"


# ------------------------------------------------------------------------------------------- committed example

@pytest.fixture(scope="module")
def example_pair(monkeypatch_module):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    folders = [EXAMPLE / "model-a", EXAMPLE / "model-b"]
    tokenizer = AutoTokenizer.from_pretrained(folders[0])
    models = [AutoModelForCausalLM.from_pretrained(folder).eval() for folder in folders]
    heldout = token_windows(read_texts(str(EXAMPLE / "heldout.txt")), tokenizer, seq_len=128)
    losses = [causal_lm_loss(model, heldout) for model in models]
    return tokenizer, models, heldout, losses


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_example_pair_is_small_and_complete():
    files = [p for p in EXAMPLE.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 5 * 2**20
    assert (EXAMPLE / "heldout.txt").stat().st_size <= 300_000
    for name in ("model-a", "model-b"):
        folder = EXAMPLE / name
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
            p.name for p in folder.iterdir()}
        assert json.loads((folder / "config.json").read_text())["architectures"] == ["GPTNeoXForCausalLM"]


def test_example_pair_loads_offline_and_has_learned(example_pair):
    tokenizer, (model_a, model_b), heldout, losses = example_pair
    assert len(tokenizer) == model_a.config.vocab_size == model_b.config.vocab_size
    assert tokenizer.eos_token == "<|endoftext|>"
    text = "import os\n\ndef main():\n    return os.getcwd()\n"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert heldout.shape[0] >= 100
    assert model_a.config.use_parallel_residual and not model_a.config.tie_word_embeddings
    assert all(p.dtype == torch.float32 for p in model_a.parameters())
    assert all(loss < EXAMPLE_LOSS_CEILING for loss in losses), losses
    weights_b = dict(model_b.named_parameters())
    assert all(not torch.equal(p, weights_b[name]) for name, p in model_a.named_parameters() if p.dim() == 2)


def test_example_pair_plain_average_is_much_worse(example_pair):
    """The two seeds found different solutions: averaging their weights without alignment breaks the model."""
    from transformers import AutoModelForCausalLM

    _, (model_a, model_b), heldout, losses = example_pair
    average = AutoModelForCausalLM.from_config(model_a.config).eval()
    weights_b = model_b.state_dict()
    average.load_state_dict({name: (t + weights_b[name]) / 2 for name, t in model_a.state_dict().items()})
    assert causal_lm_loss(average, heldout) > max(losses) + EXAMPLE_MIN_RAW_GAP
