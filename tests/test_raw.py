"""`--method raw` is the papers' raw interpolation: the element-wise average of the checkpoints as loaded, compared
here with an average computed independently (safetensors files read and averaged by hand, loaded by the stock
loader), for every tiny variant of every registered adapter."""
import json
import shutil

import checks
import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_rebasin import tiny
from hf_rebasin.cli import main
from hf_rebasin.evaluation.barrier import evaluate
from hf_rebasin.sources import models
from hf_rebasin.sources.eval_data import load_eval_data

KINDS = tiny.kinds()


def average_by_hand(a, b, out):
    """(A + B) / 2 tensor by tensor, from the files, with A's config and companions: no hf-rebasin code involved."""
    shutil.copytree(a, out)
    first, second = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    save_file({k: (v.float() + second[k].float()).div(2).to(v.dtype) if v.is_floating_point() else v
               for k, v in first.items()}, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_raw_is_the_elementwise_average_of_the_checkpoints(kind, tiny_dirs, tmp_path, text_file, image_file):
    a, b = tiny_dirs[kind], tiny.make_tiny(kind, tmp_path / "b", seed=2)
    assert main(["merge", str(a), str(b), "--method", "raw", "--lambdas", "3", "--out", str(tmp_path / "raw"),
                 *checks.data_args(kind, text_file, image_file)]) == 0
    by_hand = average_by_hand(a, b, tmp_path / "by-hand")
    written, expected = load_file(tmp_path / "raw" / "model.safetensors"), load_file(by_hand / "model.safetensors")
    assert written.keys() == expected.keys()  # the source's own tensor names, nothing absorbed or renamed
    for key, value in expected.items():
        assert written[key].dtype == value.dtype and torch.allclose(written[key].float(), value.float(), atol=1e-6), key
    config, source_config = (json.loads((folder / "config.json").read_text()) for folder in (tmp_path / "raw", a))
    for field in ("tie_word_embeddings", "layer_norm_eps", "rms_norm_eps", "layer_norm_epsilon"):
        assert config.get(field) == source_config.get(field), field  # the source's configuration, unchanged

    report = json.loads((tmp_path / "raw" / "barrier.json").read_text())
    reference = models.load(by_hand)
    data = load_eval_data(*checks.data_args(kind, text_file, image_file)[1:2], reference,
                          seq_len=None if tiny.is_image_model(kind) else 32, max_tokens=2048, max_examples=None)
    assert report["merged_loss"] == pytest.approx(evaluate(reference.model, data)["loss"], abs=1e-5)
    assert report["loss"][1] == pytest.approx(report["merged_loss"], abs=1e-6)  # λ = 0.5 is the merged point


def test_raw_differs_from_the_average_of_canonical_forms(tiny_dirs, tmp_path):
    """Why the distinction matters: with norm gains that are not 1, the two averages are different models."""
    from hf_rebasin.core.canonical import interpolate
    a, b = models.load(tiny_dirs["llama_untied_bias"]), models.load(tiny.make_tiny("llama_untied_bias",
                                                                                    tmp_path / "b", seed=2))
    x = tiny.example_inputs("llama_untied_bias")
    plain = models.instantiate(interpolate([models.PlainAverage(models.canonicalise(m)) for m in (a, b)], [.5, .5]), a)
    canonical = models.instantiate(interpolate([models.canonicalise(m) for m in (a, b)], [0.5, 0.5]), a)
    assert checks.max_diff(plain, canonical, x) > 1e-3
