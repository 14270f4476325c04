"""The training budget of the bundled >= 1B dual recipes, from the exact published Pythia configs (no Hub needed):

    .venv/bin/python benchmarks/recipe_budgets.py

For each recipe: its steps, batch and window length and launch.num_processes as written, the parameter count and
residual width of the published config (a model built on the meta device), and what hf_rebasin/hub/budget.py makes of
them: training tokens, flop (a third more with gradient checkpointing) and GPU hours (an estimate from arithmetic
at an assumed utilisation, not a measurement).
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from merge_size import config_of  # noqa: E402

from hf_rebasin.hub import recipes  # noqa: E402
from hf_rebasin.hub.budget import ASSUMED_UTILISATION, REFERENCE_GPU, REFERENCE_TFLOPS, training_budget  # noqa: E402


def main() -> None:
    print("| recipe | params | d | steps × batch × seq | processes | checkpointing | training tokens | flop | "
          f"GPU-hours "
          f"({REFERENCE_GPU}, {ASSUMED_UTILISATION:.0%} of {REFERENCE_TFLOPS} TFLOPS) | wall hours |")
    print("|" + "---|" * 10)
    for size in ("1b", "1.4b", "2.8b", "6.9b"):
        recipe = recipes.load_recipe(f"pythia-{size}", check_paths=False)
        options = recipes.step_options(recipe.fields, "merge")
        with tempfile.TemporaryDirectory() as folder:
            config_of(size).save_pretrained(folder)
            b = training_budget(folder, options.steps, options.learn_batch_size, options.seq_len,
                                recipes.num_processes(recipe.fields), options.gradient_checkpointing)
        print(f"| pythia-{size} | {b.params / 1e9:.2f}B | {b.d_model} | {b.steps:,} × {b.batch} × {b.seq_len} | "
              f"{b.processes} | {'yes' if b.checkpointing else 'no'} | {b.tokens / 1e6:.0f}M | {b.flops:.2e} | "
              f"{b.gpu_hours:.1f} | "
              f"{b.gpu_hours / b.processes:.1f} |")


if __name__ == "__main__":
    main()
