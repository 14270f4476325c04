"""The model card of a merge output: Hub metadata, barrier table, plot link, eval table, atomic write."""
from __future__ import annotations

import json
import math
import re

import pytest
from hub_server import write_merge_output
from huggingface_hub import ModelCard

from hf_rebasin.cli import UserError, main
from hf_rebasin.hub import cards

EVAL = {
    "tasks": ["piqa", "sciq"], "num_fewshot": 0, "limit": 200,
    "results": {
        "merged": {"piqa": {"acc": 0.5871, "acc_stderr": 0.0115, "acc_norm": 0.5903, "acc_norm_stderr": 0.0114},
                   "sciq": {"acc,none": 0.742, "acc_stderr,none": 0.0138, "alias": "sciq"}},
        "A": {"piqa": {"acc": 0.6012, "acc_stderr": 0.0114, "acc_norm": 0.6050, "acc_norm_stderr": 0.0114},
              "sciq": {"acc": 0.761, "acc_stderr": 0.0135}},
        "B": {"piqa": {"acc": 0.5950, "acc_stderr": 0.0114, "acc_norm": 0.5988, "acc_norm_stderr": 0.0114},
              "sciq": {"acc": 0.755, "acc_stderr": 0.0136}},
    },
    "models": {"merged": "out", "A": "EleutherAI/pythia-14m", "B": "/runs/seed2"},
}


@pytest.fixture
def merge_dir(tmp_path):
    out = tmp_path / "out"
    write_merge_output(out)
    return out


def metrics(card: ModelCard) -> dict[tuple[str, str], float]:
    return {(r.dataset_type, r.metric_type): r.metric_value for r in card.data.eval_results}


def table(text: str, first_header_cell: str) -> tuple[list[str], list[list[str]]]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header_cell} |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return header, rows


def test_metadata(merge_dir):
    barrier = json.loads((merge_dir / "barrier.json").read_text())
    card = ModelCard.load(cards.write_card(merge_dir))
    assert card.data.base_model == ["EleutherAI/pythia-14m"]  # the Hub id; the local folder only in the body,
    local = barrier["models"][1]  # an absolute path, shown by its folder name only (the card is published)
    assert local.startswith("/") and "| B | `seed2` |" in card.text and "`EleutherAI/pythia-14m`" in card.text
    assert str(merge_dir.parent) not in str(card)
    assert card.data.base_model_relation == "merge"
    assert card.data.library_name == "transformers"
    assert card.data.pipeline_tag == "text-generation"
    assert {"merge", "hf-rebasin", "wm"} <= set(card.data.tags)
    assert card.data.license == "apache-2.0"
    assert card.data.model_name == "out"
    found = metrics(card)
    spec = barrier["data"]["spec"]
    assert found[(spec, "loss_barrier")] == pytest.approx(barrier["barrier"], rel=1e-12)
    assert found[(spec, "loss")] == pytest.approx(barrier["merged_loss"], rel=1e-12)
    assert found[(spec, "perplexity")] == pytest.approx(barrier["perplexity"][5], rel=1e-12)
    assert (spec, "accuracy") not in found


def test_license_only_when_sources_agree(tmp_path):
    write_merge_output(tmp_path / "out", license=None)
    text = str(cards.render_card(tmp_path / "out"))
    assert cards.render_card(tmp_path / "out").data.license is None
    assert "license:" not in text.split("---")[1]


def test_vit_card_is_timm_with_accuracy(tmp_path):
    lambdas = [i / 10 for i in range(11)]
    accuracy = [0.81 - 0.3 * lam * (1 - lam) for lam in lambdas]
    write_merge_output(tmp_path / "vit", architecture="VisionTransformer", task="image-classification",
                       models=["someone/vit-a", "someone/vit-b"], perplexity=None, accuracy=accuracy,
                       data={"spec": "digits", "examples": 360}, license="mit")
    card = cards.render_card(tmp_path / "vit")
    assert card.data.library_name == "timm"
    assert card.data.pipeline_tag == "image-classification"
    assert card.data.base_model == ["someone/vit-a", "someone/vit-b"]
    assert card.data.license == "mit"
    assert metrics(card)[("digits", "accuracy")] == pytest.approx(accuracy[5])
    header, rows = table(card.text, "λ")
    assert header[-1] == "accuracy" and "perplexity" not in header
    assert [float(r[-1]) for r in rows] == pytest.approx(accuracy, abs=5e-5)
    assert "360 examples" in card.text


def test_barrier_table_matches_barrier_json(merge_dir):
    barrier = json.loads((merge_dir / "barrier.json").read_text())
    header, rows = table(str(cards.render_card(merge_dir)), "λ")
    assert header == ["λ", "loss", "excess over the endpoint line", "perplexity"]
    assert len(rows) == len(barrier["lambdas"])
    (end_a, end_b) = barrier["endpoint_loss"]
    for row, lam, loss, ppl in zip(rows, barrier["lambdas"], barrier["loss"], barrier["perplexity"]):
        assert float(row[0]) == pytest.approx(lam, abs=5e-3)
        assert float(row[1]) == pytest.approx(loss, abs=5e-5)
        assert float(row[2]) == pytest.approx(loss - ((1 - lam) * end_a + lam * end_b), abs=5e-5)
        assert float(row[3]) == pytest.approx(ppl, abs=5e-3)
    assert max(float(r[2]) for r in rows) == pytest.approx(barrier["barrier"], abs=5e-5)


def test_body_has_plot_command_caveats_and_settings(merge_dir):
    barrier = json.loads((merge_dir / "barrier.json").read_text())
    text = cards.render_card(merge_dir).text
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert links == ["barrier.png"] and (merge_dir / links[0]).is_file()
    assert f"```bash\n{cards.public_command(barrier['command'])}\n```" in text
    assert "hf-rebasin merge EleutherAI/pythia-14m seed2 --method wm -o out" in text  # no absolute path
    for note in barrier["notes"]:
        assert f"* {note}\n" in text
    assert "weight matching" in text and "`--method wm`" in text
    assert "16,384 predicted tokens" in text and barrier["data"]["spec"] in text
    assert "| `rounds` | `5` |" in text and "| `seed` | `0` |" in text  # the settings, as a table
    assert f"**{barrier['barrier']:.4f}** at λ = {barrier['barrier_lambda']:.2f}" in text


def test_unaligned_baseline_is_not_called_aligned(tmp_path):
    write_merge_output(tmp_path / "raw", method="raw")
    card = cards.render_card(tmp_path / "raw")
    assert "without alignment" in card.text and "first aligned" not in card.text
    assert "raw" in card.data.tags and "`--method raw`" in card.text


def test_eval_table_and_model_index_after_eval_json(merge_dir):
    assert "## Evaluation" not in cards.render_card(merge_dir).text
    (merge_dir / "eval.json").write_text(json.dumps(EVAL))
    card = ModelCard.load(cards.write_card(merge_dir))
    header, rows = table(card.text, "task")
    assert header == ["task", "metric", "merged", "A (`EleutherAI/pythia-14m`)", "B (`seed2`)"]
    expected = [("piqa", "acc"), ("piqa", "acc_norm"), ("sciq", "acc")]
    assert [(r[0], r[1]) for r in rows] == expected
    for row, (task, metric) in zip(rows, expected):
        for cell, column in zip(row[2:], ("merged", "A", "B")):
            results = {k.split(",")[0]: v for k, v in EVAL["results"][column][task].items()}
            assert cell == f"{results[metric]:.4f} ± {results[metric + '_stderr']:.4f}"
    found = metrics(card)
    assert found[("piqa", "acc")] == 0.5871 and found[("piqa", "acc_norm")] == 0.5903
    assert found[("sciq", "acc")] == 0.742
    assert ("piqa", "acc_stderr") not in found
    assert "0-shot, on the first 200 examples" in card.text


def test_non_finite_values_stay_out_of_model_index(tmp_path):
    write_merge_output(tmp_path / "out", merged_loss=math.inf, perplexity=[math.inf] * 11)
    card = cards.render_card(tmp_path / "out")
    assert {m for _, m in metrics(card)} == {"loss_barrier"}


def test_write_card_is_atomic(merge_dir, monkeypatch):
    readme = merge_dir / "README.md"
    readme.write_text("the previous card")

    def disk_full(src, dst):
        raise OSError(28, "No space left on device")

    from hf_rebasin.export import io
    monkeypatch.setattr(io.os, "replace", disk_full)
    with pytest.raises(OSError, match="No space left"):
        cards.write_card(merge_dir)
    assert readme.read_text() == "the previous card"
    assert sorted(p.name for p in merge_dir.iterdir()) == ["README.md", "barrier.json", "barrier.png"]
    monkeypatch.undo()
    assert cards.write_card(merge_dir) == readme
    assert readme.read_text(encoding="utf-8") == str(cards.render_card(merge_dir))
    assert sorted(p.name for p in merge_dir.iterdir()) == ["README.md", "barrier.json", "barrier.png"]


def test_not_a_merge_output(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match=r"is not an hf-rebasin merge output \(no barrier.json\)"):
        cards.render_card(tmp_path)
    with pytest.raises(UserError, match="no barrier.json"):
        cards.write_card(tmp_path)
    assert not (tmp_path / "README.md").exists()
    assert main(["push", str(tmp_path), "someuser/x"]) == 2
    assert "is not an hf-rebasin merge output (no barrier.json)" in capsys.readouterr().err


def test_broken_barrier_json(tmp_path):
    (tmp_path / "barrier.json").write_text('{"method": "wm"')
    with pytest.raises(UserError, match="not valid JSON"):
        cards.render_card(tmp_path)
    (tmp_path / "barrier.json").write_text('{"method": "wm"}')
    with pytest.raises(UserError, match="lacks models, lambdas, loss, barrier"):
        cards.render_card(tmp_path)
