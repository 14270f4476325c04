"""Weight matching against model size: two random-init GPT-NeoX models with the exact Pythia configs.

    .venv/bin/python benchmarks/wm_size.py [--configs 14m,70m,160m,410m,1b] [--rounds 2]

Each config runs in its own subprocess so that its peak RSS is its own.  Prints a Markdown table
(wall time of canonicalise / match / apply, time per round, peak RSS) for BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

# the published Pythia configs (EleutherAI/pythia-*/config.json): hidden, layers, heads, FFN
PYTHIA = {
    "14m": (128, 6, 4, 512),
    "70m": (512, 6, 8, 2048),
    "160m": (768, 12, 12, 3072),
    "410m": (1024, 24, 16, 4096),
    "1b": (2048, 16, 8, 8192),
}


def pythia_config(name: str):
    from transformers import GPTNeoXConfig
    hidden, layers, heads, ffn = PYTHIA[name]
    return GPTNeoXConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         intermediate_size=ffn, vocab_size=50304, max_position_embeddings=2048,
                         rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False)


def random_graph(config, seed: int):
    """A random-init Pythia-shaped model in canonical form (weights ~ N(0, 0.02), gains ~ 1 ± 0.1)."""
    import torch
    from transformers import GPTNeoXForCausalLM
    from transformers.initialization import no_init_weights

    from hf_rebasin.adapters import get_adapter
    with no_init_weights():
        model = GPTNeoXForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 and "norm" in name and name.endswith("weight"):
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.normal_(0.0, 0.02, generator=gen)
    state = {k: v for k, v in model.state_dict().items()}
    del model
    return get_adapter("GPTNeoXForCausalLM").to_canonical(state, config)


def run_one(name: str, rounds: int) -> dict:
    import torch

    from hf_rebasin.match.weight import weight_matching
    from hf_rebasin.symmetry import apply
    config = pythia_config(name)
    start = time.perf_counter()
    a, b = random_graph(config, 0), random_graph(config, 1)
    built = time.perf_counter()
    result = weight_matching(a, b, max_rounds=rounds, tol=0.0, progress=True)
    matched = time.perf_counter()
    aligned_b = apply(b, result.transform_b)
    applied = time.perf_counter()
    params = sum(v.numel() for v in a.params.values())
    del aligned_b
    return {"config": name, "params": params, "rounds": len(result.log) - 1,
            "build_canonical_s": built - start, "match_s": matched - built, "apply_s": applied - matched,
            "per_round_s": (matched - built) / max(1, len(result.log) - 1),
            "distance": [round(entry["distance"], 4) for entry in result.log],
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(PYTHIA))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.rounds)))
        return
    rows = []
    for name in args.configs.split(","):
        out = subprocess.run([sys.executable, __file__, "--one", name, "--rounds", str(args.rounds)],
                             check=True, stdout=subprocess.PIPE, text=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), file=sys.stderr)
    print("| config | params (canonical) | rounds | build+canonicalise s | match s | s/round | apply s | "
          "peak RSS GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| pythia-{r['config']} | {r['params'] / 1e6:.0f}M | {r['rounds']} | {r['build_canonical_s']:.1f} | "
              f"{r['match_s']:.1f} | {r['per_round_s']:.1f} | {r['apply_s']:.1f} | {r['peak_rss_gib']:.1f} |")


if __name__ == "__main__":
    main()
