"""The training loop itself (train_loop.train_transforms) under CUDA's rules, without a GPU
(hf_rebasin/match/cuda_loop.py): lm and dual x whole-model and layer by layer x bf16 and fp32, forward and backward
on simulated CUDA; no host sync in a step but the loss read every few steps, fused AdamW, no float64 op.  Three
mutations of the loop that a GPU run would pay for at every step are caught."""
from __future__ import annotations

import inspect
import textwrap

import pytest
import torch

from hf_rebasin import tiny
from hf_rebasin.match import train_loop
from hf_rebasin.match.cuda_loop import run_backward, run_loop
from hf_rebasin.match.cuda_rules import CudaRuleViolation, _path_loss
from hf_rebasin.sources import models
from hf_rebasin.sources.eval_data import EvalData


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(template, [graph A, graph B], training windows) for two tiny GPT-NeoX models."""
    root = tmp_path_factory.mktemp("cuda_loop")
    template = models.load(tiny.make_tiny("gpt_neox", root / "a", seed=1))
    b = models.load(tiny.make_tiny("gpt_neox", root / "b", seed=2))
    graphs = [models.canonicalise(template).materialise(), models.canonicalise(b).materialise()]
    windows = torch.randint(0, template.spec.n_out, (64, 8), generator=torch.Generator().manual_seed(0))
    return template, graphs, EvalData(template.task, windows, None, {})


def path_loss(pair, method: str, layered: bool, precision: str):
    template, graphs, _ = pair
    return _path_loss(template, graphs, method, layered, torch.bfloat16 if precision == "bf16" else None, "absorbed")


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("layered", [False, True], ids=["whole", "layered"])
@pytest.mark.parametrize("method", ["lm", "dual"])
def test_the_training_loop_runs_under_cudas_rules(pair, method, layered, precision):
    """Two steps of a 200-step run (the losses are read every 2 steps): step 1 makes no host sync, step 2 only
    the read (the 2 steps' losses and the Ctrl-C flag: one transfer, which fake tensors read value by value)."""
    first, second = run_loop(path_loss(pair, method, layered, precision), pair[2], method=method)  # checks each step
    assert (first.step, second.step) == (1, 2)
    assert first.n_syncs == 0
    assert second.syncs == {("read", "_local_scalar_dense"): 3}
    for step in (first, second):
        assert step.fused_adamw == 1 and step.float64 == 0
        assert step.backward_launches > 0 and step.launches > step.backward_launches
        if precision == "bf16":  # the forward and the backward both run bf16 kernels under CUDA's autocast
            assert step.bf16["forward"] > 0 and step.bf16["backward"] > 0
        else:
            assert not step.bf16
    assert first.host_to_device == 2 and second.host_to_device == 3  # the batch and its token ids; the flag


# the loop's code, and what a mutation makes of it: (original line, mutated line, what the harness says)
MUTATIONS = {
    "float(loss) every step": (
        "step_loss = step_loss + loss.detach() / s.grad_accum",
        'step_loss = step_loss + loss.detach() / s.grad_accum; postfix["loss"] = f"{float(step_loss):.4f}"',
        r"step 1: 1 host sync\(s\) outside the loss read \(train_transforms: _local_scalar_dense\)"),
    "torch.unique on the device every step": (
        "x, y, rows = send(host_batch(train.inputs[part], labels, path_loss.sparse), device)",
        "x, y, _ = send(host_batch(train.inputs[part], labels, False), device); "
        "rows = torch.unique(x) if path_loss.sparse else None",
        r"host sync \(_unique2\) at /match/train_loop.py"),
    "AdamW without fused": (
        "optimizer = make_optimizer(params, s.lr, device)",
        "optimizer = torch.optim.AdamW(params, lr=s.lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)",
        "step 1: 0 fused AdamW launches"),
}


def mutated_loop(original: str, mutation: str):
    """train_transforms with one line of its source replaced, compiled as train_loop.py (same line numbers)."""
    lines, first = inspect.getsourcelines(train_loop.train_transforms)
    source = textwrap.dedent("".join(lines))
    assert source.count(original) == 1, f"the loop no longer has the line {original!r}: update MUTATIONS"
    namespace = dict(vars(train_loop))
    exec(compile("\n" * (first - 1) + source.replace(original, mutation), train_loop.__file__, "exec"), namespace)
    return namespace["train_transforms"]


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_the_harness_catches_a_mutated_loop(pair, name, monkeypatch):
    original, mutation, message = MUTATIONS[name]
    monkeypatch.setattr(train_loop, "train_transforms", mutated_loop(original, mutation))
    with pytest.raises(CudaRuleViolation, match=message):
        run_loop(path_loss(pair, "dual", False, "bf16"), pair[2], method="dual")


@pytest.mark.parametrize("layered", [False, True], ids=["whole", "layered"])
def test_run_backward_gives_the_autograd_engines_gradients(pair, layered):
    """The harness's backward (each node's own backward, in dependency order, checkpoints recomputed once) on real
    CPU tensors: the gradients of loss.backward()."""
    loss_of = path_loss(pair, "dual", layered, "fp32")
    inputs = pair[2].inputs[:4]
    params = [p for p in loss_of.parameters() if p.requires_grad]
    loss_of(inputs, None, 0.3).backward()
    expected = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    run_backward(loss_of(inputs, None, 0.3))
    assert any(g.abs().max() > 0 for g in expected)
    for p, grad in zip(params, expected):
        torch.testing.assert_close(p.grad, grad)


@pytest.mark.parametrize("precision", ["bf16", "auto"])
def test_bf16_support_is_asked_of_the_chosen_gpu(precision, monkeypatch):
    """A machine whose cuda:0 (the current device) runs bf16 and whose cuda:1 does not: learning on cuda:1 in bf16
    is refused (auto: fp32), on cuda:0 it runs in bf16."""
    from hf_rebasin.errors import OptionError
    from hf_rebasin.match.learned import autocast_dtype
    from hf_rebasin.options import MergeOptions
    current = [0]

    class Selected:  # torch.cuda.device: makes its device the current one while it is entered
        def __init__(self, device):
            self.index, self.before = torch.device(device).index, None

        def __enter__(self):
            self.before, current[0] = current[0], self.index

        def __exit__(self, *exc):
            current[0] = self.before

    monkeypatch.setattr(torch.cuda, "device", Selected)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: current[0] == 0)
    options = MergeOptions(learn_precision=precision)
    assert autocast_dtype(options, torch.device("cuda:0")) == torch.bfloat16
    if precision == "bf16":
        with pytest.raises(OptionError, match="does not support bfloat16"):
            autocast_dtype(options, torch.device("cuda:1"))
    else:
        assert autocast_dtype(options, torch.device("cuda:1")) is None
    assert current == [0]


def test_accumulation_and_an_image_classifier_under_cudas_rules(pair, tmp_path):
    """Gradient accumulation (2 micro-batches a step: 2 backward passes, still no sync outside the read, one fused
    AdamW launch), and a ViT classifier (its labels are the second host-to-device copy)."""
    first, second = run_loop(path_loss(pair, "dual", False, "bf16"), pair[2], method="dual", batch=4, grad_accum=2)
    assert first.n_syncs == 0 and second.syncs == {("read", "_local_scalar_dense"): 3}
    assert first.host_to_device == 4 and first.bf16["backward"] > 0  # 2 micro-batches
    template = models.load(tiny.make_tiny("vit", tmp_path / "a", seed=1))
    b = models.load(tiny.make_tiny("vit", tmp_path / "b", seed=2))
    graphs = [models.canonicalise(template).materialise(), models.canonicalise(b).materialise()]
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(16, *template.model.default_cfg["input_size"], generator=gen)
    train = EvalData(template.task, images, torch.randint(0, template.spec.n_out, (16,), generator=gen), {})
    loss = _path_loss(template, graphs, "dual", False, torch.bfloat16, "absorbed")
    first, second = run_loop(loss, train, method="dual")
    assert first.n_syncs == 0 and first.fused_adamw == 1 and first.host_to_device == 2
    assert first.bf16["forward"] > 0 and first.bf16["backward"] > 0
