"""The loss computed layer by layer (--gradient-checkpointing, --fsdp; match/layered.py): the same loss and
gradients as the whole-state-dict PathLoss for every adapter variant, precision and kind of run (dual through
t_a^-1 t_b, dual with permutations on A, lm, three models); every layer's weights recomputed in the backward
under checkpointing, with less kept for the backward; the same learned transforms from `learn`.  FSDP over two
processes is in tests/test_learned.py (test_two_processes_follow_one)."""
from __future__ import annotations

import pytest
import torch

from hf_rebasin import tiny
from hf_rebasin.core import symmetry
from hf_rebasin.match import Alignment
from hf_rebasin.match.layered import LayeredPathLoss, LayerPoint
from hf_rebasin.match.learned import PathLoss, learn
from hf_rebasin.match.params import SymmetryParams
from hf_rebasin.options import MergeOptions
from hf_rebasin.sources import models
from hf_rebasin.sources.eval_data import EvalData

KINDS = tiny.kinds()
# the two paths run the same operations on the same tensors, layer by layer instead of all at once: their
# losses and gradients agree to fp32 rounding (measured: bit-identical on every variant)
RELATIVE = 1e-6


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """kind -> (template, [three canonical graphs of different seeds])."""
    root = tmp_path_factory.mktemp("layered")
    out = {}
    for kind in KINDS:
        loaded = [models.load(tiny.make_tiny(kind, root / f"{kind}-{seed}", seed=seed)) for seed in (1, 5, 9)]
        out[kind] = loaded[0], [models.canonicalise(m).materialise() for m in loaded]
    return out


def ends_for(mode: str, spec) -> dict[str, SymmetryParams]:
    """Random learnable group elements: 'dual' (A without permutations: the relative shortcut), 'dual-perm'
    (A with permutations), 'lm' (B only), 'three' (three models)."""
    def element(seed, permutations=True):
        t = symmetry.random_transform(spec, seed=seed)
        if not permutations:
            t.head_perm, t.ffn_perm = [None] * spec.n_layers, [None] * spec.n_layers
            t.expert_perm, t.expert_unit_perm = [None] * spec.n_layers, [None] * spec.n_layers
        return SymmetryParams(spec, t)
    if mode == "lm":
        return {"1": element(3)}
    ends = {"0": element(4, permutations=mode != "dual"), "1": element(3)}
    if mode == "three":
        ends["2"] = element(7)
    return ends


def loss_and_gradients(path_loss, x, y, lam):
    loss = path_loss(x, y, lam)
    loss.backward()
    grads = {name: torch.zeros_like(p) if p.grad is None else p.grad.clone()  # unused: e.g. a scale ViT fixes
             for name, p in path_loss.named_parameters() if p.requires_grad}
    return float(loss.detach()), grads


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["dual", "dual-perm", "lm", "three"])
@pytest.mark.parametrize("kind", KINDS)
def test_layered_loss_and_gradients_equal_the_whole_state_dict(kind, mode, precision, graphs):
    template, all_graphs = graphs[kind]
    chosen = all_graphs if mode == "three" else all_graphs[:2]
    dtype = torch.bfloat16 if precision == "bf16" else None
    x = tiny.example_inputs(kind, seed=4)
    y = tiny.example_labels(template.task, x, 10, torch.Generator().manual_seed(0))
    lam = (0.2, 0.5, 0.3) if mode == "three" else 0.3
    whole = PathLoss(chosen, ends_for(mode, chosen[0].spec), template, template.task, dtype)
    layered = LayeredPathLoss(chosen, ends_for(mode, chosen[0].spec), template, template.task, dtype)
    checkpointed = LayeredPathLoss(chosen, ends_for(mode, chosen[0].spec), template, template.task, dtype,
                                   checkpointing=True)
    assert layered.relative == whole.relative == (mode == "dual")
    assert len(layered.layers) == chosen[0].spec.n_layers
    assert all(isinstance(layer, LayerPoint) for layer in layered.layers)
    if dtype is not None:
        stored = [p for p in layered.parameters() if not p.requires_grad]
        assert stored and {p.dtype for p in stored} == {torch.bfloat16}
    loss, grads = loss_and_gradients(whole, x, y, lam)
    for other in (layered, checkpointed):
        other_loss, other_grads = loss_and_gradients(other, x, y, lam)
        assert abs(other_loss - loss) <= RELATIVE * abs(loss)
        assert other_grads.keys() == grads.keys() and grads
        scale = max(float(g.abs().max()) for g in grads.values())
        assert scale > 0
        for name, g in grads.items():
            assert float((other_grads[name] - g).abs().max()) <= RELATIVE * scale, name
    # the learned state is the symmetry parameters alone, under the same names as PathLoss's
    assert layered.learned_state().keys() == whole.state_dict().keys()


def test_checkpointing_recomputes_every_layer_and_keeps_less_for_the_backward(graphs):
    template, (a, b, _) = graphs["llama_gqa_tied"]
    x = tiny.example_inputs("llama_gqa_tied", seed=4)
    counts, kept = {}, {}
    original = LayerPoint.state

    def counted(self):
        counts[self.owner.checkpointing] = counts.get(self.owner.checkpointing, 0) + 1
        return original(self)

    for checkpointing in (False, True):
        path_loss = LayeredPathLoss([a, b], ends_for("dual", a.spec), template, template.task,
                                    checkpointing=checkpointing)
        saved = []

        def pack(tensor, saved=saved):
            saved.append(tensor.numel() * tensor.element_size())
            return tensor

        LayerPoint.state = counted
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = path_loss(x, None, 0.5)
            kept[checkpointing] = sum(saved)
            loss.backward()
        finally:
            LayerPoint.state = original
    n = a.spec.n_layers
    assert counts == {False: n, True: 2 * n}  # computed once in the forward; once more in the backward
    assert kept[True] < 0.5 * kept[False]


def test_learn_with_checkpointing_returns_the_same_transforms(graphs, tmp_path):
    template, (a, b, _) = graphs["gpt_neox"]
    data = EvalData("causal-lm", torch.randint(0, 97, (48, 16), generator=torch.Generator().manual_seed(0)))
    start = Alignment([symmetry.Transform.identity(a.spec)] * 2)
    results = {}
    for checkpointing in (False, True):
        options = MergeOptions(method="dual", steps=4, lr=0.05, learn_batch_size=8, eval_every=2, holdout=0,
                               device="cpu", gradient_checkpointing=checkpointing,
                               checkpoint_dir=str(tmp_path / f"ckpt-{checkpointing}"))
        results[checkpointing] = learn([a, b], start, template, data, data, options, progress=False)
    plain, layered = results[False], results[True]
    assert layered.settings["learned"]["gradient_checkpointing"] is True
    storage = layered.settings["endpoint_storage"]
    whole = plain.settings["endpoint_storage"]["bytes_total"]
    assert storage["bytes_per_process"] == storage["bytes_total"] == whole > 0
    for one, other in zip(plain.transforms, layered.transforms):
        for key, value in one.to_tensors().items():
            assert torch.allclose(other.to_tensors()[key], value, rtol=0, atol=1e-6), key
    assert float((plain.transform_b.rotation - torch.eye(a.spec.d_model)).abs().max()) > 1e-3  # it learned
