"""--protocol li-shen: WikiText-103 test as the Hugging Face perplexity recipe cuts it with a stride of 512 (rows
joined by blank lines, consecutive 512-token windows, no sliding window), articles as documents; measured from a
small WikiText-format file written here, and checked against the stock transformers loss on the same blocks."""
from __future__ import annotations

import json

import pytest
import torch

from hf_rebasin.sources.protocols import li_shen_windows, wikitext_rows

SEQ = 512
TITLES = ["Robert Boulter", "Valkyria Chronicles", "Tower Building", "Ice Hockey"]


def _article(title: str, k: int) -> str:
    words = ("the of and in to a was for on as by with from at that his he it an were which are is").split()
    para = lambda n: " " + " ".join(words[(k * 7 + i * 3) % len(words)] for i in range(n)) + " . \n"
    return (f" = {title} = \n \n{para(120 + 40 * k)} \n = = Career = = \n \n{para(90)} \n = = = Early life = = = \n"
            f" \n{para(60 + 25 * k)} \n")


@pytest.fixture(scope="module")
def wiki_file(tmp_path_factory):
    """A WikiText-format file (the layout of wiki.test.raw): a blank first line, articles with sections."""
    path = tmp_path_factory.mktemp("wikitext") / "wiki.test.raw"
    path.write_text(" \n" + "".join(_article(t, k) for k, t in enumerate(TITLES)))
    return path


@pytest.fixture(scope="module")
def long_pair(tmp_path_factory):
    """Two tiny GPT-NeoX models with a context of 512 tokens and the tiny character tokenizer."""
    from transformers import AutoModelForCausalLM

    from hf_rebasin import tiny
    root = tmp_path_factory.mktemp("long_pair")
    folders = []
    for seed in (1, 2):
        config = tiny.adapter_of("gpt_neox").tiny_config("gpt_neox")
        config.max_position_embeddings = SEQ
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        tiny.randomise_(model, seed)
        model.save_pretrained(root / f"m{seed}", safe_serialization=True)
        tiny.tiny_tokenizer(config.vocab_size).save_pretrained(root / f"m{seed}")
        folders.append(root / f"m{seed}")
    return folders


def _recipe(path, tokenizer):
    """The recipe, written out here: rows (blank lines empty), joined by "\\n\\n", 512-token blocks; and the
    article of each block's first token, from the token count of the text before each title line."""
    rows = [line if line.strip() else "" for line in path.read_text().splitlines(keepends=True)]
    text = "\n\n".join(rows)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    n = len(ids) // SEQ
    blocks = torch.tensor(ids[:n * SEQ]).view(n, SEQ)
    starts = [text.index(f" = {title} = ") for title in TITLES]
    before = [len(tokenizer(text[:s], add_special_tokens=False)["input_ids"]) for s in starts]
    articles = [max(j for j, b in enumerate(before) if b <= k * SEQ or j == 0) for k in range(n)]
    return blocks, articles, len(ids)


def test_the_windows_are_the_recipes_blocks(wiki_file):
    from hf_rebasin import tiny
    tokenizer = tiny.tiny_tokenizer()
    blocks, articles, total = _recipe(wiki_file, tokenizer)
    windows, units, info = li_shen_windows(wikitext_rows(str(wiki_file)), tokenizer)
    assert len(blocks) >= 6 and torch.equal(windows, blocks)
    assert units == articles and len(set(units)) == len(TITLES)
    assert info["tokens"] == len(blocks) * (SEQ - 1) and info["input_tokens"] == len(blocks) * SEQ
    assert info["articles"] == len(TITLES) and info["dropped_tail_tokens"] == total - len(blocks) * SEQ

    class Slow:  # a tokenizer without offsets: article by article, the same ids and articles
        is_fast = False

        def __call__(self, text, **kwargs):
            return tokenizer(text, add_special_tokens=False)

    slow_windows, slow_units, _ = li_shen_windows(wikitext_rows(str(wiki_file)), Slow())
    assert torch.equal(slow_windows, blocks) and slow_units == articles


def test_a_merge_under_li_shen_measures_the_recipes_loss(long_pair, wiki_file, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_rebasin.cli import main
    out = tmp_path / "merged"
    assert main(["merge", *map(str, long_pair), "--method", "raw", "--protocol", "li-shen", "--data", str(wiki_file),
                 "--lambdas", "3", "--out", str(out)]) == 0
    report = json.loads((out / "barrier.json").read_text())
    data = report["data"]
    assert data["protocol"] == "li-shen" and report["settings"]["protocol"] == "li-shen"
    assert data["seq_len"] == SEQ and data["tokens"] == data["windows"] * (SEQ - 1)  # predicted tokens
    assert report["settings"]["max_eval_tokens"] is None and report["bootstrap"]["unit"] == "documents"
    blocks, articles, _ = _recipe(wiki_file, AutoTokenizer.from_pretrained(long_pair[0]))
    assert data["windows"] == len(blocks) and report["bootstrap"]["units"] == len(set(articles))
    for k, folder in ((0, long_pair[0]), (2, long_pair[1])):  # the endpoints, measured by the recipe's code
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():  # labels = inputs: transformers shifts them, each block predicts 511 tokens
            losses = [float(model(input_ids=b[None], labels=b[None]).loss) for b in blocks]
        assert report["loss"][k] == pytest.approx(sum(losses) / len(losses), abs=1e-5)
    card = (out / "README.md").read_text()
    assert f"{data['tokens']:,} predicted tokens ({len(blocks)} windows of 512 tokens, protocol li-shen)" in card


@pytest.mark.parametrize("extra, message", [(["--seq-len", "256"], "drop --seq-len 256"),
                                            (["--max-eval-tokens", "4096"], "drop --max-eval-tokens")])
def test_li_shen_refuses_settings_it_fixes(long_pair, wiki_file, tmp_path, capsys, extra, message):
    from hf_rebasin.cli import main
    assert main(["barrier", *map(str, long_pair), "--protocol", "li-shen", "--data", str(wiki_file), *extra]) == 2
    assert message in capsys.readouterr().err


def test_li_shen_needs_wikitext(long_pair, tmp_path, capsys):
    from hf_rebasin.cli import main
    plain = tmp_path / "plain.txt"
    plain.write_text("no headings here\n" * 100)
    assert main(["barrier", *map(str, long_pair), "--protocol", "li-shen", "--data", str(plain)]) != 0
    assert "no WikiText title line" in capsys.readouterr().err
