"""The held-out data of a merge (and learned matching's training data): token windows of a text spec or a
token file for a language model, preprocessed images for a timm classifier, with the checks of ``--seq-len``
against the model's context.  What the barrier (evaluation/barrier.py) and the matching methods read."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import OptionError, UserError

if TYPE_CHECKING:
    from torch import Tensor

    from .models import Loaded


@dataclass
class EvalData:
    task: str  # "causal-lm", "masked-lm" or "image-classification"
    inputs: Tensor  # token windows (n, seq_len) or images (n, C, H, W); training windows may be a TokenWindows
    labels: Tensor | None = None  # class labels for images; masked-LM: the token to predict, -100 where none
    info: dict | None = None
    # the document each example's first token belongs to, where the data records it (a protocol that joins
    # documents without an EOS token); else documents are found by EOS tokens (evaluation/intervals.units_of)
    units: list[int] | None = None


def load_eval_data(spec: str, template: Loaded, *, seq_len: int | None, max_tokens: int | None,
                   max_examples: int | None, text_field: str = "text", flag: str = "--data") -> EvalData:
    """Token windows (language models) or preprocessed images (timm) of a data spec, for the template."""
    from .data import load_token_windows, read_images
    from .token_files import is_token_file, open_token_windows
    if template.task == "image-classification":
        cfg = template.backend.preprocessing(template.config)
        images, labels, info = read_images(spec, input_size=tuple(cfg["input_size"]), mean=tuple(cfg["mean"]),
                                           std=tuple(cfg["std"]), max_examples=max_examples)
        return EvalData("image-classification", images, labels, info)
    seq_len = seq_len or default_seq_len(template)
    check_seq_len(seq_len, template)
    cap = "--max-train-tokens" if flag == "--train-data" else "--max-eval-tokens"
    if is_token_file(spec):  # training data stays memory-mapped; evaluation data is small and read at once
        try:
            tokenizer = template.backend.tokenizer(template.folder)
        except UserError:  # a model without a tokenizer: the ids are still checked against its embedding
            tokenizer = None
        windows, info = open_token_windows(spec, seq_len, template.config.vocab_size, max_tokens, flag, tokenizer)
        if template.task == "masked-lm":
            return masked(windows[:], info, tokenizer, template)
        return EvalData("causal-lm", windows if flag == "--train-data" else windows[:], None, info)
    tokenizer = template.backend.tokenizer(template.folder)
    windows, info = load_token_windows(spec, tokenizer, seq_len, max_tokens, text_field=text_field,
                                       max_tokens_flag=cap)
    if template.task == "masked-lm":
        return masked(windows, info, tokenizer, template)
    return EvalData("causal-lm", windows, None, info)


def masked(windows, info: dict, tokenizer, template: Loaded) -> EvalData:
    """Masked-LM data: the windows masked once, by the fixed seed of sources/masking.py (the same masks at every
    point and for every method), the record in info["masking"] (barrier.json's data)."""
    from .masking import mask_token_id, mask_windows, special_ids
    mask_id = mask_token_id(tokenizer, template.source)
    inputs, labels, record = mask_windows(windows, mask_id, template.config.vocab_size, special_ids(tokenizer))
    return EvalData("masked-lm", inputs, labels, {**info, "masking": record})


def tokens_of(data: EvalData):
    """The token windows of language-model data as written (masked-LM data: before masking)."""
    if data.task == "masked-lm":
        from .masking import original_tokens
        return original_tokens(data.inputs, data.labels)
    return data.inputs


def default_seq_len(template: Loaded) -> int:
    return min(512, template.adapter.context_length(template.config) or 512)


def check_seq_len(seq_len: int, template: Loaded) -> None:
    check_context(seq_len, template.adapter.context_length(template.config))


def check_context(seq_len: int, context: int | None) -> None:
    if context is not None and seq_len > context:
        raise OptionError(f"--seq-len {seq_len} is longer than the model's context ({context} tokens)")
