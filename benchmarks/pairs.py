"""Benchmark pairs: two models of one architecture trained from two seeds on the same real data.

    .venv/bin/python benchmarks/pairs.py gpt2-shakespeare neox-shakespeare vit-digits

trains each named pair once (fp32, CPU, deterministic) and caches it under runs/pairs/NAME/:

    model-a/, model-b/        Hub-layout checkpoints (seeds 0 and 1; LMs carry a copy of the tokenizer)
    train.*, val.*, test.*    the fixed data split (.txt for LMs, .npz with images/labels for ViTs)
    pair.json                 settings and endpoint metrics; written last, so its presence marks a complete pair

From Python: `get_pair(name)` returns the paths (training only when the cache is missing, was made with
other settings, or holds a tokenizer that transformers would load as another tokenization: tokenizer_as_loaded).
Relative cache folders are taken from the repository root, like the shared data
(../shared/data/tinyshakespeare.txt and ../shared/data/gpt2_tokenizer).
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from hf_rebasin.sources.data import read_images, read_texts, split_text, token_windows  # noqa: E402
from hf_rebasin.training import causal_lm_loss, classifier_metrics, save_lm, save_vit, train_causal_lm, train_vit  # noqa: E402

SHARED_DATA = REPO.parent / "shared" / "data"
SHAKESPEARE = SHARED_DATA / "tinyshakespeare.txt"
GPT2_TOKENIZER = SHARED_DATA / "gpt2_tokenizer"
SEEDS = {"model_a": 0, "model_b": 1}
FOLDERS = {"model_a": "model-a", "model_b": "model-b"}
SPLITS = ("train", "val", "test")

PAIRS: dict[str, dict] = {
    "gpt2-shakespeare": {
        "task": "causal-lm",
        "config_class": "GPT2Config",
        "config": dict(n_embd=64, n_layer=4, n_head=4, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0,
                       attn_pdrop=0.0),
        "seq_len": 128,
        "training": dict(steps=800, batch_size=4, lr=3e-3, warmup=40, weight_decay=0.1),
    },
    "neox-shakespeare": {
        "task": "causal-lm",
        "config_class": "GPTNeoXConfig",
        "config": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=256,
                       rotary_pct=0.25, use_parallel_residual=True, max_position_embeddings=256,
                       tie_word_embeddings=False),
        "seq_len": 128,
        "training": dict(steps=800, batch_size=4, lr=3e-3, warmup=40, weight_decay=0.1),
    },
    # trained like a real pair (issue 29): ~15M tokens each, 10x the others, to a plateau, on CPython's standard
    # library (files split train / val / test: the barrier is measured on files neither model saw); the
    # example pair's shape and tokenizer size; both seeds trained at once, one thread each (deterministic)
    "neox-stdlib-long": {
        "task": "causal-lm",
        "corpus": "stdlib",
        "vocab_size": 1024,
        "config_class": "GPTNeoXConfig",
        "config": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=256,
                       rotary_pct=0.25, use_parallel_residual=True, max_position_embeddings=256,
                       tie_word_embeddings=False),
        "seq_len": 128,
        "training": dict(steps=3700, batch_size=32, lr=3e-3, warmup=100, weight_decay=0.1, log_every=50),
    },
    "qwen2-shakespeare": {  # a full-group family (LLaMA's group): GQA, q/k/v biases, tied embeddings
        "task": "causal-lm",
        "config_class": "Qwen2Config",
        "config": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=192, max_position_embeddings=256, tie_word_embeddings=True),
        "seq_len": 128,
        "training": dict(steps=800, batch_size=4, lr=3e-3, warmup=40, weight_decay=0.1),
    },
    # two families compared on one recipe: a reduced group (OLMo-2: post-norms, signed-permutation residual, QK-norm)
    # and a full one (Qwen2: LLaMA's group, GQA, q/k/v biases); a 512-token byte-level BPE trained on the train split
    # keeps the unembedding small enough for a 2-core CPU (GPT-2's 50k vocabulary: a step took ~7 s here)
    "olmo2-shakespeare-bpe512": {
        "task": "causal-lm",
        "tokenizer": "bpe",
        "vocab_size": 512,
        "config_class": "Olmo2Config",
        "config": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=256,
                       max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=None),
        "seq_len": 128,
        "training": dict(steps=300, batch_size=8, lr=3e-3, warmup=15, weight_decay=0.1),
    },
    "qwen2-shakespeare-bpe512": {
        "task": "causal-lm",
        "tokenizer": "bpe",
        "vocab_size": 512,
        "config_class": "Qwen2Config",
        "config": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=256, max_position_embeddings=256, tie_word_embeddings=True),
        "seq_len": 128,
        "training": dict(steps=300, batch_size=8, lr=3e-3, warmup=15, weight_decay=0.1),
    },
    # a masked LM (post-LN, residual group: permutations; issue 46): BERT trained by MLM on CPython's standard library
    # (files split train / val / test), a 1024-token BPE with a mask token; both seeds at once, one thread each
    "bert-stdlib": {
        "task": "masked-lm",
        "corpus": "stdlib",
        "vocab_size": 1024,
        "config_class": "BertConfig",
        "architecture": "BertForMaskedLM",
        "config": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=256,
                       max_position_embeddings=128, type_vocab_size=2, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0),
        "seq_len": 128,
        "training": dict(steps=600, batch_size=16, lr=1e-3, warmup=30, weight_decay=0.01, log_every=50),
    },
    "vit-digits": {
        "task": "image-classification",
        "model_args": dict(in_chans=1, img_size=8, patch_size=2, embed_dim=64, depth=4, num_heads=4,
                           num_classes=10),
        "split_seed": 0,
        "fractions": (0.8, 0.1, 0.1),
        "training": dict(steps=1500, batch_size=64, lr=2e-3, warmup=75, weight_decay=0.05, max_shift=1),
    },
}

# the long recipe at Pythia-14M's shape (6 layers, d 128, 512 FFN units): does width close what dual leaves on the
# d-64 pair? (issue 29, part 3)
PAIRS["neox-stdlib-wide"] = {**PAIRS["neox-stdlib-long"], "config": {
    **PAIRS["neox-stdlib-long"]["config"], "hidden_size": 128, "num_hidden_layers": 6, "intermediate_size": 512}}
# the width series at the long pair's depth (4 layers): d 32 and d 128 (FFN 4 d, 4 heads), to tell the wide pair's
# residual width from its depth (issue 29, part 3)
PAIRS["neox-stdlib-narrow"] = {**PAIRS["neox-stdlib-long"], "config": {
    **PAIRS["neox-stdlib-long"]["config"], "hidden_size": 32, "intermediate_size": 128}}
PAIRS["neox-stdlib-wide4"] = {**PAIRS["neox-stdlib-long"], "config": {
    **PAIRS["neox-stdlib-long"]["config"], "hidden_size": 128, "intermediate_size": 512}}
# the d-64 long pair with 4x the FFN units (1,024 per layer), nothing else changed: do the FFN permutations, the
# one discrete part dual does not learn, limit it because 256 independently trained units do not correspond?
PAIRS["neox-stdlib-long-ffn4x"] = {**PAIRS["neox-stdlib-long"], "config": {
    **PAIRS["neox-stdlib-long"]["config"], "intermediate_size": 1024}}
# the long recipe on a LLaMA-class family (Qwen2: GQA 4/2, SwiGLU, RMSNorm, tied embeddings; the short Qwen2 pair's
# shape): does a long-trained LLaMA-class pair leave what the GPT-NeoX one does? (issue 29, part 4)
PAIRS["qwen2-stdlib-long"] = {**PAIRS["neox-stdlib-long"], "config_class": "Qwen2Config",
                              "config": dict(PAIRS["qwen2-shakespeare-bpe512"]["config"])}
PAIRS["qwen2-stdlib-long-mha"] = {**PAIRS["qwen2-stdlib-long"], "config": {
    **PAIRS["qwen2-stdlib-long"]["config"], "num_key_value_heads": 4}}  # the same without GQA
# the long GPT-NeoX pair moved toward Qwen2 one config field at a time: rotary on every head dim (the per-head QK maps
# shrink to what commutes with the rotation), then also a sequential residual and tied embeddings; what is left
# between the last and qwen2-stdlib-long is SwiGLU, RMSNorm and the biases (issue 29, part 4)
PAIRS["neox-stdlib-long-rope1"] = {**PAIRS["neox-stdlib-long"], "config": {
    **PAIRS["neox-stdlib-long"]["config"], "rotary_pct": 1.0}}
PAIRS["neox-stdlib-long-llamalike"] = {**PAIRS["neox-stdlib-long"], "config": {
    **PAIRS["neox-stdlib-long"]["config"], "rotary_pct": 1.0, "use_parallel_residual": False,
    "tie_word_embeddings": True}}
# and from the Qwen2 side: OLMo-1 is the LLaMA layout (SwiGLU, full rotary, sequential residual) with parameter-free
# LayerNorms and no biases; without GQA and with tied embeddings it is qwen2-stdlib-long-mha with LayerNorm for RMSNorm
PAIRS["olmo-stdlib-long"] = {**PAIRS["neox-stdlib-long"], "config_class": "OlmoConfig", "config": dict(
    hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, intermediate_size=256,
    max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=None)}
# OLMo with 172 FFN units: the FFN weights of GPT-NeoX's 256 non-GLU units (3 x 172 ~ 2 x 256), as LLaMA sizes its
# SwiGLU at 2/3 of a GELU FFN: does the GLU cost through its form or through its share of the weights?
PAIRS["olmo-stdlib-long-ffn172"] = {**PAIRS["olmo-stdlib-long"], "config": {
    **PAIRS["olmo-stdlib-long"]["config"], "intermediate_size": 172}}
# the Qwen2 pair without GQA (4 KV heads): what sharing one per-head map across a KV group costs (issue 29, part 4)
PAIRS["qwen2-shakespeare-bpe512-mha"] = {**PAIRS["qwen2-shakespeare-bpe512"], "config": {
    **PAIRS["qwen2-shakespeare-bpe512"]["config"], "num_key_value_heads": 4}}


class PairError(RuntimeError):
    """A benchmark pair that cannot be built (unknown name, missing shared data)."""


def resolve_cache(cache_dir: str | Path) -> Path:
    cache = Path(cache_dir).expanduser()
    return cache if cache.is_absolute() else REPO / cache


def require(path: Path, what: str) -> Path:
    if not path.exists():
        raise PairError(f"{what} not found at {path}; the benchmark pairs read the shared data folder "
                        f"../shared/data next to the repository (see ../shared/data/README.md).")
    return path


def write_atomic_bytes(path: Path, write) -> None:
    """write(partial_path), then rename onto path: no half-written file on failure."""
    partial = path.with_name(f".{path.name}.partial{path.suffix}")
    try:
        write(partial)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def recipe(name: str) -> dict:
    """The settings that define a pair (stored in pair.json; a change retrains)."""
    return json.loads(json.dumps({"name": name, **PAIRS[name]}))


def lm_config(settings: dict, tokenizer):
    import transformers

    config_class = getattr(transformers, settings["config_class"])
    if settings["task"] == "masked-lm":  # pad and mask are the tokenizer's (BERT has no EOS)
        return config_class(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **settings["config"])
    return config_class(vocab_size=len(tokenizer), bos_token_id=tokenizer.eos_token_id,
                        eos_token_id=tokenizer.eos_token_id, **settings["config"])


def train_lm_seed(settings: dict, tokenizer, train_windows: torch.Tensor, seed: int, out: Path, progress: bool):
    model = train_causal_lm(lm_config(settings, tokenizer), train_windows, seed=seed, progress=progress,
                            **settings["training"])
    save_lm(model, tokenizer, out)
    return model


def train_vit_seed(name: str, images, labels, seed: int, out: Path, progress: bool, model_args: dict | None = None):
    settings = PAIRS[name]
    model_args = model_args or settings["model_args"]
    model = train_vit(model_args, images, labels, seed=seed, progress=progress, **settings["training"])
    save_vit(model, model_args, out,
             model_config={"pretrained_cfg": {"tag": f"{name}-seed{seed}"}, "label_names": list(map(str, range(10)))})
    return model


def vit_input_size(settings: dict) -> tuple[int, int, int]:
    model_args = settings["model_args"]
    return model_args["in_chans"], model_args["img_size"], model_args["img_size"]


def stdlib_splits() -> dict[str, list[str]]:
    """CPython's standard library (hf_rebasin.training.stdlib_files), split by file: of every 20 files the 1st is
    test, the 11th val, the rest train."""
    from hf_rebasin.training import stdlib_files, stdlib_texts
    texts = stdlib_texts(stdlib_files())
    return {"test": texts[0::20], "val": texts[10::20],
            "train": [t for k, t in enumerate(texts) if k % 20 not in (0, 10)]}


def tokenizer_as_loaded(tokenizer, settings: dict):
    """The tokenizer as AutoTokenizer loads it beside the pair's config, the one every tool (ours included) will
    use: transformers picks the class by model type for some families (qwen2: Qwen2Tokenizer, whose own
    pre-tokenizer replaces the trained one), so a pair trained on the tokenizer as trained would be evaluated
    on other token ids."""
    import tempfile

    from transformers import AutoTokenizer
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        lm_config(settings, tokenizer).save_pretrained(tmp)
        return AutoTokenizer.from_pretrained(tmp)


def loads_as_trained(folder: Path) -> bool:
    """Whether a cached language pair's tokenizer, loaded as every tool loads it, gives the token ids its
    tokenizer.json gives (false for pairs trained before tokenizer_as_loaded, where the two differ)."""
    from transformers import AutoTokenizer
    from transformers.tokenization_utils_tokenizers import TokenizersBackend
    model, text = folder / FOLDERS["model_a"], (folder / "val.txt").read_text(encoding="utf-8")[:100_000]
    return AutoTokenizer.from_pretrained(model)(text)["input_ids"] == TokenizersBackend.from_pretrained(model)(
        text)["input_ids"]


def lm_corpus(settings: dict, folder: Path):
    """(tokenizer, {split: texts}) of a language pair; the split texts are written to folder/SPLIT.txt."""
    if settings.get("corpus") == "stdlib":
        from hf_rebasin.training import EOS, train_bpe_tokenizer
        texts = stdlib_splits()
        tokenizer = train_bpe_tokenizer(texts["train"], settings["vocab_size"])
        if settings["task"] == "masked-lm":
            tokenizer.add_special_tokens({"mask_token": "<mask>", "pad_token": "<pad>"})
        joined = {split: f"\n{EOS}\n".join(parts) for split, parts in texts.items()}  # documents kept apart
    else:
        from transformers import AutoTokenizer
        text = require(SHAKESPEARE, "Tiny Shakespeare").read_text(encoding="utf-8")
        joined = dict(zip(SPLITS, split_text(text, (0.9, 0.05, 0.05))))
        if settings.get("tokenizer") == "bpe":  # trained on the train split only
            from hf_rebasin.training import train_bpe_tokenizer
            tokenizer = train_bpe_tokenizer([joined["train"]], settings["vocab_size"])
        else:
            tokenizer = AutoTokenizer.from_pretrained(require(GPT2_TOKENIZER, "the GPT-2 tokenizer"))
        texts = {split: [part] for split, part in joined.items()}
    tokenizer = tokenizer_as_loaded(tokenizer, settings)
    for split, part in joined.items():
        write_atomic_bytes(folder / f"{split}.txt", lambda path, part=part: path.write_text(part, encoding="utf-8"))
    return tokenizer, texts


def train_seed_in_process(settings: dict, tokenizer, train_windows, seed: int, out: Path,
                          data_seed: int | None = None) -> dict:
    """One seed trained on one thread (run in a worker process, so that two seeds train at once); its log."""
    torch.set_num_threads(1)
    log: list = []
    start = time.perf_counter()
    if settings["task"] == "masked-lm":
        from hf_rebasin.sources.masking import special_ids
        from hf_rebasin.training import train_masked_lm
        model = train_masked_lm(lm_config(settings, tokenizer), train_windows, architecture=settings["architecture"],
                                mask_id=tokenizer.mask_token_id, never=special_ids(tokenizer), seed=seed,
                                progress=False, log=log, **settings["training"])
    else:
        model = train_causal_lm(lm_config(settings, tokenizer), train_windows, seed=seed, progress=False, log=log,
                                data_seed=data_seed, **settings["training"])
    save_lm(model, tokenizer, out)
    return {"train_seconds": round(time.perf_counter() - start, 1), "log": log}


def build_lm_pair(name: str, folder: Path, progress: bool) -> dict:
    settings = PAIRS[name]
    tokenizer, texts = lm_corpus(settings, folder)
    seq_len = settings["seq_len"]
    windows = {split: token_windows(parts, tokenizer, seq_len) for split, parts in texts.items()}
    metrics: dict = {"tokens": {split: int(w.numel()) for split, w in windows.items()},
                     "ln_vocab": math.log(len(tokenizer))}
    if settings.get("corpus") == "stdlib":  # long: both seeds at once, one thread each
        from concurrent.futures import ProcessPoolExecutor

        import transformers
        with ProcessPoolExecutor(len(SEEDS)) as pool:
            runs = {key: pool.submit(train_seed_in_process, settings, tokenizer, windows["train"], seed,
                                     folder / FOLDERS[key]) for key, seed in SEEDS.items()}
            logs = {key: run.result() for key, run in runs.items()}
        model_class = getattr(transformers, settings.get("architecture", "AutoModelForCausalLM"))
        for key, seed in SEEDS.items():
            model = model_class.from_pretrained(folder / FOLDERS[key], dtype=torch.float32).eval()
            metrics[key] = {"seed": seed, "train_seconds": logs[key]["train_seconds"]}
            if settings["task"] == "causal-lm":
                metrics[key].update(val_loss=causal_lm_loss(model, windows["val"]),
                                    test_loss=causal_lm_loss(model, windows["test"]))
            else:  # the masked-LM loss on the barrier's fixed masking (sources/masking.py)
                from hf_rebasin.evaluation.barrier import evaluate
                from hf_rebasin.sources.eval_data import EvalData
                from hf_rebasin.sources.masking import mask_windows, special_ids
                for split in ("val", "test"):
                    inputs, labels, _ = mask_windows(windows[split], tokenizer.mask_token_id, len(tokenizer),
                                                     special_ids(tokenizer))
                    metrics[key][f"{split}_loss"] = evaluate(model, EvalData("masked-lm", inputs, labels))["loss"]
            write_atomic_bytes(folder / f"train-log-{FOLDERS[key]}.json",
                               lambda path, log=logs[key]["log"]: path.write_text(json.dumps(log) + "\n"))
        return metrics
    for key, seed in SEEDS.items():
        start = time.perf_counter()
        model = train_lm_seed(settings, tokenizer, windows["train"], seed, folder / FOLDERS[key], progress)
        seconds = time.perf_counter() - start
        metrics[key] = {"seed": seed, "train_seconds": round(seconds, 1),
                        "val_loss": causal_lm_loss(model, windows["val"]),
                        "test_loss": causal_lm_loss(model, windows["test"])}
    return metrics


def digits_splits(settings: dict) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """sklearn's 8x8 digits, scaled to [-1, 1] (the saved models' mean 0.5, std 0.5), split by a seeded permutation."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = ((digits.images.astype(np.float32) / 16.0 - 0.5) / 0.5)[:, None]
    labels = digits.target.astype(np.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(settings["split_seed"])).numpy()
    first = int(len(order) * settings["fractions"][0])
    second = first + int(len(order) * settings["fractions"][1])
    parts = {"train": order[:first], "val": order[first:second], "test": order[second:]}
    return {split: (images[index], labels[index]) for split, index in parts.items()}


def build_vit_pair(name: str, folder: Path, progress: bool) -> dict:
    settings = PAIRS[name]
    for split, (images, labels) in digits_splits(settings).items():
        write_atomic_bytes(folder / f"{split}.npz",
                           lambda path, images=images, labels=labels: np.savez(path, images=images, labels=labels))
    data = {split: read_images(str(folder / f"{split}.npz"), input_size=vit_input_size(settings), mean=(0.5,),
                               std=(0.5,))[:2]
            for split in SPLITS}
    metrics: dict = {"examples": {split: len(labels) for split, (_, labels) in data.items()}}
    for key, seed in SEEDS.items():
        start = time.perf_counter()
        model = train_vit_seed(name, *data["train"], seed, folder / FOLDERS[key], progress)
        seconds = time.perf_counter() - start
        val_loss, val_accuracy = classifier_metrics(model, *data["val"])
        test_loss, test_accuracy = classifier_metrics(model, *data["test"])
        metrics[key] = {"seed": seed, "train_seconds": round(seconds, 1), "val_loss": val_loss,
                        "val_accuracy": val_accuracy, "test_loss": test_loss, "test_accuracy": test_accuracy}
    return metrics


def pair_paths(name: str, folder: Path, record: dict) -> dict:
    suffix = ".npz" if PAIRS[name]["task"] == "image-classification" else ".txt"
    return {"model_a": str(folder / FOLDERS["model_a"]), "model_b": str(folder / FOLDERS["model_b"]),
            "test_data": str(folder / f"test{suffix}"), "val_data": str(folder / f"val{suffix}"),
            "train_data": str(folder / f"train{suffix}"), "task": PAIRS[name]["task"],
            "metrics": record["metrics"]}


def get_pair(name: str, cache_dir: str | Path = "runs/pairs", *, progress: bool = True, retrain: bool = False) -> dict:
    """Paths of a benchmark pair (model_a, model_b, test_data, val_data, train_data), its task and metrics.

    Trains and caches the pair under cache_dir/name the first time (or when its settings changed, or
    with retrain=True). Relative cache_dir is taken from the repository root.
    """
    if name not in PAIRS:
        raise PairError(f"unknown benchmark pair {name!r}; choose one of {', '.join(PAIRS)}.")
    folder = resolve_cache(cache_dir) / name
    record_path = folder / "pair.json"
    if record_path.is_file() and not retrain:
        record = json.loads(record_path.read_text())
        if (record.get("settings") == recipe(name) and all((folder / f).is_dir() for f in FOLDERS.values())
                and (PAIRS[name]["task"] == "image-classification" or loads_as_trained(folder))):
            return pair_paths(name, folder, record)
    folder.mkdir(parents=True, exist_ok=True)
    record_path.unlink(missing_ok=True)
    for stale in folder.glob("model-*seed*"):  # extra and narrow seeds of the old recipe (see extra_model)
        shutil.rmtree(stale)
    build = build_vit_pair if PAIRS[name]["task"] == "image-classification" else build_lm_pair
    metrics = build(name, folder, progress)
    record = {"settings": recipe(name), "metrics": metrics,
              "versions": {"torch": torch.__version__, "python": sys.version.split()[0]}}
    write_atomic_bytes(record_path, lambda path: path.write_text(json.dumps(record, indent=2) + "\n"))
    return pair_paths(name, folder, record)


# narrower siblings for width-heterogeneous rows: the same recipe with these fields changed (head_dim kept)
NARROW = {"vit-digits": {"embed_dim": 32, "num_heads": 2}}


def extra_model(name: str, seed: int, cache_dir: str | Path = "runs/pairs", *, progress: bool = True,
                narrow: bool = False) -> str:
    """A further model of a pair (same recipe and data, another seed), for N-way merges: cache_dir/name/model-seedN;
    with narrow=True a narrower sibling (NARROW[name] changed), cache_dir/name/model-narrow-seedN, for
    width-heterogeneous merges.  Trained into a temporary folder and renamed, so an interrupted run leaves nothing
    to mistake for a model."""
    if narrow and name not in NARROW:
        raise PairError(f"no narrower sibling is defined for {name!r}; choose one of {', '.join(NARROW)}.")
    pair = get_pair(name, cache_dir, progress=progress)
    folder = resolve_cache(cache_dir) / name / f"model-{'narrow-' if narrow else ''}seed{seed}"
    if folder.is_dir():
        return str(folder)
    settings = PAIRS[name]
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    if settings["task"] == "causal-lm":
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(pair["model_a"])
        windows = token_windows(read_texts(pair["train_data"]), tokenizer, settings["seq_len"])  # (stdlib: EOS-joined)
        train_lm_seed(settings, tokenizer, windows, seed, partial, progress)
    else:
        images, labels = read_images(pair["train_data"], input_size=vit_input_size(settings), mean=(0.5,),
                                     std=(0.5,))[:2]
        model_args = {**settings["model_args"], **NARROW[name]} if narrow else None
        train_vit_seed(name, images, labels, seed, partial, progress, model_args)
    partial.rename(folder)
    return str(folder)


def extra_models(name: str, seeds: list[int], cache_dir: str | Path = "runs/pairs", *,
                 progress: bool = True) -> list[str]:
    """Further models of a pair (extra_model), several seeds; the long stdlib recipe trains them at once, one
    thread each (as its pair was), and writes each one's training log beside it."""
    if PAIRS[name].get("corpus") != "stdlib":
        return [extra_model(name, seed, cache_dir, progress=progress) for seed in seeds]
    folders = {seed: resolve_cache(cache_dir) / name / f"model-seed{seed}" for seed in seeds}
    train_lm_models(name, {folder: (seed, None) for seed, folder in folders.items()}, cache_dir)
    return [str(folders[seed]) for seed in seeds]


def shared_init_model(name: str, data_seed: int, cache_dir: str | Path = "runs/pairs") -> str:
    """A model of a language pair's recipe with model A's initialisation (seed 0) and another data order: with
    model A, a pair like Pythia's standard and deduplicated runs (one seed, different data streams), where two
    seeds give the harder independent pair.  cache_dir/name/model-init0-data{data_seed}, with its training log."""
    folder = resolve_cache(cache_dir) / name / f"model-init{SEEDS['model_a']}-data{data_seed}"
    train_lm_models(name, {folder: (SEEDS["model_a"], data_seed)}, cache_dir)
    return str(folder)


def train_lm_models(name: str, jobs: dict[Path, tuple[int, int | None]], cache_dir: str | Path) -> None:
    """Train the folders of `jobs` (folder -> (seed, data seed)) that do not exist yet by a language pair's recipe,
    all at once, one thread each; each one's log (training seconds, running loss) in train-log-FOLDER.json beside
    it.  Trained into FOLDER.partial and renamed, so an interrupted run leaves nothing to mistake for a model."""
    from concurrent.futures import ProcessPoolExecutor

    from transformers import AutoTokenizer
    todo = {folder: job for folder, job in jobs.items() if not folder.is_dir()}
    if not todo:
        return
    settings, pair = PAIRS[name], get_pair(name, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(pair["model_a"])
    windows = token_windows(read_texts(pair["train_data"]), tokenizer, settings["seq_len"])
    partials = {folder: folder.with_name(folder.name + ".partial") for folder in todo}
    for partial in partials.values():
        shutil.rmtree(partial, ignore_errors=True)
    with ProcessPoolExecutor(len(todo)) as pool:
        runs = {folder: pool.submit(train_seed_in_process, settings, tokenizer, windows, seed, partials[folder],
                                    data_seed) for folder, (seed, data_seed) in todo.items()}
        logs = {folder: run.result() for folder, run in runs.items()}
    for folder in todo:
        write_atomic_bytes(folder.with_name(f"train-log-{folder.name}.json"),
                           lambda path, log=logs[folder]: path.write_text(json.dumps(log) + "\n"))
        partials[folder].rename(folder)


def describe(name: str, pair: dict) -> str:
    lines = [f"{name} ({pair['task']})"]
    for key in ("model_a", "model_b", "train_data", "val_data", "test_data"):
        lines.append(f"  {key:10s} {pair[key]}")
    for key in ("model_a", "model_b"):
        m = pair["metrics"][key]
        extra = (f", test accuracy {m['test_accuracy']:.3f}" if "test_accuracy" in m
                 else f", test perplexity {math.exp(m['test_loss']):.1f}")
        lines.append(f"  {key} (seed {m['seed']}): val loss {m['val_loss']:.3f}, test loss {m['test_loss']:.3f}"
                     f"{extra}; trained in {m['train_seconds']:.0f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train (once, cached) and print the benchmark pairs.")
    parser.add_argument("names", nargs="+", metavar="NAME", help=f"pair names: {', '.join(PAIRS)}")
    parser.add_argument("--cache-dir", default="runs/pairs",
                        help="cache folder (default runs/pairs, from the repo root)")
    parser.add_argument("--retrain", action="store_true", help="train again even when a cached pair exists")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    args = parser.parse_args(argv)
    unknown = [name for name in args.names if name not in PAIRS]
    if unknown:
        parser.error(f"unknown pair(s) {', '.join(unknown)}; choose from {', '.join(PAIRS)}")
    try:
        for name in args.names:
            print(describe(name, get_pair(name, args.cache_dir, progress=not args.no_progress, retrain=args.retrain)),
                  flush=True)
    except PairError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
