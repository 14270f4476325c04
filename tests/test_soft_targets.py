"""--soft-targets: the path loss's target mixed with the endpoints' own prediction (match/path.py,
PathOfEnds.forward), checked against the loaded endpoints and the exported interpolated model, which know nothing
of the symmetry parameters; the same loss and gradients layer by layer; the held-out estimates stay on the truth."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_rebasin import tiny
from hf_rebasin.core import symmetry
from hf_rebasin.core.canonical import interpolate
from hf_rebasin.core.symmetry import apply
from hf_rebasin.match.layered import LayeredPathLoss
from hf_rebasin.match.learned import PathLoss
from hf_rebasin.match.params import SymmetryParams
from hf_rebasin.sources import models

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# the path loss and the reference run the same model on the same inputs, the symmetry's action (fp32 products with
# random rotations and maps) in between: they agree to fp32 rounding
TOLERANCE = 1e-5
RELATIVE = 1e-6  # whole state dict against layer by layer: the same operations (tests/test_layered.py)


def predictions(model, x, task):
    """Logits of the next tokens but the last (LMs) or of the labels, from an ordinary model."""
    with torch.no_grad():
        return model(x).logits[:, :-1] if task == "causal-lm" else model(x)


def reference_loss(a, b, t_a, t_b, template, loaded, x, labels, lam, share):
    """(1 - share) x CE(point, truth) + share x CE(point, (1-λ) softmax(A) + λ softmax(B)), from the loaded endpoints
    and the exported point."""
    task = template.task
    point = models.instantiate(interpolate([apply(a, t_a), apply(b, t_b)], [1 - lam, lam]), template)
    log_p = predictions(point, x, task).float().log_softmax(-1)
    target = sum(w * predictions(m, x, task).float().softmax(-1) for w, m in zip((1 - lam, lam), loaded))
    truth = x[:, 1:] if task == "causal-lm" else labels
    hard = F.nll_loss(log_p.reshape(-1, log_p.shape[-1]), truth.reshape(-1))
    return float((1 - share) * hard + share * -(target * log_p).sum(-1).mean())


@pytest.mark.parametrize("kind", ["gpt_neox", "llama_gqa_tied", "vit"])
@pytest.mark.parametrize("share", [0.0, 0.4, 1.0])
def test_the_trained_loss_is_the_exported_points_against_the_endpoints_prediction(kind, share, tmp_path):
    dirs = [tiny.make_tiny(kind, tmp_path / name, seed=seed) for name, seed in (("a", 1), ("b", 5))]
    loaded = [models.load(d) for d in dirs]
    a, b = (models.canonicalise(m).materialise() for m in loaded)
    ends = {"0": SymmetryParams(a.spec, symmetry.random_transform(a.spec, seed=3)),
            "1": SymmetryParams(b.spec, symmetry.random_transform(b.spec, seed=4))}
    path = PathLoss([a, b], ends, loaded[0], loaded[0].task)
    path.soft_targets = share
    x = tiny.example_inputs(kind, seed=2)
    labels = torch.randint(0, 10, (len(x),), generator=torch.Generator().manual_seed(0))
    y = None if loaded[0].task == "causal-lm" else labels
    for lam in (0.0, 0.35):
        loss = path(x, y, lam)  # gradients on: the target is mixed in
        assert loss.requires_grad
        expected = reference_loss(a, b, ends["0"].export(), ends["1"].export(), loaded[0],
                                  [m.model for m in loaded], x, labels, lam, share)
        assert float(loss.detach()) == pytest.approx(expected, abs=TOLERANCE)
    if share:
        with torch.no_grad():  # the held-out estimates and the selection: the truth alone
            assert float(path(x, y, 0.35)) == pytest.approx(reference_loss(
                a, b, ends["0"].export(), ends["1"].export(), loaded[0], [m.model for m in loaded], x, labels, 0.35,
                0.0), abs=TOLERANCE)


def test_at_an_endpoint_the_soft_target_is_its_own_entropy(tmp_path):
    """λ = 0 with share 1: the loss is the mean entropy of model A's next-token distribution, whatever B."""
    loaded = [models.load(tiny.make_tiny("gpt_neox", tmp_path / n, seed=seed)) for n, seed in (("a", 1), ("b", 5))]
    a, b = (models.canonicalise(m).materialise() for m in loaded)
    path = PathLoss([a, b], {"1": SymmetryParams(b.spec, symmetry.random_transform(b.spec, seed=4))}, loaded[0],
                    "causal-lm")
    path.soft_targets = 1.0
    x = tiny.example_inputs("gpt_neox", seed=2)
    p = predictions(loaded[0].model, x, "causal-lm").float().softmax(-1)
    entropy = float(-(p * p.log()).sum(-1).mean())
    assert float(path(x, None, 0.0).detach()) == pytest.approx(entropy, abs=TOLERANCE)


@pytest.mark.parametrize("kind", ["gpt_neox", "olmo2_gqa", "vit"])
def test_layer_by_layer_gives_the_same_soft_loss_and_gradients(kind, tmp_path):
    loaded = [models.load(tiny.make_tiny(kind, tmp_path / f"m{seed}", seed=seed)) for seed in (1, 5)]
    graphs = [models.canonicalise(m).materialise() for m in loaded]

    def ends():
        return {str(k): SymmetryParams(g.spec, symmetry.random_transform(g.spec, seed=3 + k))
                for k, g in enumerate(graphs)}
    x = tiny.example_inputs(kind, seed=2)
    y = None if loaded[0].task == "causal-lm" else torch.randint(0, 10, (len(x),))
    results = []
    for path in (PathLoss(graphs, ends(), loaded[0], loaded[0].task),
                 LayeredPathLoss(graphs, ends(), loaded[0], loaded[0].task),
                 LayeredPathLoss(graphs, ends(), loaded[0], loaded[0].task, checkpointing=True)):
        path.soft_targets = 0.7
        loss = path(x, y, 0.3)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in path.named_parameters() if p.grad is not None}
        results.append((float(loss.detach()), grads))
    (loss, grads), others = results[0], results[1:]
    scale = max(float(g.abs().max()) for g in grads.values())
    assert grads and scale > 0
    for other_loss, other_grads in others:
        assert abs(other_loss - loss) <= RELATIVE * abs(loss)
        assert other_grads.keys() == grads.keys()
        for name, g in grads.items():
            assert float((other_grads[name] - g).abs().max()) <= RELATIVE * scale, name


@pytest.mark.parametrize("kind", ["gpt_neox", "llama_gqa_tied", "phi3_partial_rotary"])
def test_the_endpoints_run_batched_follow_the_same_trajectory(kind, tmp_path):
    """Endpoints stacked and run by one batched forward (PathLoss.stack_ends, what a GPU does) against one forward
    each (the CPU's): four AdamW steps from the same start give the same losses and elements to fp32 rounding."""
    loaded = [models.load(tiny.make_tiny(kind, tmp_path / f"m{seed}", seed=seed)) for seed in (1, 5)]
    graphs = [models.canonicalise(m).materialise() for m in loaded]
    x = tiny.example_inputs(kind, seed=2)
    y = None if loaded[0].task == "causal-lm" else torch.randint(0, 10, (len(x),))
    runs = []
    for batched in (False, True):
        ends = {str(k): SymmetryParams(g.spec, symmetry.random_transform(g.spec, seed=3 + k))
                for k, g in enumerate(graphs)}
        path = PathLoss(graphs, ends, loaded[0], loaded[0].task)
        path.soft_targets = 1.0
        if batched:
            path.stack_ends()
            assert path.stacks is not None
        optimizer = torch.optim.AdamW([p for p in path.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for lam in (0.3, 0.6, 0.45, 0.8):
            loss = path(x, y, lam)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
        runs.append((losses, {k: v.clone() for k, v in path.learned_state().items()}))
    (losses, state), (batched_losses, batched_state) = runs
    assert batched_losses == pytest.approx(losses, rel=RELATIVE)
    for key, value in state.items():
        assert float((batched_state[key] - value).abs().max()) <= 1e-5 * (1 + float(value.abs().max())), key


def soft_target_path(kind, tmp_path):
    loaded = [models.load(tiny.make_tiny(kind, tmp_path / f"m{seed}", seed=seed)) for seed in (1, 5)]
    graphs = [models.canonicalise(m).materialise() for m in loaded]
    ends = {str(k): SymmetryParams(g.spec, symmetry.random_transform(g.spec, seed=3 + k)) for k, g in enumerate(graphs)}
    path = PathLoss(graphs, ends, loaded[0], loaded[0].task)
    path.soft_targets = 1.0
    return path, tiny.example_inputs(kind, seed=2)


def test_a_batched_forward_that_fails_falls_back_to_one_endpoint_at_a_time(tmp_path, monkeypatch):
    """An op with no vmap batching rule (on some device or build) costs the batching, not the run: a warning, the
    same loss as one forward each, and no second try."""
    from hf_rebasin.match import learned
    path, x = soft_target_path("gpt_neox", tmp_path)
    expected = float(path(x, None, 0.4).detach())
    path.stack_ends()
    calls = []

    def no_batching_rule(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("Batching rule not implemented for aten::some_op")
    monkeypatch.setattr(learned, "batched_soft_target", no_batching_rule)
    with pytest.warns(UserWarning, match="one at a time.*Batching rule not implemented"):
        assert float(path(x, None, 0.4).detach()) == pytest.approx(expected, rel=RELATIVE)
    assert float(path(x, None, 0.4).detach()) == pytest.approx(expected, rel=RELATIVE)
    assert len(calls) == 1 and path.stacks is None


def test_experts_are_never_run_batched(tmp_path, monkeypatch):
    """A mixture of experts runs its endpoints one at a time even when stacked (its expert kernels, chosen by the
    device, are unchecked under vmap on a GPU), and the batched forward, where it is asked for on the CPU, gives the
    same target."""
    from hf_rebasin.match import learned
    path, x = soft_target_path("mixtral_moe", tmp_path)
    expected = float(path(x, None, 0.4).detach())
    path.stack_ends()

    batched = learned.batched_soft_target(path, path.stacks, path.graphs["0"], x[:, :-1], [0.6, 0.4])
    one_at_a_time = super(PathLoss, path).soft_target(x[:, :-1], [0.6, 0.4], None)
    assert float((batched - one_at_a_time).abs().max()) <= TOLERANCE

    def never(*args, **kwargs):
        raise AssertionError("the experts' endpoints were run batched")
    monkeypatch.setattr(learned, "batched_soft_target", never)
    assert float(path(x, None, 0.4).detach()) == pytest.approx(expected, rel=RELATIVE)
