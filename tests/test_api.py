"""The README's Python example, run as written (on the example pair that ships with the package)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import hf_rebasin
from hf_rebasin.options import MergeOptions

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example() -> str:
    text = README.read_text()
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def test_the_readme_example_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    exec(compile(readme_example(), str(README), "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    report = json.loads((tmp_path / "merged-example" / "barrier.json").read_text())
    assert printed[0].startswith(str(report["barrier"]))
    assert printed[1] == str(tmp_path / "merged-example")
    assert report["method"] == "wm" and len(report["lambdas"]) == 5 and report["data"]["input_tokens"] == 4096
    assert report["data"]["tokens"] == report["data"]["windows"] * (report["data"]["seq_len"] - 1)  # predicted
    assert report["command"].startswith("hf-rebasin merge ") and "--lambdas 5" in report["command"]


def test_api_options_are_checked_before_anything_is_loaded(tmp_path):
    import pytest

    from hf_rebasin.errors import OptionError
    with pytest.raises(TypeError, match="max_eval_token"):
        hf_rebasin.barrier(["a", "b"], max_eval_token=10)  # a misspelt option is refused by name
    with pytest.raises(OptionError, match="^lambdas must be in"):  # the keyword, not the flag (issue 28)
        hf_rebasin.barrier([tmp_path / "no-such-a", tmp_path / "no-such-b"], lambdas=1)
    options = MergeOptions(method="dual", steps=10, learn_batch_size=8)
    assert options.warmup_steps() == 1
    # the λ default follows BENCHMARKS.md: narrow, but dual on images or N models uniform; lm narrow throughout
    assert options.learned_lambda_dist(2, "causal-lm") == "narrow"
    assert options.learned_lambda_dist(2, "image-classification") == "uniform"
    assert options.learned_lambda_dist(3, "causal-lm") == "uniform"
    lm = MergeOptions(method="lm", steps=10, learn_batch_size=8)
    assert {lm.learned_lambda_dist(n, task) for n in (2, 3) for task in ("causal-lm", "image-classification")} == {
        "narrow"}
    chosen = MergeOptions(method="dual", steps=10, learn_batch_size=8, lambda_dist="uniform")
    assert chosen.learned_lambda_dist(2, "causal-lm") == "uniform"
