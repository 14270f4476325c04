"""Merges at the size of the real Pythia models: two random-init checkpoints with the exact published configs,
stored in fp16 as the Hub's are, merged by the command line.

    .venv/bin/python benchmarks/merge_size.py --configs 14m,70m,160m,410m,1b,6.9b [--work runs/size]

For each config: the two checkpoints are written shard by shard (no script ever holds a whole model; cached
under --work), then `hf-rebasin merge A B --method wm --rounds 2 --lambdas 3 --max-eval-tokens 2048` (--method
raw: no matching, the path and export alone) runs in a
subprocess whose memory is sampled every 0.2 s from /proc (the whole process tree: peak RSS, and peak RssAnon,
which leaves out the memory-mapped source pages the kernel can drop).  Evaluation text: the end of
../shared/data/tinyshakespeare.txt with the GPT-2 tokenizer (Pythia's vocabulary is larger, so every id fits).
Prints a Markdown table for BENCHMARKS.md and writes the rows as JSON.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hf_rebasin.export.io import ShardWriter  # noqa: E402
from hf_rebasin.sources.checkpoints import CheckpointFiles  # noqa: E402

SHARED = REPO.parent / "shared" / "data"
# the published Pythia configs (EleutherAI/pythia-*/config.json): hidden, layers, heads, FFN, vocabulary
PYTHIA = {
    "14m": (128, 6, 4, 512, 50304),
    "31m": (256, 6, 8, 1024, 50304),
    "70m": (512, 6, 8, 2048, 50304),
    "160m": (768, 12, 12, 3072, 50304),
    "410m": (1024, 24, 16, 4096, 50304),
    "1b": (2048, 16, 8, 8192, 50304),
    "1.4b": (2048, 24, 16, 8192, 50304),
    "2.8b": (2560, 32, 32, 10240, 50304),
    "6.9b": (4096, 32, 32, 16384, 50432),
}


def config_of(name: str):
    from transformers import GPTNeoXConfig
    hidden, layers, heads, ffn, vocab = PYTHIA[name]
    return GPTNeoXConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         intermediate_size=ffn, vocab_size=vocab, max_position_embeddings=2048, rotary_pct=0.25,
                         use_parallel_residual=True, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
                         dtype="float16", architectures=["GPTNeoXForCausalLM"])


def random_tensors(config, seed: int):
    """(name, fp16 tensor) of a random-init GPT-NeoX, one tensor at a time, with the Hub's file names
    (embed_out for the head): weights ~ N(0, 0.02), norm gains 1 ± 0.1, biases ~ N(0, 0.01)."""
    gen = torch.Generator().manual_seed(seed)
    d, ffn, vocab = config.hidden_size, config.intermediate_size, config.vocab_size

    def draw(*shape, std=0.02, mean=0.0):
        return (mean + std * torch.randn(*shape, generator=gen)).half()

    yield "gpt_neox.embed_in.weight", draw(vocab, d)
    for i in range(config.num_hidden_layers):
        pre = f"gpt_neox.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            yield pre + norm + ".weight", draw(d, std=0.1, mean=1.0)
            yield pre + norm + ".bias", draw(d, std=0.01)
        for name, shape in (("attention.query_key_value", (3 * d, d)), ("attention.dense", (d, d)),
                            ("mlp.dense_h_to_4h", (ffn, d)), ("mlp.dense_4h_to_h", (d, ffn))):
            yield pre + name + ".weight", draw(*shape)
            yield pre + name + ".bias", draw(shape[0], std=0.01)
    yield "gpt_neox.final_layer_norm.weight", draw(d, std=0.1, mean=1.0)
    yield "gpt_neox.final_layer_norm.bias", draw(d, std=0.01)
    yield "embed_out.weight", draw(vocab, d)


def make_checkpoint(name: str, seed: int, folder: Path, tokenizer: bool = True) -> Path:
    """A random-init checkpoint in fp16 safetensors shards of at most 2 GB, written one tensor at a time (with
    the GPT-2 tokenizer of ../shared/data unless `tokenizer` is False)."""
    if (folder / "config.json").is_file():
        return folder
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    config = config_of(name)
    with ShardWriter(partial, "model", 2 * 10**9) as writer:
        for key, tensor in random_tensors(config, seed):
            writer.add(key, tensor)
    config.save_pretrained(partial)
    for file in (SHARED / "gpt2_tokenizer").iterdir() if tokenizer else ():
        shutil.copy2(file, partial / file.name)
    partial.rename(folder)
    return folder


def tree_memory(pid: int) -> tuple[int, int]:
    """(RSS, RssAnon) in bytes of a process and its descendants."""
    total_rss = total_anon = 0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue
        fields = {line.split(":")[0]: line.split()[1] for line in status.splitlines() if len(line.split()) > 1}
        total_rss += int(fields.get("VmRSS", 0)) * 1024
        total_anon += int(fields.get("RssAnon", 0)) * 1024
        pending += [int(c) for c in children]
    return total_rss, total_anon


def measure(command: list[str], log: Path) -> dict:
    peaks = {"rss": 0, "anon": 0}
    with open(log, "w") as stream:
        start = time.perf_counter()
        process = subprocess.Popen(command, stdout=stream, stderr=subprocess.STDOUT, cwd=REPO)
        done = threading.Event()

        def sample():  # the peaks so far also go to LOG.mem every 10 s: a run cut short keeps its figures
            written = start
            while not done.is_set():
                rss, anon = tree_memory(process.pid)
                peaks["rss"], peaks["anon"] = max(peaks["rss"], rss), max(peaks["anon"], anon)
                if time.perf_counter() - written > 10:
                    written = time.perf_counter()
                    log.with_suffix(".mem").write_text(json.dumps({"elapsed_s": written - start, **peaks}))
                time.sleep(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        code = process.wait()
        done.set()
        sampler.join()
    if code != 0:
        raise SystemExit(f"{' '.join(command)} failed (exit {code}); see {log}")
    return {"wall_s": time.perf_counter() - start, "peak_rss": peaks["rss"], "peak_anon": peaks["anon"]}


def run_one(name: str, work: Path, rounds: int, lambdas: int, max_eval_tokens: int, method: str = "wm") -> dict:
    a = make_checkpoint(name, 0, work / f"pythia-{name}-a")
    b = make_checkpoint(name, 1, work / f"pythia-{name}-b")
    data = work / "heldout.txt"
    if not data.is_file():
        data.write_text((SHARED / "tinyshakespeare.txt").read_text()[-100_000:])
    out = work / f"merged-{name}-{method}"
    command = [str(REPO / ".venv" / "bin" / "hf-rebasin"), "merge", str(a), str(b), "--method", method,
               *(["--rounds", str(rounds)] if method != "raw" else []),  # (raw runs no matching: refused)
               "--lambdas", str(lambdas), "--max-eval-tokens", str(max_eval_tokens), "--data", str(data),
               "--out", str(out), "--force"]
    row = {"config": name, "method": method, **measure(command, work / f"merge-{name}-{method}.log")}
    report = json.loads((out / "barrier.json").read_text())
    row["params"] = sum(math.prod(shape) for shape, _ in CheckpointFiles(a).shapes.values())
    rounds_s = [e["seconds"] for e in report["match_log"] if "seconds" in e]
    row.update(timings=report["timings"], rounds=len(rounds_s), round_s=rounds_s,
               source_bytes=sum(p.stat().st_size for p in a.glob("*.safetensors")),
               export_bytes=sum(p.stat().st_size for p in out.glob("model*.safetensors")),
               export_dtype=json.loads((out / "config.json").read_text()).get("dtype"))
    return row


def markdown(rows: list[dict]) -> str:
    lines = ["| config | method | params | source (fp16) | export | wall | load s | match s | s/round "
             "| s/round per 100M params | barrier s | export s | peak RSS GiB | B/param | peak RssAnon GiB |",
             "|" + "---|" * 15]
    for r in rows:
        per_round = sum(r["round_s"]) / max(1, len(r["round_s"]))
        t = r["timings"]
        lines.append(
            f"| pythia-{r['config']} | {r.get('method', 'wm')} | {r['params'] / 1e6:.0f}M | "
            f"{r['source_bytes'] / 2**30:.2f} GiB | "
            f"{r['export_bytes'] / 2**30:.2f} GiB {r['export_dtype']} | {r['wall_s'] / 60:.1f} min | "
            f"{t['load_s']:.0f} | {t['match_s']:.0f} | {per_round:.1f} | {per_round / r['params'] * 1e8:.2f} | "
            f"{t['barrier_s']:.0f} | {t.get('export_s', 0):.0f} | {r['peak_rss'] / 2**30:.2f} | "
            f"{r['peak_rss'] / r['params']:.1f} | {r['peak_anon'] / 2**30:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="14m,70m,160m,410m,1b")
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "size")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--lambdas", type=int, default=3)
    parser.add_argument("--max-eval-tokens", type=int, default=2048)
    parser.add_argument("--method", default="wm", help="wm (the issue's command) or raw (no matching: the path "
                        "evaluation and export alone)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.configs.split(","):
        rows.append(run_one(name, args.work, args.rounds, args.lambdas, args.max_eval_tokens, args.method))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
    print(markdown(rows))


if __name__ == "__main__":
    main()
