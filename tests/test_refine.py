"""merge --refine-steps (match/refine.py): the refined checkpoint loads with the stock class and is the model
trained; the report's refined loss and ensemble loss equal independent re-measurements; the training loss is the
cross-entropy with the endpoints' mixed prediction; Ctrl-C and --resume give the uninterrupted run, bit for bit;
two processes under `accelerate launch` follow one; the options that refinement uses and does not."""
from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
import torch
import torch.nn.functional as F
from conftest import ACCELERATE_LAUNCH, REPO

from hf_rebasin import tiny
from hf_rebasin.cli import main
from hf_rebasin.core.canonical import interpolate
from hf_rebasin.errors import OptionError
from hf_rebasin.evaluation.barrier import evaluate
from hf_rebasin.match.refine import RefineLoss, refine
from hf_rebasin.options import MergeOptions
from hf_rebasin.run_data import endpoint_loader
from hf_rebasin.sources import models
from hf_rebasin.sources.eval_data import EvalData, load_eval_data

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def refined_merge(pair, out, *extra, method="wm") -> int:
    a, b, root = pair
    return main(["merge", str(a), str(b), "--method", method, "--data", str(root / "heldout.txt"),
                 "--train-data", str(root / "train.txt"), "--seq-len", "32", "--max-eval-tokens", "2048",
                 "--lambdas", "3", "--refine-steps", "6", "--refine-lr", "1e-3", "--learn-batch-size", "8",
                 "--eval-every", "0", "--checkpoint-dir", str(out.parent / "ckpt"), "--out", str(out), *extra])


def test_the_refined_checkpoint_is_the_trained_model_and_its_loss_is_reported(learned_pair, tmp_path):
    from transformers import AutoModelForCausalLM
    out = tmp_path / "refined"
    assert refined_merge(learned_pair, out) == 0
    report = json.loads((out / "barrier.json").read_text())
    refined = report["refined"]
    assert refined["steps"] == 6 and refined["tokens"] == 6 * 8 * 31 and refined["train_s"] > 0
    assert refined["merged_loss"] == report["merged_loss"] and refined["endpoint_loss"] == report["endpoint_loss"]

    # the stock class loads it, and its loss on the evaluation data is the report's (an independent measurement)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    template = models.load(learned_pair[0])
    data = load_eval_data(str(learned_pair[2] / "heldout.txt"), template, seq_len=32, max_tokens=2048,
                          max_examples=None)
    assert evaluate(model, data)["loss"] == pytest.approx(refined["loss"], abs=1e-5)
    assert refined["loss"] < refined["merged_loss"] - 1e-3  # six steps moved it, towards the ensemble

    # the ensemble's loss, measured from the endpoints as loaded: -log of the mean of their probabilities
    ends = [models.load(p).model.eval() for p in learned_pair[:2]]
    with torch.no_grad():
        x = data.inputs
        mixed = sum(0.5 * m(input_ids=x).logits[:, :-1].softmax(-1) for m in ends)
        nll = -mixed.gather(-1, x[:, 1:, None]).log().mean()
    assert float(nll) == pytest.approx(refined["ensemble_loss"], abs=1e-5)

    card = (out / "README.md").read_text()
    assert "trained after merging" in card and "6 steps" in card and "train.txt" in card
    assert f"{refined['loss']:.4f}" in card


def test_without_refinement_nothing_is_trained(learned_pair, tmp_path):
    a, b, root = learned_pair
    out = tmp_path / "plain"
    assert main(["merge", str(a), str(b), "--data", str(root / "heldout.txt"), "--seq-len", "32",
                 "--max-eval-tokens", "2048", "--lambdas", "3", "--out", str(out)]) == 0
    assert "refined" not in json.loads((out / "barrier.json").read_text())
    assert "trained after merging" not in (out / "README.md").read_text()


@pytest.mark.parametrize("kind", ["gpt_neox", "vit"])
def test_the_training_loss_is_the_cross_entropy_with_the_endpoints_mixed_prediction(kind, tmp_path):
    dirs = [tiny.make_tiny(kind, tmp_path / name, seed=seed) for name, seed in (("a", 1), ("b", 5))]
    loaded = [models.load(d) for d in dirs]
    point = models.instantiate(interpolate([models.canonicalise(m) for m in loaded], [0.3, 0.7]), loaded[0])
    ends = [m.model.eval() for m in loaded]
    loss = RefineLoss(point, [endpoint_loader(loaded, "cpu", None)(k).eval() for k in range(2)], [0.3, 0.7],
                      loaded[0].task)
    x = tiny.example_inputs(kind, seed=2)
    labels = None if kind == "gpt_neox" else torch.randint(0, 10, (len(x),))

    def run(m):
        return m(input_ids=x).logits[:, :-1] if kind == "gpt_neox" else m(x)
    with torch.no_grad():
        target = 0.3 * run(ends[0]).softmax(-1) + 0.7 * run(ends[1]).softmax(-1)
        expected = -(target * run(point).log_softmax(-1)).sum(-1).mean()
        truth = x[:, 1:] if kind == "gpt_neox" else labels
        hard = [F.cross_entropy(run(m).reshape(-1, run(m).shape[-1]), truth.reshape(-1)) for m in (point, *ends)]
    trained = loss(x, labels, 0.5)
    assert trained.requires_grad and float(trained.detach()) == pytest.approx(float(expected), abs=1e-5)
    trained.backward()
    assert all(p.grad is not None for p in point.parameters())
    with torch.no_grad():  # held-out estimates: the next token (label), at a vertex the endpoint's
        assert float(loss(x, labels, loss.centre)) == pytest.approx(float(hard[0]), abs=1e-5)
        assert float(loss(x, labels, (1.0, 0.0))) == pytest.approx(float(hard[1]), abs=1e-5)
        assert float(loss(x, labels, (0.0, 1.0))) == pytest.approx(float(hard[2]), abs=1e-5)


def test_resume_after_ctrl_c_equals_an_uninterrupted_run(tiny_dirs, tmp_path):
    a_dir, b_dir = tiny_dirs["gpt_neox"], tiny.make_tiny("gpt_neox", tmp_path / "b", seed=2)
    loaded = [models.load(a_dir), models.load(b_dir)]
    point = interpolate([models.canonicalise(m) for m in loaded], [0.5, 0.5])
    data = EvalData("causal-lm", torch.randint(0, 97, (48, 16), generator=torch.Generator().manual_seed(0)))

    def settings(**changes):
        return MergeOptions(**{"refine_steps": 8, "refine_lr": 1e-3, "learn_batch_size": 8, "eval_every": 0,
                               "holdout": 6, "checkpoint_dir": str(tmp_path / "ckpt"), **changes})

    def run(options, on_step=None):
        return refine(point, loaded[0], endpoint_loader(loaded, "cpu", None), 2, [0.5, 0.5], data, None, options,
                      progress=False, on_step=on_step)

    whole, whole_record = run(settings())

    def press_ctrl_c(step, loss):
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        run(settings(), press_ctrl_c)
    saved = sorted((tmp_path / "ckpt").glob("*.pt"))
    assert len(saved) == 1 and saved[0].name.startswith("refine-") and saved[0].name.endswith("-step0000004.pt")
    resumed, record = run(settings(resume=str(tmp_path / "ckpt")))
    assert record["resumed_from"] == str(saved[0])
    x, y = whole.state_dict(), resumed.state_dict()
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)  # bitwise
    assert whole_record["log"] == record["log"]
    start = models.instantiate(point, loaded[0]).state_dict()
    assert any(not torch.equal(start[k], x[k]) for k in x)  # the steps moved the weights
    with pytest.raises(Exception, match="cannot resume"):  # another learning rate is another trajectory
        run(settings(resume=str(saved[0]), refine_lr=2e-3))


def test_two_processes_follow_one(learned_pair, tmp_path):
    """`accelerate launch` of the command itself: two processes, 2 windows each per micro-step, 2 micro-steps; the
    checkpoint is that of one process taking the same 8 windows per step."""
    a, b, root = learned_pair
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    common = ["merge", str(a), str(b), "--data", str(root / "heldout.txt"), "--train-data", str(root / "train.txt"),
              "--seq-len", "32", "--max-eval-tokens", "1024", "--lambdas", "3", "--refine-steps", "4",
              "--refine-lr", "1e-3", "--learn-batch-size", "8", "--eval-every", "0", "--no-raw-reference",
              "--device", "cpu"]
    two = tmp_path / "two"
    command = [*ACCELERATE_LAUNCH, "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision",
               "no", "--dynamo_backend", "no", "-m", "hf_rebasin.cli", *common, "--grad-accum", "2",
               "--checkpoint-dir", str(tmp_path / "ck2"), "--out", str(two)]
    run = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    one = tmp_path / "one"
    assert main([*common, "--checkpoint-dir", str(tmp_path / "ck1"), "--out", str(one)]) == 0
    reports = [json.loads((folder / "barrier.json").read_text())["refined"] for folder in (two, one)]
    assert [r["num_processes"] for r in reports] == [2, 1]
    from safetensors.torch import load_file
    x, y = load_file(two / "model.safetensors"), load_file(one / "model.safetensors")
    assert x.keys() == y.keys()
    for key in x:  # gloo sums the gradients in another order: fp32 rounding, a few steps of AdamW
        assert (x[key].double() - y[key].double()).abs().max() <= 1e-4, key
    assert reports[0]["loss"] == pytest.approx(reports[1]["loss"], abs=1e-4)


def test_the_options_of_refinement(learned_pair, tmp_path, capsys):
    MergeOptions(method="wm", refine_steps=5, learn_batch_size=8, train_data="x.txt", holdout=0).check()
    MergeOptions(method="lm", refine_steps=5, steps=3).check()
    problems = [
        (MergeOptions(refine_steps=5), {"export": False}, "--refine-steps trains the merged checkpoint"),
        (MergeOptions(refine_lr=1e-3), {}, "--refine-lr is for --refine-steps"),
        (MergeOptions(refine_steps=5, steps=10), {}, "--steps is for the learned methods"),
        (MergeOptions(method="lm", refine_steps=5, gradient_checkpointing=True), {},
         "--gradient-checkpointing is not available"),
        (MergeOptions(learn_batch_size=8), {}, "--learn-batch-size is for the learned methods"),
    ]
    for options, kwargs, message in problems:
        with pytest.raises(OptionError, match=message):
            options.check(**kwargs)
    a, b, root = learned_pair
    code = main(["barrier", str(a), str(b), "--data", str(root / "heldout.txt"), "--refine-steps", "3"])
    assert code != 0 and "--refine-steps" in capsys.readouterr().err
    assert "--refine-steps N" in subprocess.run([*ACCELERATE_LAUNCH[:1], "-m", "hf_rebasin.cli", "merge", "--help"],
                                                 capture_output=True, text=True, cwd=REPO).stdout


def test_without_training_data_the_refinement_trains_on_self_samples(learned_pair, tmp_path):
    a, b, root = learned_pair
    out = tmp_path / "self"
    assert main(["merge", str(a), str(b), "--data", str(root / "heldout.txt"), "--seq-len", "32",
                 "--max-eval-tokens", "2048", "--lambdas", "3", "--refine-steps", "4", "--learn-batch-size", "8",
                 "--eval-every", "0", "--self-samples-dir", str(tmp_path / "samples"), "--checkpoint-dir",
                 str(tmp_path / "ckpt"), "--out", str(out)]) == 0
    report = json.loads((out / "barrier.json").read_text())
    samples = report["settings"]["self_samples"]
    assert report["refined"]["train_data"]["spec"] == "self" and report["refined"]["train_data"]["digest"] == \
        samples["digest"]
    assert samples["windows"] == 4 * 8 // 8 + 32  # an eighth of the windows drawn + the 32 held-out ones
    assert report["refined"]["overlap"]["share"] <= report["refined"]["overlap"]["limit"]
    assert any("the refinement (--refine-steps) trained on" in note for note in report["notes"])
    assert "the refinement after merging trained on" in (out / "README.md").read_text()
