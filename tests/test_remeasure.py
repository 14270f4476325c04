"""barrier.json measured independently: the merged model at each λ, exported to a folder (--alpha λ), loaded with
the stock transformers loader and evaluated on windows cut here with the stock tokenizer, has the loss the report
gives at that λ; the barrier recomputed from those independent losses is the report's."""
from __future__ import annotations

import json

import pytest
import torch

SEQ, MAX_TOKENS, ALPHAS = 32, 2048, (0.0, 0.5, 1.0)


def _stock_loss(folder, text: str) -> float:
    """The mean next-token loss of the exported model (AutoModelForCausalLM, AutoTokenizer) over consecutive
    windows of SEQ tokens of `text` (one document: no EOS), each predicting SEQ - 1 tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    ids = AutoTokenizer.from_pretrained(folder)(text, add_special_tokens=False)["input_ids"][:MAX_TOKENS]
    windows = torch.tensor(ids[:len(ids) // SEQ * SEQ]).view(-1, SEQ)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        losses = [float(model(input_ids=w[None], labels=w[None]).loss) for w in windows]
    return sum(losses) / len(losses)


@pytest.mark.parametrize("kind", ["gpt_neox", "llama_gqa_tied"])
def test_each_lambda_remeasured_from_the_exported_folder(kind, tiny_dirs, text_file, tmp_path):
    from hf_rebasin import tiny
    from hf_rebasin.cli import main
    a, b = tiny_dirs[kind], tiny.make_tiny(kind, tmp_path / "b", seed=2)
    text = text_file.read_text()
    reported, measured = {}, {}
    for alpha in ALPHAS:
        out = tmp_path / f"merged-{alpha}"
        assert main(["merge", str(a), str(b), "--method", "wm", "--alpha", str(alpha), "--lambdas", "3",
                     "--data", str(text_file), "--seq-len", str(SEQ), "--max-eval-tokens", str(MAX_TOKENS),
                     "--no-raw-reference", "--out", str(out)]) == 0
        report = json.loads((out / "barrier.json").read_text())
        assert report["lambdas"] == list(ALPHAS) and report["alpha"] == alpha
        reported[alpha] = report
        measured[alpha] = _stock_loss(out, text)
        assert measured[alpha] == pytest.approx(report["loss"][ALPHAS.index(alpha)], abs=1e-5), alpha
    # the same path every time (the matching is deterministic), and its barrier from the independent losses
    assert all(r["loss"] == reported[0.5]["loss"] for r in reported.values())
    excess = [measured[lam] - ((1 - lam) * measured[0.0] + lam * measured[1.0]) for lam in ALPHAS]
    assert max(excess) == pytest.approx(reported[0.5]["barrier"], abs=2e-5)
