"""hf-rebasin merge / barrier end to end on tiny models: recovery of disguised copies, the
barrier protocol, the output folder, and bad input."""
import json
import math

import checks
import pytest
import torch
from checks import data_args, disguise
from conftest import train_char_models

from hf_rebasin import tiny
from hf_rebasin.cli import main
from hf_rebasin.core import symmetry
from hf_rebasin.core.symmetry import Transform
from hf_rebasin.sources import models


@pytest.mark.parametrize("kind", tiny.kinds())
def test_weight_matching_recovers_a_disguised_copy(kind, tiny_dirs, tmp_path, text_file, image_file):
    checks.weight_matching_recovers_a_disguised_copy(kind, tiny_dirs[kind], tmp_path, text_file, image_file)


def _barrier(a, b, method, kind, text_file, image_file, tmp_path, *extra):
    return checks.barrier_report(a, b, method, kind, text_file, image_file, tmp_path, *extra)


@pytest.mark.parametrize("kind", tiny.kinds())
def test_rotation_objective_is_the_distance_weight_matching_reports(kind, tiny_dirs, tmp_path):
    """The residual Procrustes maximises tr(G^T M); that must be exactly the overlap term of the
    distance the rounds are judged by, or the rounds drift and "best round" picks the wrong one."""
    from hf_rebasin.match.weight import _transit_overlap, relative_distance, residual_cross
    a = models.canonicalise(models.load(tiny_dirs[kind]))
    b = models.canonicalise(models.load(tiny.make_tiny(kind, tmp_path / "b", seed=2)))
    m = residual_cross(a.params, b.params)
    norm_a = sum(float(v.double().pow(2).sum()) for v in a.params.values())
    gen = torch.Generator().manual_seed(0)
    d = a.spec.d_model
    if a.spec.residual == "signed_permutation":  # the spec's own group (a norm gain on the stream moves with |G|)
        draw = lambda: symmetry.random_signed_permutation(d, gen, one_sign=a.spec.centred)
    elif a.spec.centred:
        draw = lambda: symmetry.random_rotation_fixing_ones(d, gen)
    else:
        draw = lambda: symmetry.random_orthogonal(d, gen)
    distances, overlaps = [], []
    for g in (draw(), draw()):
        t = Transform.identity(a.spec)
        t.rotation = g.float()
        distances.append(relative_distance(a.params, b, t))
        # (+ an MLM head's transit tensor G^T W |G|: quadratic in G, outside the objective, inside the distance)
        overlaps.append(float((g.float().double() * m[0]).sum() + (g.float().double().abs() * m[1]).sum())
                        + _transit_overlap(a.params, b.params, g))
    assert distances[0] - distances[1] == pytest.approx(-2 * (overlaps[0] - overlaps[1]) / norm_a, rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("kind", tiny.kinds())
def test_the_distance_weight_matching_logs_is_the_distance_of_what_it_returns(kind, tiny_dirs, tmp_path):
    """Each round's distance is computed algebraically from the cross-products (no second pass over the
    layers); recomputed directly from the transform kept, it must agree."""
    from hf_rebasin.match.weight import relative_distance, weight_matching
    a = models.canonicalise(models.load(tiny_dirs[kind]))
    b = models.canonicalise(models.load(tiny.make_tiny(kind, tmp_path / "b", seed=2)))
    alignment = weight_matching(a, b, max_rounds=3, tol=0.0, progress=False)
    t_a, t_b = alignment.transforms
    logged = min(e["distance"] for e in alignment.log)
    # 3 rounds, unless the distance stopped falling (tol=0): a discrete residual group can converge exactly
    stopped = len(alignment.log) >= 3 and alignment.log[-1]["distance"] >= alignment.log[-2]["distance"]
    assert (len(alignment.log) == 4 or stopped) and t_b.rotation is not None
    assert relative_distance(symmetry.apply(a, t_a), b, t_b) == pytest.approx(logged, rel=1e-5, abs=1e-8)


@pytest.mark.parametrize("kind", ["gpt_neox", "llama_gqa_tied", "vit", "olmo2_gqa", "vit_norm_pre", "deit_distilled"])
def test_activation_matching_recovers_a_permuted_copy(kind, tiny_dirs, tmp_path, text_file, image_file):
    twin = disguise(tiny_dirs[kind], tmp_path / "twin", seed=21, permutation_only=True)
    for method in ("am-perm", "am", "wm-perm"):
        report = _barrier(tiny_dirs[kind], twin, method, kind, text_file, image_file, tmp_path)
        assert report["barrier"] < 1e-3, method


@pytest.mark.parametrize("kind", ["gpt_neox", "llama_gqa_tied", "vit", "olmo2_gqa", "vit_norm_pre", "deit_distilled",
                                  "gemma2_gqa_tied", "qwen3_gqa_tied"])
def test_activation_matching_over_the_full_group_recovers_a_disguised_copy(kind, tiny_dirs, tmp_path, text_file,
                                                                            image_file):
    """A random element of the whole group (residual rotation or signed permutation, per-head maps, GLU scales):
    am finds it from activations; the permutation baseline cannot."""
    twin = disguise(tiny_dirs[kind], tmp_path / "twin", seed=21)
    def off_flat(report):  # how far the path strays from the endpoint's loss
        return max(abs(loss - report["loss"][0]) for loss in report["loss"])

    full = _barrier(tiny_dirs[kind], twin, "am", kind, text_file, image_file, tmp_path)
    assert full["barrier"] < 1e-3 and off_flat(full) < 1e-3
    permutations = _barrier(tiny_dirs[kind], twin, "am-perm", kind, text_file, image_file, tmp_path)
    assert off_flat(permutations) > 1e-2


def test_merge_output_and_protocol(tiny_dirs, tmp_path, text_file):
    from transformers import AutoTokenizer
    a, b = tiny_dirs["gpt_neox"], tmp_path / "b"
    tiny.make_tiny("gpt_neox", b, seed=2)
    out = tmp_path / "merged"
    assert main(["merge", str(a), str(b), "--method", "wm", "--out", str(out), "--alpha", "0.3",
                 "--data", str(text_file), "--seq-len", "32", "--max-eval-tokens", "2048"]) == 0
    for name in ("config.json", "model.safetensors", "tokenizer.json", "barrier.json", "barrier.png",
                 "transforms.safetensors"):
        assert (out / name).is_file(), name
    report = json.loads((out / "barrier.json").read_text())
    assert report["lambdas"] == [k / 10 for k in range(11)] and len(report["loss"]) == 11
    assert report["data"]["input_tokens"] == 2048 and report["data"]["seq_len"] == 32
    assert report["data"]["tokens"] == 64 * 31  # predicted: 64 windows of 32 predict 31 tokens each
    assert report["perplexity"] == pytest.approx([math.exp(v) for v in report["loss"]])
    ends = report["endpoint_loss"]
    excess = [loss - ((1 - lam) * ends[0] + lam * ends[1]) for lam, loss in zip(report["lambdas"], report["loss"])]
    assert report["barrier"] == pytest.approx(max(excess))
    assert report["command"].startswith("hf-rebasin merge ")
    # the merged model measured independently, with the same protocol (α = 0.3 is on the grid)
    from hf_rebasin.evaluation.barrier import evaluate
    from hf_rebasin.sources.data import load_token_windows
    from hf_rebasin.sources.eval_data import EvalData
    windows, _ = load_token_windows(str(text_file), AutoTokenizer.from_pretrained(out), 32, 2048)
    loss = evaluate(models.load(out).model, EvalData("causal-lm", windows))["loss"]
    assert abs(loss - report["merged_loss"]) < 1e-3 and abs(loss - report["loss"][3]) < 1e-3
    # endpoint A of the path is model A itself
    loss_a = evaluate(models.load(a).model, EvalData("causal-lm", windows))["loss"]
    assert abs(loss_a - report["loss"][0]) < 1e-4
    # the transforms reproduce the aligned models
    from safetensors.torch import load_file
    tensors = load_file(out / "transforms.safetensors")
    spec = models.canonicalise(models.load(a)).spec
    t_b = Transform.from_tensors({k[2:]: v for k, v in tensors.items() if k.startswith("b.")}, spec)
    assert t_b.rotation.shape == (spec.d_model, spec.d_model) and len(t_b.head_perm) == spec.n_layers


def test_alpha_off_grid_is_evaluated(tiny_dirs, tmp_path, text_file):
    b = tiny.make_tiny("gpt2", tmp_path / "b", seed=3)
    assert main(["merge", str(tiny_dirs["gpt2"]), str(b), "--out", str(tmp_path / "m"), "--alpha", "0.25",
                 "--data", str(text_file), "--seq-len", "32", "--max-eval-tokens", "1024"]) == 0
    report = json.loads((tmp_path / "m" / "barrier.json").read_text())
    from transformers import AutoTokenizer

    from hf_rebasin.evaluation.barrier import evaluate
    from hf_rebasin.sources.data import load_token_windows
    from hf_rebasin.sources.eval_data import EvalData
    windows, _ = load_token_windows(str(text_file), AutoTokenizer.from_pretrained(tmp_path / "m"), 32, 1024)
    assert abs(evaluate(models.load(tmp_path / "m").model, EvalData("causal-lm", windows))["loss"]
               - report["merged_loss"]) < 1e-3


# --- bad input -------------------------------------------------------------------------------------

def run_cli(args, capsys):
    code = main(args)
    return code, capsys.readouterr().err


def test_bad_inputs(tiny_dirs, tmp_path, text_file, capsys):
    common = ["--data", str(text_file), "--seq-len", "32", "--max-eval-tokens", "1024"]
    out = str(tmp_path / "out")
    neox, gpt2 = str(tiny_dirs["gpt_neox"]), str(tiny_dirs["gpt2"])
    code, err = run_cli(["merge", neox, gpt2, "--out", out, *common], capsys)
    assert code == 2 and "different architectures" in err
    import transformers
    wide = transformers.GPTNeoXConfig(**{**tiny.adapter_of("gpt_neox").tiny["gpt_neox"], "intermediate_size": 80})
    transformers.GPTNeoXForCausalLM(wide).save_pretrained(tmp_path / "wide")
    code, err = run_cli(["merge", neox, str(tmp_path / "wide"), "--out", out, *common], capsys)
    assert code == 2 and "ffn_dim: 64 vs 80" in err and "put the widest model first" in err
    # same shapes, different tokenizer
    (tmp_path / "vocab").mkdir()
    models.load(neox).model.save_pretrained(tmp_path / "vocab")
    tok = tiny.tiny_tokenizer(97)
    tok.add_tokens(["zzz"])  # shifts nothing, but adds an entry B lacks
    tok.save_pretrained(tmp_path / "vocab")
    code, err = run_cli(["merge", neox, str(tmp_path / "vocab"), "--out", out, *common], capsys)
    assert code == 2 and "tokenizers" in err and "differ" in err
    # unsupported
    olmo3 = transformers.Olmo3Config(hidden_size=32, num_attention_heads=4, num_hidden_layers=1,
                                     intermediate_size=32, vocab_size=97, pad_token_id=1, bos_token_id=None,
                                     eos_token_id=2)
    transformers.Olmo3ForCausalLM(olmo3).save_pretrained(tmp_path / "olmo3")
    code, err = run_cli(["merge", str(tmp_path / "olmo3"), str(tmp_path / "olmo3"), "--out", out, *common], capsys)
    assert code == 2 and "Olmo3ForCausalLM is not supported" in err
    # non-finite weights
    broken = tiny.build_tiny("gpt_neox", seed=1)
    with torch.no_grad():
        broken.gpt_neox.layers[0].mlp.dense_h_to_4h.weight[3, 3] = float("inf")
    broken.save_pretrained(tmp_path / "inf")
    tiny.tiny_tokenizer(97).save_pretrained(tmp_path / "inf")
    code, err = run_cli(["merge", neox, str(tmp_path / "inf"), "--out", out, *common], capsys)
    assert code == 2 and "non-finite" in err
    # empty and too-short data
    (tmp_path / "empty.txt").write_text("")
    code, err = run_cli(["merge", neox, neox, "--out", out, "--data", str(tmp_path / "empty.txt")], capsys)
    assert code == 2 and "no text" in err
    (tmp_path / "short.txt").write_text("to be or not")
    code, err = run_cli(["merge", neox, neox, "--out", out, "--data", str(tmp_path / "short.txt"),
                         "--seq-len", "32"], capsys)
    assert code == 2 and "tokens" in err
    # a method name that does not exist
    code, err = run_cli(["merge", neox, neox, "--out", out, "--method", "magic", *common], capsys)
    assert code == 2 and "unknown --method" in err
    assert not (tmp_path / "out").exists()


def test_existing_out_needs_force(tiny_dirs, tmp_path, text_file, capsys):
    common = ["--data", str(text_file), "--seq-len", "32", "--max-eval-tokens", "1024"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    neox = str(tiny_dirs["gpt_neox"])
    code, err = run_cli(["merge", neox, neox, "--out", str(out), *common], capsys)
    assert code == 2 and "already exists" in err and "--force" in err
    assert (out / "keep.txt").read_text() == "mine"
    # --force replaces only an earlier hf-rebasin output, never a folder of anything else
    code, err = run_cli(["merge", neox, neox, "--out", str(out), "--force", *common], capsys)
    assert code == 2 and "is not an hf-rebasin output" in err
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()  # an empty folder may be used
    assert main(["merge", neox, neox, "--out", str(out), *common]) == 0
    first = (out / "barrier.json").read_text()
    assert main(["merge", neox, neox, "--out", str(out), "--force", "--method", "raw", *common]) == 0
    assert (out / "barrier.json").read_text() != first and '"method": "raw"' in (out / "barrier.json").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging folder left beside it


def test_interrupt_leaves_nothing_half_written(tiny_dirs, tmp_path, text_file, monkeypatch):
    from hf_rebasin import pipeline

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(pipeline, "plot_path", interrupted)  # after the model files are written
    neox = str(tiny_dirs["gpt_neox"])
    code = main(["merge", neox, neox, "--out", str(tmp_path / "out"), "--data", str(text_file),
                 "--seq-len", "32", "--max-eval-tokens", "1024"])
    assert code == 130
    assert list(tmp_path.iterdir()) == []  # neither DIR nor its temporary sibling


@pytest.mark.parametrize("kind", ["gpt2", "vit", "mixtral_moe"])
def test_three_way_merge_of_disguised_copies(kind, tiny_dirs, tmp_path, text_file, image_file):
    original = tiny_dirs[kind]
    twins = [disguise(original, tmp_path / f"twin{s}", seed=s) for s in (31, 32)]
    out = tmp_path / "merged"
    assert main(["merge", str(original), *map(str, twins), "--method", "wm", "--out", str(out),
                 "--simplex-resolution", "3", *data_args(kind, text_file, image_file)]) == 0
    report = json.loads((out / "barrier.json").read_text())
    assert report["n_models"] == 3 and len(report["lambdas"]) == 10  # C(5, 2) lattice points
    assert report["barrier"] < 1e-3
    x = tiny.example_inputs(kind, seed=8)
    reference = tiny.outputs(models.load(original).model, x)
    assert (tiny.outputs(models.load(out).model, x) - reference).abs().max() < 1e-4  # the centroid
    assert (out / "barrier.png").stat().st_size > 0 and (out / "README.md").is_file()


def test_three_way_barrier_is_max_excess_over_the_simplex(tiny_dirs, tmp_path, text_file):
    others = [tiny.make_tiny("gpt2", tmp_path / f"m{s}", seed=s) for s in (5, 6)]
    out = tmp_path / "b.json"
    assert main(["barrier", str(tiny_dirs["gpt2"]), *map(str, others), "--method", "raw", "--json", str(out),
                 "--data", str(text_file), "--seq-len", "32", "--max-eval-tokens", "1024"]) == 0
    report = json.loads(out.read_text())
    weights, losses, ends = report["lambdas"], report["loss"], report["endpoint_loss"]
    assert len(weights) == 28 and all(abs(sum(w) - 1) < 1e-9 for w in weights)
    excess = [loss - sum(wi * li for wi, li in zip(w, ends)) for w, loss in zip(weights, losses)]
    assert report["barrier"] == pytest.approx(max(excess))
    assert weights.index([1.0, 0.0, 0.0]) >= 0 and losses[weights.index([1.0, 0.0, 0.0])] == ends[0]


# --- weight matching on trained models -------------------------------------------------------------

@pytest.fixture(scope="module")
def trained_gpt2_pair(tmp_path_factory):
    """Two tiny GPT-2s (learned positional embeddings, tied head) trained from two seeds on Tiny
    Shakespeare (char-level), and held-out text."""
    return train_char_models(tmp_path_factory.mktemp("trained_gpt2"), "gpt2", (0, 1))


def test_weight_matching_removes_most_of_a_trained_pairs_barrier(trained_gpt2_pair, tmp_path):
    root = trained_gpt2_pair
    barrier = {}
    for method in ("raw", "wm-perm", "wm"):
        out = tmp_path / f"{method}.json"
        assert main(["barrier", str(root / "model-0"), str(root / "model-1"), "--method", method, "--data",
                     str(root / "test.txt"), "--seq-len", "32", "--max-eval-tokens", "8192", "--lambdas", "5",
                     "--batch-size", "64", "--json", str(out)]) == 0
        barrier[method] = json.loads(out.read_text())["barrier"]
    assert barrier["raw"] > 0.3, barrier  # there is a barrier to remove
    assert barrier["wm"] < 0.5 * barrier["raw"] and barrier["wm"] < barrier["wm-perm"], barrier
