"""How much of the evaluation data a method has fitted on, found by shared n-grams rather than identical windows.

The rule is the decontamination rule of GPT-3 and lm-evaluation-harness: an evaluation token is contaminated when a
13-gram of token ids that contains it also occurs in the data fitted on (training, matching, `self` samples,
held-out selection windows).  Both sides are read as token streams (consecutive windows joined), so the same text
shifted by any number of tokens is found.  Memory is bounded by the evaluation side: its n-grams are hashed to
64 bits once and sorted; the fitting side streams through in chunks, each chunk's hashes looked up and dropped.
A character-level vocabulary (CHAR_VOCAB ids or fewer) counts n-grams of CHAR_NGRAM tokens instead: the rule means
13 words, and 13 characters ("        self.") recur in any two texts of one kind.
Images have no n-grams: an evaluation image is shared when the same image with the same label is fitted on."""
from __future__ import annotations

import numpy as np

from ..errors import OptionError
from .eval_data import EvalData

NGRAM = 13
CHAR_VOCAB, CHAR_NGRAM = 512, 64  # 13 words of about five characters
OVERLAP_LIMIT = 0.01  # the share of evaluation tokens (images) above which a run is refused without --allow-overlap
CHUNK_TOKENS = 1 << 20  # fitting-side tokens hashed at a time

_BASE = np.uint64(0x100000001B3)  # odd multiplier of the polynomial hash (mod 2^64)


def _mix(h: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: spreads the polynomial hash over all 64 bits."""
    h = h ^ (h >> np.uint64(30))
    h = h * np.uint64(0xBF58476D1CE4E5B9)
    h = h ^ (h >> np.uint64(27))
    h = h * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


def ngram_hashes(stream: np.ndarray, n: int = NGRAM) -> np.ndarray:
    """64-bit hashes of every n-gram of a 1-D array of token ids (len(stream) - n + 1 of them)."""
    x = np.asarray(stream).astype(np.uint64) + np.uint64(1)
    m = len(x) - n + 1
    if m <= 0:
        return np.zeros(0, np.uint64)
    h = np.zeros(m, np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            h = h * _BASE + x[j:j + m]
        return _mix(h)


def token_overlap(fit_chunks, evaluated: np.ndarray, n: int = NGRAM) -> tuple[int, int]:
    """(evaluation tokens covered by an n-gram that also occurs in the fitting stream, evaluation tokens).
    fit_chunks: consecutive pieces of the fitting stream (1-D token-id arrays); n-grams across pieces are kept."""
    evaluated = np.asarray(evaluated).reshape(-1)
    hashes = ngram_hashes(evaluated, n)
    if len(hashes) == 0:
        return 0, len(evaluated)
    unique, where = np.unique(hashes, return_inverse=True)
    found = np.zeros(len(unique), bool)
    carry = np.zeros(0, evaluated.dtype)
    for chunk in fit_chunks:
        stream = np.concatenate([carry, np.asarray(chunk).reshape(-1).astype(evaluated.dtype, copy=False)])
        fitted = ngram_hashes(stream, n)
        if len(fitted):
            at = np.searchsorted(unique, fitted).clip(max=len(unique) - 1)
            found[at[unique[at] == fitted]] = True
        carry = stream[-(n - 1):] if n > 1 else stream[:0]
    starts = found[where]  # n-gram k covers tokens k .. k + n - 1
    covered = np.zeros(len(evaluated), bool)
    for j in range(n):
        covered[j:j + len(starts)] |= starts
    return int(covered.sum()), len(evaluated)


def ngram_length(vocab_size: int | None) -> int:
    return CHAR_NGRAM if vocab_size is not None and vocab_size <= CHAR_VOCAB else NGRAM


def _row_chunks(data: EvalData):
    rows = max(1, CHUNK_TOKENS // max(1, data.inputs.shape[-1]))
    for start in range(0, len(data.inputs), rows):
        yield data.inputs[start:start + rows].numpy()


def measure(fit: EvalData, evaluated: EvalData, vocab_size: int | None = None) -> dict:
    """The overlap record of barrier.json: the share of `evaluated` that `fit` covers, and how it was counted."""
    if evaluated.task in ("causal-lm", "masked-lm"):
        from .eval_data import EvalData, tokens_of
        n = ngram_length(vocab_size)
        fit = EvalData(fit.task, tokens_of(fit)) if fit.task == "masked-lm" else fit
        covered, total = token_overlap(_row_chunks(fit), tokens_of(evaluated).numpy(), n)
        return {"rule": f"shared {n}-grams of token ids", "share": covered / max(total, 1), "covered_tokens": covered,
                "eval_tokens": total, "fit_tokens": int(fit.inputs.numel())}
    from .splits import example_digests
    fitted = set(example_digests(fit))
    shared = sum(digest in fitted for digest in example_digests(evaluated))
    return {"rule": "identical image and label", "share": shared / max(len(evaluated.inputs), 1),
            "covered_examples": shared, "eval_examples": len(evaluated.inputs), "fit_examples": len(fit.inputs)}


def check_overlap(fit: EvalData, evaluated: EvalData, *, method: str, fitted_on: str, allow: bool,
                  vocab_size: int | None = None) -> tuple[dict, list]:
    """(the overlap record, notes) of a method that fits on `fit` and is evaluated on `evaluated`; a share above
    OVERLAP_LIMIT is refused by name unless `allow` (--allow-overlap), and then recorded as allowed."""
    record = {**measure(fit, evaluated, vocab_size), "limit": OVERLAP_LIMIT}
    share, unit = record["share"], "tokens" if "eval_tokens" in record else "images"
    if share <= OVERLAP_LIMIT:
        return record, []
    what = (f"{100 * share:.1f} % of the evaluation {unit} (--data) are in the data it fits on ({fitted_on}; "
            f"{record['rule']})")
    if not allow:
        raise OptionError(f"--method {method} would fit on its own evaluation data: {what}, over the "
                          f"{100 * OVERLAP_LIMIT:g} % limit, so the barrier would be in-sample. Pass disjoint data, "
                          "or --allow-overlap to proceed and record it")
    record["allowed"] = True
    return record, [f"--allow-overlap: {what}; the reported barrier is partly in-sample"]
