"""The cost of one weight-matching layer at a published Pythia size, without building the whole model:

    .venv/bin/python benchmarks/wm_layer.py --config 1b [--layers 2] [--solver scipy|lapjv]

Writes a random-init GPT-NeoX checkpoint pair with the config's exact layer shapes (hidden, heads, FFN) but
only --layers layers and a 1024-token vocabulary (fp16, as the Hub's), runs one round of weight matching on
it through the library (streamed from the files, as a merge does) under cProfile, and prints the seconds per
layer with the functions that took them, and the peak memory of the process.  The per-layer cost times the
real layer count is the cost of a round of the real model (the embeddings add one d x d product per
vocabulary row: small next to a layer).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from merge_size import PYTHIA, config_of, random_tensors  # noqa: E402

from hf_rebasin.export.io import ShardWriter  # noqa: E402


def write_pair(name: str, layers: int, folder: Path) -> list[Path]:
    config = config_of(name)
    config.num_hidden_layers, config.vocab_size = layers, 1024
    paths = []
    for seed in (0, 1):
        path = folder / f"model-{seed}"
        path.mkdir()
        with ShardWriter(path, "model", 5 * 10**9) as writer:
            for key, tensor in random_tensors(config, seed):
                writer.add(key, tensor)
        config.save_pretrained(path)
        paths.append(path)
    return paths


def peak_anon() -> int:
    """Peak RSS of this process (the layer-only checkpoints are small: nearly all of it is anonymous memory)."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="1b", choices=list(PYTHIA))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--solver", choices=("auto", "scipy", "lapjv"), default="auto",
                        help="the linear-assignment solver (auto: lapjv when installed)")
    parser.add_argument("--top", type=int, default=14, help="functions to list")
    args = parser.parse_args()
    from hf_rebasin.match import linalg
    from hf_rebasin.match.weight import weight_matching
    from hf_rebasin.sources import models
    if args.solver != "auto":
        linalg.SOLVER = args.solver
    with tempfile.TemporaryDirectory(dir=REPO / "runs" if (REPO / "runs").is_dir() else None) as folder:
        a, b = write_pair(args.config, args.layers, Path(folder))
        graphs = [models.canonicalise(models.load(p)) for p in (a, b)]
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        alignment = weight_matching(*graphs, max_rounds=1, tol=0.0, progress=False)
        profile.disable()
        seconds = time.perf_counter() - start
    hidden, _, heads, ffn, _ = PYTHIA[args.config]
    layers = PYTHIA[args.config][1]
    round_s = alignment.log[-1]["seconds"]
    print(f"pythia-{args.config} layer shapes (d={hidden}, heads={heads}, FFN={ffn}), {args.layers} layers, "
          f"solver {linalg.SOLVER}: round {round_s:.1f} s = {round_s / args.layers:.1f} s per layer "
          f"(whole call {seconds:.1f} s); a round of the real {layers}-layer model ~ "
          f"{round_s / args.layers * layers / 60:.1f} min; peak anonymous memory {peak_anon() / 2**30:.2f} GiB")
    stats = pstats.Stats(profile)
    stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
