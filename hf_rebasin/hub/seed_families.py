"""The seed families on the Hub: models of one architecture and one training recipe that differ only in their random
seed (initialisation and/or data order), the cleanest independently trained pairs to merge.  The ids are data, kept
here and only here (the bundled recipes name the first two of their family, tests/test_recipes.py checks it; any other
two by ``hf-rebasin run RECIPE --set "models=[ID, ID]"``), so a misspelt id is corrected in one place.

* MultiBERTs (Sellam et al., ICLR 2022): 25 BERT-base checkpoints, seeds 0-24 (``BertForPreTraining``).
* Stanford CRFM's Mistral GPT-2 runs (2021): GPT-2 small and medium trained five times on OpenWebText, seeds 21, 49,
  81, 343, 777; trained with ``scale_attn_by_inverse_layer_idx`` and ``reorder_and_upcast_attn`` (both exact in
  hf-rebasin: a per-layer scalar on q·k, which every QK map leaves alone, and the same attention computed in fp32).
* PolyPythias (van der Wal et al., ICLR 2025): Pythia-160M with only the data-order seed changed (``data-seed``) or
  only the initialisation seed (``weight-seed``), three of each."""
from __future__ import annotations

SEED_FAMILIES: dict[str, tuple[str, ...]] = {
    "multiberts": tuple(f"google/multiberts-seed_{seed}" for seed in range(25)),
    "crfm-gpt2-small": tuple(f"stanford-crfm/{name}-gpt2-small-x{seed}" for name, seed in (
        ("alias", 21), ("battlestar", 49), ("caprica", 81), ("darkmatter", 343), ("expanse", 777))),
    "crfm-gpt2-medium": tuple(f"stanford-crfm/{name}-gpt2-medium-x{seed}" for name, seed in (
        ("arwen", 21), ("beren", 49), ("celebrimbor", 81), ("durin", 343), ("eowyn", 777))),
    "polypythia-160m-data-seed": tuple(f"EleutherAI/pythia-160m-data-seed{seed}" for seed in (1, 2, 3)),
    "polypythia-160m-weight-seed": tuple(f"EleutherAI/pythia-160m-weight-seed{seed}" for seed in (1, 2, 3)),
}
