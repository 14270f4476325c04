"""Data sampled from the endpoint models themselves: ``--train-data self`` (learned matching) and
``--match-data self`` (activation matching), for language models.

Every model writes an equal share of the sequences (N models: all of them, the first W mod N one more), and the
file interleaves them (window i comes from model i mod N), so that any prefix of it -- what activation matching
reads -- holds every model's share.  A text starts with the tokenizer's BOS token, else its EOS token (the
document separator of the token protocol, data.token_stream: what a document begins after); an EOS drawn on the
way is kept and sampling goes on into the next document, as the windows of real text run across documents.  A
text runs over CHAIN windows: the first is the start token and ``seq_len - 1`` sampled tokens, each next one
begins with the last CARRIED tokens of the window before and is sampled on from those alone, so that most
windows, like most windows of real text, begin in the middle of a document rather than at its start (measured:
1 token carried did best, BENCHMARKS.md).  A window holds exactly the tokens the model was conditioned on.

Sampling is batched (SAMPLE_BATCH sequences of one model at a time) with the model's KV cache, at temperature T
and nucleus top-p, from one torch.Generator per model seeded by ``--learn-seed``: on one device the same
settings give the same tokens.  The sequences are written once as a token file (token_files.py, the format of
``hf-rebasin tokenize``) in a cache folder, named by a digest of the models' weight digests, the tokenizer's
vocabulary and the sampling settings; a rerun with the same settings reuses it, and a file whose record does not
match its name (edited, or written by another version) is sampled again.

The models are sampled one after the other, each on the device alone and in the learning precision (bf16 on CUDA;
`precision` is part of the settings: other logits, other tokens), its share kept in a temporary file beside the
cache until the last model is done; then the shares are interleaved into the token file."""
from __future__ import annotations

import hashlib
import inspect
import json
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import OptionError
from .eval_data import EvalData
from .token_files import metadata_path, open_token_windows, write_ids

SAMPLE_BATCH = 64  # sequences of one model sampled together; fixed, so that the tokens do not depend on a flag
CHAIN = 8  # windows per sampled text (measured: BENCHMARKS.md, "Self-sampled texts that run over several windows")
CARRIED = 1  # tokens of a window that begin the next one of its text (measured there too)
FORMAT = "hf-rebasin-self-samples/1"


def chain_settings() -> dict:
    """The chain fields of Sampling."""
    return dict(chain=CHAIN, carried=CARRIED if CHAIN > 1 else 0)


@dataclass(frozen=True)
class Sampling:
    """What determines the sampled tokens (all of it goes into the cache file's name and record)."""

    models: tuple[str, ...]  # weight digests, in the order of the merge
    vocabulary_digest: str
    windows: int  # sequences in all
    seq_len: int
    temperature: float
    top_p: float
    seed: int
    start_token: int
    vocab_size: int  # ids are drawn below it: the tokenizer's vocabulary (a model's embedding may have spare rows)
    chain: int = 1  # windows of one sampled text: the first begins at the start token, the next ones continue it
    carried: int = 0  # tokens of a window that begin the next window of its chain (its context when sampled on)
    batch: int = SAMPLE_BATCH
    format: str = FORMAT
    precision: str = "fp32"  # the models' dtype while sampling: "fp32" or "bf16"

    def __post_init__(self):
        if self.chain > 1 and not 0 < self.carried < self.seq_len:
            raise ValueError(f"a chain of windows carries 1 to seq_len - 1 tokens into the next, not {self.carried}")

    def record(self) -> dict:
        """The settings as the cache file's record holds them (fp32 ones as before `precision` was recorded)."""
        fields = asdict(self)
        if fields["precision"] == "fp32":
            del fields["precision"]
        return json.loads(json.dumps(fields))  # as the record reads back (tuples as lists)

    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.record(), sort_keys=True).encode()).hexdigest()[:16]

    def shares(self) -> list[int]:
        n = len(self.models)
        return [self.windows // n + (k < self.windows % n) for k in range(n)]


def weights_digest(files: list[Path]) -> str:
    """Which weights: a hash of the weight files' contents.  A file of a Hugging Face cache snapshot is a link to
    a blob named by its sha256 (LFS files): that name is used and the file is not read."""
    h = hashlib.sha256()
    for file in files:
        target = Path(file).resolve()
        name = target.name
        if len(name) == 64 and all(c in "0123456789abcdef" for c in name):
            h.update(name.encode())
            continue
        with open(target, "rb") as stream:
            h.update(hashlib.file_digest(stream, "sha256").digest())
    return h.hexdigest()[:16]


def start_token(tokenizer) -> int:
    for token in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if token is not None:
            return int(token)
    raise OptionError("`self` sampling starts every sequence with the tokenizer's BOS (else EOS) token, and this "
                      "model's tokenizer has neither: give --train-data / --match-data real text instead")


def draw(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """One token per row of `logits` (batch, vocab): from softmax(logits / T), restricted to the smallest set of
    most probable tokens whose probability reaches top_p (top_p = 1: all)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return torch.multinomial(probs, 1, generator=generator)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the more probable tokens
    sorted_probs = sorted_probs * (before < top_p)  # the most probable token always stays
    return order.gather(-1, torch.multinomial(sorted_probs, 1, generator=generator))


def cache_keyword(model) -> str:
    """The name of the KV cache in the model's forward and output: `cache` in recent transformers, `past_key_values`
    in earlier 5.x releases inside the supported range (5.17, the GPU machines' release, has only that)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def continue_to(model, context: torch.Tensor, sampling: Sampling, generator: torch.Generator, bar=None):
    """`context` (batch, c) continued by sampling to (batch, seq_len), with the model's KV cache."""
    tokens, cache, inputs = [context], None, context
    keyword = cache_keyword(model)
    for _ in range(sampling.seq_len - context.shape[1]):
        out = model(input_ids=inputs, use_cache=True, **{keyword: cache})
        cache = getattr(out, keyword)
        inputs = draw(out.logits[:, -1, :sampling.vocab_size], sampling.temperature, sampling.top_p, generator)
        tokens.append(inputs)
        if bar is not None:
            bar.update(len(inputs))
    return torch.cat(tokens, dim=1)


def text_groups(n: int, sampling: Sampling):
    """(texts, windows) of each group that sample_sequences samples together for `n` windows."""
    for first in range(0, n, sampling.batch * sampling.chain):
        windows = min(sampling.batch * sampling.chain, n - first)
        yield min(sampling.batch, windows), windows


def sample_sequences(model, n: int, sampling: Sampling, generator: torch.Generator, device, bar=None):
    """`n` windows of `model` (LongTensor (rows, seq_len) on the CPU per yield).  SAMPLE_BATCH texts are sampled
    together, `chain` windows each: the first window begins at the start token, each next one with the last
    `carried` tokens of the one before (sampled from afresh, as the model reads a window of real text cut from
    the middle of a document) and goes on for seq_len - carried tokens."""
    for texts, left in text_groups(n, sampling):
        window = torch.full((texts, 1), sampling.start_token, dtype=torch.long, device=device)
        while left > 0:
            window = continue_to(model, window, sampling, generator, bar)
            yield window[:left].cpu()
            left -= texts
            window = window[:, sampling.seq_len - sampling.carried:]


def drawn_tokens(n: int, sampling: Sampling) -> int:
    """How many tokens sample_sequences draws for `n` windows (the progress bar's total)."""
    return sum(texts * (sampling.seq_len - 1 + (-(-windows // texts) - 1) * (sampling.seq_len - sampling.carried))
               for texts, windows in text_groups(n, sampling))


def sample_shares(load_model: Callable[[int], torch.nn.Module], sampling: Sampling, device, progress: bool,
                  folder: Path) -> list[np.ndarray]:
    """Every model's windows (an int32 array (share, seq_len) memory-mapped from `folder` each): model k is loaded by
    `load_model(k)` (on the device, in the sampling precision), sampled, and freed before the next one is loaded."""
    from ..progress import tqdm
    shares = sampling.shares()
    total = sum(drawn_tokens(share, sampling) for share in shares)
    out = []
    with tqdm(total=total, desc="sampling", unit="tok", unit_scale=True, disable=not progress) as bar:
        for k, share in enumerate(shares):
            windows = np.lib.format.open_memmap(folder / f"model-{k}.npy", mode="w+", dtype=np.int32,
                                                shape=(share, sampling.seq_len))
            model = load_model(k)
            generator = torch.Generator(device=device).manual_seed(sampling.seed * 1_000_003 + k)
            row = 0
            for rows in sample_sequences(model, share, sampling, generator, device, bar):
                windows[row:row + len(rows)] = rows.numpy()
                row += len(rows)
            del model
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the next model takes its place
            windows.flush()
            out.append(windows)
    return out


def interleaved(shares: list[np.ndarray], windows: int, block: int = 1024):
    """The models' windows interleaved (window i from model i mod N), as flat id arrays of up to `block` windows."""
    n = len(shares)
    for first in range(0, windows, block):
        yield np.stack([shares[i % n][i // n] for i in range(first, min(first + block, windows))]).reshape(-1)


def peak_device_memory(device) -> dict | None:
    """Peak allocated memory on a CUDA device since the last reset, else None."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return {"what": "torch.cuda.max_memory_allocated", "bytes": int(torch.cuda.max_memory_allocated(device))}


def stored_tokens(path: Path) -> int | None:
    """The number of ids a token file holds (None when it is not a readable .npy)."""
    try:
        return len(np.load(path, mmap_mode="r", allow_pickle=False))
    except (ValueError, OSError):
        return None


def sampled_data(load_model: Callable[[int], torch.nn.Module], sampling: Sampling, tokenizer, folder: str | Path, *,
                 device="cpu", progress: bool = True, flag: str = "--train-data", names: list[str] | None = None,
                 memory_mapped: bool = True, check_writable: Callable[[Path], None] | None = None) -> EvalData:
    """The windows sampled from the models `load_model(k)` returns (transformers causal LMs on `device`, one at a
    time; called only when there is something to sample), from the cache folder when a file with these settings is
    there, else sampled and written there first (`check_writable(folder)` before).  info["peak_memory"]: the
    device's peak while sampling (CUDA)."""
    path = Path(folder).expanduser() / f"self-{sampling.key()}.npy"
    expected = sampling.record()
    meta = metadata_path(path)
    recorded = json.loads(meta.read_text()).get("sampling") if path.is_file() and meta.is_file() else None
    reused = recorded == expected and stored_tokens(path) == sampling.windows * sampling.seq_len
    peak = None
    if not reused:  # a cache folder checked before the run only when it held no samples: proven writable here
        if check_writable is not None:
            check_writable(path.parent)
        record = {"source": "self", "sampling": expected, "models": list(names or [])}
        path.parent.mkdir(parents=True, exist_ok=True)
        if torch.device(device).type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with tempfile.TemporaryDirectory(prefix=".self-shares-", dir=path.parent) as scratch:
            shares = sample_shares(load_model, sampling, device, progress, Path(scratch))
            peak = peak_device_memory(device)
            written = write_ids(interleaved(shares, sampling.windows), tokenizer, path, record,
                                tokenizer_name=(names or [""])[0])
            del shares
        if written["tokens"] != sampling.windows * sampling.seq_len:
            raise RuntimeError(f"sampled {written['tokens']} tokens, expected {sampling.windows * sampling.seq_len}")
    windows, info = open_token_windows(str(path), sampling.seq_len, len(tokenizer), None, flag, tokenizer)
    if len(windows) != sampling.windows:
        raise OptionError(f"{path} holds {len(windows)} windows, not the {sampling.windows} its name stands for: "
                          "delete it (it is sampled again)")
    info.update(spec="self", file=str(path), reused=reused, peak_memory=peak,
                sampling={key: value for key, value in expected.items() if key not in ("models", "format")},
                per_model=sampling.shares())
    for key in ("memory_mapped", "tokenized_from"):
        info.pop(key, None)
    return EvalData("causal-lm", windows if memory_mapped else windows[:], None, info)
