"""Matching methods, in one registry: each has one spec (name, function, description, whether it needs
data, whether it is learned, whether it merges more than two models).  A method takes the canonical
graphs of the N models and a MatchContext and returns an Alignment: one group element per model."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .alignment import Alignment, MatchContext

if TYPE_CHECKING:  # torch is imported when a method runs, not when the registry is read (--help)
    from ..core.canonical import Graph


@dataclass(frozen=True)
class Method:
    name: str
    run: Callable[[list[Graph], MatchContext], Alignment]
    description: str
    needs_data: bool = False  # activation or training data (beyond the evaluation data)
    learned: bool = False  # trains symmetry parameters (accelerate, checkpoints, --steps ...)
    n_way: bool = False  # works for more than two models


METHODS: dict[str, Method] = {}


def register_method(method: Method) -> Method:
    METHODS[method.name] = method
    return method


def raw(graphs: list[Graph], context: MatchContext) -> Alignment:
    """No alignment: the plain average of the checkpoints."""
    from ..core.symmetry import Transform
    return Alignment([Transform.identity(g.spec) for g in graphs])


def wm(graphs: list[Graph], context: MatchContext) -> Alignment:
    from .multi import align_many
    from .weight import weight_matching
    if len(graphs) == 2:
        return weight_matching(*graphs, max_rounds=context.options.rounds, progress=context.progress)
    return align_many(graphs, max_rounds=context.options.rounds, progress=context.progress)


def wm_perm(graphs: list[Graph], context: MatchContext) -> Alignment:
    from .weight import weight_matching
    return weight_matching(*graphs, residual="permutation", head_maps=False, max_rounds=context.options.rounds,
                           progress=context.progress)


def am(graphs: list[Graph], context: MatchContext, residual: str = "full", data=None) -> Alignment:
    from .activation import activation_matching
    return activation_matching(*graphs, data=context.match_data if data is None else data, template=context.template,
                               batches=context.options.am_batches, batch_size=context.options.batch_size,
                               residual=residual, progress=context.progress)


def am_perm(graphs: list[Graph], context: MatchContext) -> Alignment:
    return am(graphs, context, residual="permutation")


def am_on_training_data(graphs: list[Graph], context: MatchContext) -> Alignment:
    """Activation matching on --am-batches batches of windows spread evenly over the training data."""
    from .activation import evenly_spread
    options = context.options
    return am(graphs, context, data=evenly_spread(context.train_data, options.am_batches * options.batch_size))


def learned(graphs: list[Graph], context: MatchContext) -> Alignment:
    from .learned import learn, on_main_process
    first = am_on_training_data if context.options.start == "am" else wm  # (N models: refused by the options)
    start = on_main_process(lambda: first(graphs, context), context.options)  # once; the other processes receive it
    return learn(graphs, start, context.template, context.train_data, context.eval_data, context.options,
                 progress=context.progress)


for _method in (
    Method("raw", raw, "no alignment (plain weight average)", n_way=True),
    Method("wm", wm, "data-free weight matching over the full group: residual rotation, head permutations, per-head "
                     "QK/OV maps, FFN permutations, GLU scales", n_way=True),
    Method("wm-perm", wm_perm, "permutations only, residual stream treated as a permutation (Git Re-Basin ablation)"),
    Method("am", am, "activation matching over the full group, closed form: residual rotation (Procrustes), head and "
                     "FFN permutations from activations on a few batches; per-head maps and GLU scales as wm's",
           needs_data=True),
    Method("am-perm", am_perm, "activation matching restricted to permutations, residual stream included (Verma & "
                               "Elbayad's baseline)", needs_data=True),
    Method("lm", learned, "learned matching (Theus et al.): the continuous symmetries of B (of every model but the "
                          "first, for N models) trained on the path loss, started from weight matching",
           needs_data=True, learned=True, n_way=True),
    Method("dual", learned, "dual learned matching (LMC-DM, Li & Shen): every model's symmetries trained on the path "
                            "loss, started from weight matching (absorbed init)",
           needs_data=True, learned=True, n_way=True),
):
    register_method(_method)

__all__ = ["Alignment", "METHODS", "MatchContext", "Method", "register_method"]
