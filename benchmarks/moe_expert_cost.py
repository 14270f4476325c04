"""Which cost recovers experts: the three expert-assignment costs of hf_rebasin/match/experts.py on disguised, noisy
copies of random MoE models.

    .venv/bin/python benchmarks/moe_expert_cost.py --experts 8 --expert-dim 32 --noise 0 0.5 1 1.5 2

For each class and seed, a random model A (hidden 64, 2 layers, `--experts` experts of `--expert-dim` units, top-2)
and a copy B: A under a random element of its group (residual rotation, heads, experts, units, GLU scales),
plus Gaussian noise of `noise` times each tensor's RMS on every tensor of B.  With `--parts experts` only the
expert part is disguised and each cost's assignment (match_experts) is run alone; with `whole`, full weight
matching (wm, the library's defaults) with each cost.  The table gives the share of (layer, expert) pairs whose
expert came back to its own (the disguise's inverse), the share of units that did, and the time of matching.  At
noise 0 every cost is expected to be exact; the noise is what separates them.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from hf_rebasin.core import experts, symmetry
from hf_rebasin.core.canonical import Graph
from hf_rebasin.match.experts import COSTS, match_experts
from hf_rebasin.match.weight import weight_matching

CLASSES = {"mixtral": ("MixtralConfig", dict(intermediate_size=None, num_local_experts=None)),
           "qwen2_moe": ("Qwen2MoeConfig", dict(moe_intermediate_size=None, num_experts=None,
                                                shared_expert_intermediate_size=48))}


def model_graph(name: str, n_experts: int, expert_dim: int, seed: int) -> Graph:
    import transformers

    from hf_rebasin import tiny
    from hf_rebasin.adapters import get_adapter
    config_name, fields = CLASSES[name]
    args = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=97,
                max_position_embeddings=64, num_experts_per_tok=2, tie_word_embeddings=False)
    for key, value in fields.items():
        args[key] = value if value is not None else (n_experts if "experts" in key else expert_dim)
    config = getattr(transformers, config_name)(**args)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    tiny.randomise_(model, seed)
    adapter = get_adapter(type(model).__name__)
    return adapter.to_canonical(model.state_dict(), config)


def disguised(graph: Graph, noise: float, seed: int, whole: bool) -> tuple[Graph, symmetry.Transform]:
    """graph under a random element (whole: of the whole group; else its expert part alone) plus noise."""
    t = symmetry.random_transform(graph.spec, seed=seed, scale=1.0)
    if not whole:
        drawn, t = t, symmetry.Transform.identity(graph.spec)
        for name in experts.FIELDS:
            setattr(t, name, getattr(drawn, name))
    moved = symmetry.apply(graph, t)
    gen = torch.Generator().manual_seed(seed + 1)
    params = {k: v + noise * v.pow(2).mean().sqrt() * torch.randn(v.shape, generator=gen)
              for k, v in moved.params.items()}
    return moved.replace(params), t


def recovered(t_disguise, t_found, spec) -> tuple[float, float]:
    """(share of experts, share of units) that the found element maps back to their own."""
    e, f = spec.n_experts, spec.expert_dim
    hit_e = hit_u = 0
    for i in range(spec.n_layers):
        there = experts.flat_perm(t_disguise.expert_perm[i], t_disguise.expert_unit_perm[i], e, f)
        back = experts.flat_perm(t_found.expert_perm[i], t_found.expert_unit_perm[i], e, f)
        composed = there[back]  # identity where recovered
        hit_u += int((composed == torch.arange(e * f)).sum())
        hit_e += int((composed.reshape(e, f)[:, 0] // f == torch.arange(e)).sum())
    return hit_e / (e * spec.n_layers), hit_u / (e * f * spec.n_layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--expert-dim", type=int, default=32)
    parser.add_argument("--noise", type=float, nargs="+", default=[0.0, 0.5, 1.0, 1.5, 2.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--classes", nargs="+", default=list(CLASSES))
    parser.add_argument("--parts", nargs="+", default=["experts", "whole"], choices=("experts", "whole"),
                        help="experts: only the expert part disguised, the costs alone (match_experts); whole: the "
                             "whole group disguised, full weight matching with each cost")
    args = parser.parse_args()
    rows = []
    for name in args.classes:
        for seed in args.seeds:
            a = model_graph(name, args.experts, args.expert_dim, seed)
            for part, noise in ((part, noise) for part in args.parts for noise in args.noise):
                b, t = disguised(a, noise, seed + 100, whole=part == "whole")
                for cost in COSTS:
                    start = time.perf_counter()
                    if part == "whole":
                        found = weight_matching(a, b, progress=False, expert_cost=cost).transforms[1]
                    else:
                        found = symmetry.Transform.identity(a.spec)
                        for i in range(a.spec.n_layers):
                            found.expert_perm[i], found.expert_unit_perm[i] = match_experts(
                                a.layer(i), b.layer(i), i, a.spec, cost)
                    seconds = time.perf_counter() - start
                    share_e, share_u = recovered(t, found, a.spec)
                    rows.append(dict(cls=name, part=part, seed=seed, noise=noise, cost=cost, experts=share_e,
                                     units=share_u, seconds=seconds))
                    print(json.dumps(rows[-1]), flush=True)
    print("\n| class | disguise | noise | cost | experts recovered | units recovered | seconds |\n"
          "|---|---|---|---|---|---|---|")
    for name in args.classes:
        for part in args.parts:
            for noise in args.noise:
                for cost in COSTS:
                    sel = [r for r in rows if (r["cls"], r["part"], r["noise"], r["cost"]) == (name, part, noise, cost)]
                    means = {k: sum(r[k] for r in sel) / len(sel) for k in ("experts", "units", "seconds")}
                    print(f"| {name} | {part} | {noise:g} | {cost} | {means['experts']:.3f} | {means['units']:.3f} | "
                          f"{means['seconds']:.2f} |")


if __name__ == "__main__":
    main()
