"""Ablations of weight matching on the benchmark pairs: which part of the group and which tensors matter.

    .venv/bin/python benchmarks/wm_ablation.py --pairs neox-shakespeare,gpt2-shakespeare,vit-digits \
        [--variants wm,perm,no-head-maps,1-round,no-positions,tokens-seen,tokens-log,tokens-sqrt] [--json FILE]

Each variant runs weight matching differently, then the transforms it found are applied to the real models
and the test-split barrier is measured exactly as in barrier_table.py (the pipeline's `wm` method, with the
matching function swapped):

* wm            the library's weight matching (full group, plain Frobenius overlaps, up to 10 rounds);
* perm          the residual stream as a permutation and no per-head maps (= --method wm-perm);
* no-head-maps  the residual rotation and the permutations, but no per-head QK/OV maps;
* 1-round       one round instead of up to ten;
* no-positions  the position embedding and class/register tokens left out of the residual Procrustes (what
                the rotation sees of a ViT is then the patch embedding and the layers; GPT-2: no wpe);
* tokens-KIND   the token rows of the embedding and unembedding weighted by how often the token occurs in the
                training text (Theus et al.; rows of tokens never seen are initialisation noise): every row is
                scaled by sqrt(w_t), so the Procrustes weighs its overlap by w_t, with w normalised to mean 1 over
                the seen tokens: seen (1 if seen, else 0), log (log(1 + count)), sqrt (sqrt(count)).
                Language-model pairs only.
* fit-g         wm, then the residual scale g of B (which wm leaves at 1) fitted in closed form: the g that
                minimises sum ||A_w - g B'_w||^2 over the residual-writing tensors of the aligned models
                (g = <A_w, B'_w> / ||B'_w||^2).  Only where g is exact (not the ViT: timm fixes the norm eps).
* norm-g        the same, with g matching the magnitudes instead: g = ||A_w|| / ||B'_w||.

Prints one line per (pair, variant) and a Markdown table (barrier, and as % of the raw barrier).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from hf_rebasin.core.canonical import LazyGraph  # noqa: E402
from hf_rebasin.match import weight  # noqa: E402

VARIANTS = ("wm", "perm", "no-head-maps", "1-round", "no-positions", "tokens-seen", "tokens-log", "tokens-sqrt",
            "fit-g", "norm-g")
POSITIONS = ("embed.pos", "embed.cls", "embed.reg")


def token_weights(pair: dict, kind: str) -> torch.Tensor:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(pair["model_a"])
    ids = tokenizer(Path(pair["train_data"]).read_text(), verbose=False)["input_ids"]
    counts = torch.bincount(torch.tensor(ids), minlength=len(tokenizer)).double()
    w = {"seen": (counts > 0).double(), "log": torch.log1p(counts), "sqrt": counts.sqrt()}[kind]
    return (w / w[w > 0].mean()).sqrt().float()


class Weighted(LazyGraph):
    """A view of a graph for matching only: token rows (embedding rows, unembedding columns) scaled by `rows`,
    and the tensors named in `dropped` set to zero (they then add nothing to the residual cross-products)."""

    def __init__(self, graph, rows: torch.Tensor | None = None, dropped: tuple[str, ...] = ()):
        self.graph, self.rows, self.dropped = graph, rows, dropped
        self.spec, self.norm_eps, self.meta = graph.spec, graph.norm_eps, getattr(graph, "meta", {})

    def outside(self):
        out = dict(self.graph.outside())
        for key, value in out.items():
            if key in self.dropped:
                out[key] = torch.zeros_like(value)
            elif self.rows is not None and value.dim() == 2 and value.shape[0] == len(self.rows):
                out[key] = value * self.rows[:, None]
            elif self.rows is not None and value.dim() == 2 and value.shape[1] == len(self.rows):
                out[key] = value * self.rows[None, :]
        return out

    def layer(self, i: int):
        return self.graph.layer(i)


def with_fitted_scale(match, norms: bool = False):
    """`match`, then B's residual scale set to the least-squares g between the aligned models' writes (with
    `norms`, the ratio of their norms)."""
    from hf_rebasin.core.canonical import residual_role
    from hf_rebasin.core.symmetry import apply

    def run(a, b, **kw):
        result = match(a, b, **kw)
        pa, pb = apply(a, result.transforms[0]), apply(b, result.transforms[1])
        parts = [(pa.outside(), pb.outside())] + [(pa.layer(i), pb.layer(i)) for i in range(a.spec.n_layers)]
        writes = [(x[k].double(), y[k].double()) for x, y in parts for k in x if residual_role(k) == "write"]
        num, den = sum(float((x * y).sum()) for x, y in writes), sum(float(y.square().sum()) for _, y in writes)
        g = (sum(float(x.square().sum()) for x, _ in writes) / den) ** 0.5 if norms else num / den
        result.transforms[1].scale = float(result.transforms[1].scale) * g
        result.settings["fitted_g"] = g
        return result
    return run


def matcher(variant: str, pair: dict):
    """The weight-matching function of a variant (same signature as weight.weight_matching)."""
    plain = weight.weight_matching
    if variant == "wm":
        return plain
    if variant == "perm":
        return lambda a, b, **kw: plain(a, b, **{**kw, "residual": "permutation", "head_maps": False})
    if variant == "no-head-maps":
        return lambda a, b, **kw: plain(a, b, **{**kw, "head_maps": False})
    if variant == "1-round":
        return lambda a, b, **kw: plain(a, b, **{**kw, "max_rounds": 1})
    if variant in ("fit-g", "norm-g"):
        return with_fitted_scale(plain, norms=variant == "norm-g")
    if variant == "no-positions":
        return lambda a, b, **kw: plain(Weighted(a, dropped=POSITIONS), Weighted(b, dropped=POSITIONS), **kw)
    rows = token_weights(pair, variant.removeprefix("tokens-"))
    return lambda a, b, **kw: plain(Weighted(a, rows), Weighted(b, rows), **kw)


def main() -> None:
    import pairs
    from barrier_table import barrier_options, measure
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default="neox-shakespeare,gpt2-shakespeare,vit-digits")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--max-eval-tokens", type=int, default=65536)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    rows = []
    for name in args.pairs.split(","):
        pair = pairs.get_pair(name)
        models = [pair["model_a"], pair["model_b"]]
        raw, _ = measure(models, barrier_options(pair, "raw", None, args.max_eval_tokens, []))
        for variant in args.variants.split(","):
            if (variant.startswith("tokens-") or variant.endswith("-g")) and pair["task"] != "causal-lm":
                continue
            plain = weight.weight_matching
            weight.weight_matching = matcher(variant, pair)  # the wm method looks it up when it runs
            try:
                report, seconds = measure(models, barrier_options(pair, "wm", None, args.max_eval_tokens, []))
            finally:
                weight.weight_matching = plain
            row = {"pair": name, "variant": variant, "barrier": report["barrier"], "raw": raw["barrier"],
                   "midpoint_loss": report["loss"][report["lambdas"].index(0.5)], "seconds": seconds,
                   "fitted_g": report["settings"].get("fitted_g")}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| pair | variant | barrier | % of raw | loss at λ = 0.5 |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['pair']} | {r['variant']} | {r['barrier']:.3f} | {100 * r['barrier'] / r['raw']:.0f} % | "
              f"{r['midpoint_loss']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
