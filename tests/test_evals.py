"""``hf-rebasin eval`` on a local PIQA-shaped task: lm-eval's accuracy must equal an accuracy computed
here from the model's own log-likelihoods, for the merged model and for its endpoints."""
from __future__ import annotations

import json
import math
import sys
import types
from importlib import metadata
from pathlib import Path

import corpus
import pytest
import torch

from hf_rebasin import cli
from hf_rebasin.hub import evals
from hf_rebasin.sources import models
from hf_rebasin.tiny import make_tiny, randomise_

TASK = "tiny_piqa"

# PIQA's shape: a goal, two solutions, the index of the right one.
QUESTIONS = [
    ("To keep bread fresh longer,", "store it in a sealed bag.", "leave it open on the counter in the sun.", 0),
    ("How do you cool soup quickly?", "Put the pot in the oven.", "Stir it in a bowl set in ice water.", 1),
    ("To dry wet shoes,", "stuff them with newspaper overnight.", "fill them with water.", 0),
    ("How can you open a stuck jar lid?", "Run hot water over the lid.", "Freeze the jar for a week.", 0),
    ("To sharpen a pencil without a sharpener,", "use a knife carefully.", "soak it in milk.", 0),
    ("How do you make ice cubes?", "Put a tray of water on the stove.", "Put a tray of water in the freezer.", 1),
    ("To find a small leak in a bike tube,", "submerge it in water and look for bubbles.", "paint it red.", 0),
    ("How do you remove a splinter?", "Use clean tweezers.", "Hit it with a hammer until it goes away.", 0),
    ("To keep a candle from dripping,", "chill it in the fridge before lighting.", "light both ends.", 0),
    ("How do you stop a door from squeaking?", "Oil the hinges.", "Slam it harder every time.", 0),
    ("To water a plant while away,", "shout at it before leaving.", "set a bottle upside down in the soil.", 1),
    ("How do you soften hard brown sugar?", "Seal it in a bag with a slice of bread.", "Leave it in the car.", 0),
]


def write_task(folder: Path, dataset_lines: list[str] | None = None, dataset_path: str = "json",
               name: str = TASK) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data_file = folder / f"{name}.jsonl"
    if dataset_lines is None:
        dataset_lines = [json.dumps({"goal": g, "sol1": s1, "sol2": s2, "label": y}) for g, s1, s2, y in QUESTIONS]
    data_file.write_text("\n".join(dataset_lines) + "\n")
    data_kwargs = f"dataset_kwargs:\n  data_files:\n    test: {data_file}\n" if dataset_path == "json" else ""
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\n"
        f"dataset_path: {dataset_path}\n"
        + data_kwargs +
        "output_type: multiple_choice\n"
        "test_split: test\n"
        'doc_to_text: "Question: {{goal}}\\nAnswer:"\n'
        "doc_to_target: label\n"
        'doc_to_choice: "{{[sol1, sol2]}}"\n'
        "metric_list:\n"
        "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n"
        "metadata:\n  version: 1.0\n")
    return folder


def make_language_model(path: Path, seed: int) -> Path:
    """A tiny random GPT-NeoX saved with a real byte-level BPE tokenizer (trained at test time) it covers."""
    from transformers import AutoModelForCausalLM, GPTNeoXConfig
    tokenizer = corpus.bpe_tokenizer()
    config = GPTNeoXConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64,
                           vocab_size=len(tokenizer), max_position_embeddings=128, rotary_pct=0.5,
                           bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    randomise_(model, seed)
    with torch.no_grad():  # sharper, seed-specific preferences: the three models must score differently
        model.get_output_embeddings().weight.mul_(4.0)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def write_barrier(out_dir: Path, sources: list[str], task: str = "causal-lm",
                  architecture: str = "GPTNeoXForCausalLM") -> None:
    lambdas = [i / 10 for i in range(11)]
    loss = [5.0 + 0.2 * math.sin(math.pi * lam) for lam in lambdas]
    barrier = {
        "hf_rebasin_version": "0.1.0", "method": "wm", "models": sources, "architecture": architecture,
        "task": task, "alpha": 0.5, "lambdas": lambdas, "loss": loss,
        ("perplexity" if task == "causal-lm" else "accuracy"):
            [math.exp(v) for v in loss] if task == "causal-lm" else [0.5] * 11,
        "endpoint_loss": [loss[0], loss[-1]], "merged_loss": loss[5], "barrier": loss[5] - loss[0],
        "barrier_lambda": 0.5,
        "data": {"spec": "tests", "tokens": 256, "seq_len": 32},
        "settings": {}, "timings": {"load_s": 0.0, "match_s": 0.0, "barrier_s": 0.0, "export_s": 0.0},
        "versions": {"hf_rebasin": "0.1.0"}, "command": "hf-rebasin merge A B", "notes": [], "license": None,
    }
    (out_dir / "barrier.json").write_text(json.dumps(barrier, indent=2))


# --- the reference computation, written from the task's definition -----------------------------

def choice_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    whole = tokenizer(context + continuation)["input_ids"]
    context_len = len(tokenizer(context)["input_ids"])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), dim=-1)
    return sum(float(logprobs[i - 1, whole[i]]) for i in range(context_len, len(whole)))


def reference_scores(model_dir: Path, limit: int | None = None) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    correct, correct_norm, predictions = [], [], []
    for goal, sol1, sol2, label in QUESTIONS[:limit]:
        context = f"Question: {goal}\nAnswer:"
        lls = [choice_loglikelihood(model, tokenizer, context, " " + sol) for sol in (sol1, sol2)]
        normed = [ll / len(sol) for ll, sol in zip(lls, (sol1, sol2))]
        pred = max(range(2), key=lambda i: (lls[i], -i))  # first maximum, like argmax
        pred_norm = max(range(2), key=lambda i: (normed[i], -i))
        predictions.append(pred)
        correct.append(float(pred == label))
        correct_norm.append(float(pred_norm == label))
    n = len(correct)
    acc = sum(correct) / n
    stderr = math.sqrt(sum((c - acc) ** 2 for c in correct) / (n - 1)) / math.sqrt(n)
    return {"acc": acc, "acc_norm": sum(correct_norm) / n, "acc_stderr": stderr, "predictions": predictions, "n": n}


# --- fixtures ------------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No Hub access (also when datasets/huggingface_hub were imported before), a private datasets cache,
    and a recording stand-in for the card writer (owned by another module)."""
    import datasets
    import huggingface_hub
    for variable in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(variable, "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets_cache")
    calls = []

    def write_card(out_dir, model_name=None):  # records the card's name and the eval.json beside it
        eval_file = Path(out_dir) / "eval.json"
        calls.append((model_name, json.loads(eval_file.read_text()) if eval_file.is_file() else None))
    monkeypatch.setitem(sys.modules, "hf_rebasin.hub.cards", types.SimpleNamespace(write_card=write_card))
    return calls


@pytest.fixture(scope="module")
def merge_dir(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("eval")
    source_a = make_language_model(root / "model_a", seed=1)
    source_b = make_language_model(root / "model_b", seed=2)
    merged = make_language_model(root / "merged", seed=11)
    write_barrier(merged, [str(source_a), str(source_b)])
    tasks = write_task(root / "tasks")
    references = {label: reference_scores(path) for label, path in
                  (("merged", merged), ("A", source_a), ("B", source_b))}
    # the fixture must tell the three models apart, or a mix-up of endpoints could pass unnoticed
    assert len({refs["acc"] for refs in references.values()}) == 3, references
    return {"dir": merged, "A": source_a, "B": source_b, "tasks": tasks, "references": references}


def run_cli(*argv: str) -> int:
    return cli.main(["eval", *map(str, argv)])


def forbid_model_loading(monkeypatch) -> None:
    def refuse(source):
        raise AssertionError(f"a model was loaded ({source}) before the input was checked")
    monkeypatch.setattr(models, "load", refuse)


# --- tests ---------------------------------------------------------------------------------------

def test_eval_of_merged_model_equals_reference_accuracy(merge_dir, offline, capsys):
    out_dir = merge_dir["dir"]
    assert run_cli(out_dir, "--tasks", TASK, "--include-path", merge_dir["tasks"], "--device", "cpu") == 0
    report = json.loads((out_dir / "eval.json").read_text())
    reference = merge_dir["references"]["merged"]
    scores = report["results"]["merged"][TASK]
    assert 0.0 <= scores["acc"] <= 1.0
    assert scores["acc"] == pytest.approx(reference["acc"], abs=1e-12)
    assert scores["acc_norm"] == pytest.approx(reference["acc_norm"], abs=1e-12)
    assert scores["acc_stderr"] == pytest.approx(reference["acc_stderr"], rel=1e-9)
    assert isinstance(scores["acc_norm_stderr"], float)
    assert set(scores) == {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"}
    assert report["tasks"] == [TASK] and report["num_fewshot"] == 0 and report["limit"] is None
    assert list(report["results"]) == ["merged"]
    assert report["models"] == {"merged": str(out_dir)}
    assert report["samples"]["merged"][TASK] == len(QUESTIONS)
    assert report["versions"]["lm_eval"] == metadata.version("lm_eval")
    assert not [p for p in out_dir.iterdir() if p.name.endswith(".tmp")]
    printed = capsys.readouterr().out
    assert TASK in printed and f"{reference['acc']:.4f}" in printed
    # the card (named after the folder) is refreshed once eval.json is in place, in the copy swapped in at the end
    assert [(name, data["results"]) for name, data in offline] == [(out_dir.name, report["results"])]
    assert not [p for p in out_dir.parent.iterdir() if "hf-rebasin" in p.name]  # no staging copy left


def test_endpoints_are_evaluated_as_their_own_models(merge_dir):
    out_dir = merge_dir["dir"]
    assert run_cli(out_dir, "--tasks", TASK, "--include-path", merge_dir["tasks"], "--endpoints",
                   "--batch-size", "3") == 0
    report = json.loads((out_dir / "eval.json").read_text())
    assert list(report["results"]) == ["merged", "A", "B"]
    assert report["models"] == {"merged": str(out_dir), "A": str(merge_dir["A"]), "B": str(merge_dir["B"])}
    for label in ("merged", "A", "B"):
        reference = merge_dir["references"][label]
        scores = report["results"][label][TASK]
        assert scores["acc"] == pytest.approx(reference["acc"], abs=1e-12), label
        assert scores["acc_norm"] == pytest.approx(reference["acc_norm"], abs=1e-12), label


def test_limit_scores_only_the_first_examples(merge_dir):
    out_dir = merge_dir["dir"]
    assert run_cli(out_dir, "--tasks", TASK, "--include-path", merge_dir["tasks"], "--limit", "5") == 0
    report = json.loads((out_dir / "eval.json").read_text())
    reference = reference_scores(out_dir, limit=5)
    assert report["limit"] == 5 and report["samples"]["merged"][TASK] == 5
    assert report["results"]["merged"][TASK]["acc"] == pytest.approx(reference["acc"], abs=1e-12)


def test_run_eval_api_returns_the_metrics(merge_dir):
    metrics = evals.run_eval(merge_dir["A"], [TASK], include_path=merge_dir["tasks"], device="cpu")
    assert set(metrics) == {TASK}
    assert metrics[TASK]["acc"] == pytest.approx(merge_dir["references"]["A"]["acc"], abs=1e-12)


def test_unknown_task_is_refused_before_any_model_is_loaded(merge_dir, monkeypatch, capsys):
    forbid_model_loading(monkeypatch)
    code = run_cli(merge_dir["dir"], "--tasks", f"{TASK},piqaa", "--include-path", merge_dir["tasks"])
    error = capsys.readouterr().err
    assert code == 2
    assert "'piqaa'" in error and "did you mean" in error and "piqa" in error.split("did you mean")[1]
    assert "lm-eval ls tasks" in error


def test_misspelt_local_task_suggests_the_local_one(merge_dir, monkeypatch, capsys):
    forbid_model_loading(monkeypatch)
    assert run_cli(merge_dir["dir"], "--tasks", "tiny_piqaa", "--include-path", merge_dir["tasks"]) == 2
    assert TASK in capsys.readouterr().err.split("did you mean")[1]


def test_task_data_that_cannot_be_fetched_is_a_clear_error(merge_dir, tmp_path, monkeypatch, capsys):
    tasks = write_task(tmp_path / "hub_tasks", dataset_path="hf-rebasin-tests/no-such-dataset", name="hub_piqa")
    eval_file = merge_dir["dir"] / "eval.json"
    before = eval_file.read_bytes() if eval_file.exists() else None
    forbid_model_loading(monkeypatch)
    assert run_cli(merge_dir["dir"], "--tasks", "hub_piqa", "--include-path", tasks) == 2
    error = capsys.readouterr().err
    assert "hub_piqa" in error and "could not be fetched" in error
    assert "HF_DATASETS_OFFLINE" in error and "--include-path" in error
    assert (eval_file.read_bytes() if eval_file.exists() else None) == before


def test_folder_without_barrier_json_is_not_a_merge_output(merge_dir, capsys):
    assert run_cli(merge_dir["A"], "--tasks", TASK, "--include-path", merge_dir["tasks"]) == 2
    assert "not an hf-rebasin merge output" in capsys.readouterr().err


def test_vit_merge_is_refused(tmp_path, capsys):
    out_dir = make_tiny("vit", tmp_path / "vit_merge")
    write_barrier(out_dir, ["vit_a", "vit_b"], task="image-classification", architecture="VisionTransformer")
    assert run_cli(out_dir, "--tasks", "piqa") == 2
    assert "language models" in capsys.readouterr().err
    assert not (out_dir / "eval.json").exists()


def test_bad_options_are_user_errors(merge_dir, capsys):
    assert run_cli(merge_dir["dir"], "--tasks", TASK, "--limit", "0") == 2
    assert run_cli(merge_dir["dir"], "--tasks", " , ") == 2
    assert run_cli(merge_dir["dir"], "--tasks", TASK, "--batch-size", "zero") == 2
    assert run_cli(merge_dir["dir"], "--tasks", TASK, "--include-path", merge_dir["dir"] / "missing") == 2
    assert run_cli(merge_dir["dir"], "--tasks", TASK, "--include-path", merge_dir["tasks"] / f"{TASK}.yaml") == 2
    if not torch.cuda.is_available():
        assert run_cli(merge_dir["dir"], "--tasks", TASK, "--device", "cuda") == 2
    error = capsys.readouterr().err
    assert "not a folder" in error and (torch.cuda.is_available() or "no CUDA GPU" in error)
    assert "--limit" in error and "no task given" in error and "--batch-size" in error and "missing" in error
