"""Tiny random-init models of every supported variant (tests, demos, size benchmarks).

``make_tiny(kind, path, seed)`` writes a checkpoint folder in the Hub layout of its library.
Weights are drawn so that every parameter matters (norm gains away from 1, non-zero biases,
unit-scale activations), which is what makes exactness tests able to fail."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from .requirements import import_optional


def kinds() -> tuple[str, ...]:
    """Every tiny variant of every registered adapter (each adapter declares its own)."""
    from .adapters import tiny_variants
    return tuple(tiny_variants())


def adapter_of(kind: str):
    from .adapters import tiny_variants
    return tiny_variants()[kind]


def is_image_model(kind: str) -> bool:
    from .sources.backends import BACKENDS
    return BACKENDS[adapter_of(kind).backend].task == "image-classification"


def randomise_(model: torch.nn.Module, seed: int, unit_gain: float = 1.0) -> None:
    """Redraw every parameter: gains in [0.5, 1.5], biases ~ N(0, 0.1^2), matrices ~ N(0, 1/fan_in).
    unit_gain: the stored norm weight that means a gain of 1 (0 where the class multiplies by 1 + w: Gemma)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if param.dim() == 1 and leaf == "weight":  # norm gains
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5 - (1.0 - unit_gain))
            elif param.dim() == 1 and leaf == "gamma":  # LayerScale
                param.copy_(torch.rand(param.shape, generator=gen) * 0.5 + 0.25)
            elif param.dim() == 1:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            elif "embed" in name or "wte" in name or "wpe" in name or name.endswith(("cls_token", "reg_token")):
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))
            else:
                fan_in = param[0].numel() if "patch_embed" in name else param.shape[-1]
                if "c_attn" in name or "c_fc" in name or "c_proj" in name:  # Conv1D: (in, out)
                    fan_in = param.shape[0]
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(fan_in))


def build_tiny(kind: str, seed: int = 0) -> torch.nn.Module:
    adapter = adapter_of(kind)
    torch.manual_seed(seed)
    if adapter.backend == "timm":
        timm = import_optional("timm")
        model = timm.create_model(adapter.timm_name, pretrained=False, **adapter.tiny_config(kind))
    else:
        model = model_from_config(adapter, adapter.tiny_config(kind))
    randomise_(model, seed, getattr(adapter, "unit_gain", 1.0))
    return model.eval()


def model_from_config(adapter, config) -> torch.nn.Module:
    """A randomly initialised transformers model of the adapter's class (a causal LM by the Auto class, others by
    the class the adapter names)."""
    import transformers
    if adapter.task is None:
        return transformers.AutoModelForCausalLM.from_config(config)
    return getattr(transformers, adapter.architecture)(config)


def example_labels(task: str, inputs: torch.Tensor, n_out: int, gen: torch.Generator) -> torch.Tensor | None:
    """Labels for example inputs of a task: none for causal LMs (the next token), a class per image, and for masked
    LMs the token itself at about a third of the positions (at least one per window), -100 elsewhere."""
    if task == "causal-lm":
        return None
    if task == "masked-lm":
        from .sources.masking import example_labels as masked
        return masked(inputs, gen)
    return torch.randint(0, n_out, (len(inputs),), generator=gen)


def tiny_tokenizer(vocab_size: int = 97, mask: bool = False):
    """A deterministic character-level tokenizer (the most frequent characters of a few stdlib modules'
    source, then <unk>) whose vocabulary fits the tiny LMs, so that they can be run on real text; `mask`: with a
    mask token <mask> (id 2, for masked LMs)."""
    import collections
    import difflib
    import inspect
    import json

    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast
    counts = collections.Counter("".join(inspect.getsource(m) for m in (json, difflib, inspect)))
    special = ["<unk>", "<|endoftext|>"] + (["<mask>"] if mask else [])
    chars = sorted(counts, key=lambda c: (-counts[c], c))[: vocab_size - len(special)]
    vocab = {**{name: k for k, name in enumerate(special)}, **{c: k + len(special) for k, c in enumerate(chars)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.BPEDecoder()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>",
                                   **({"mask_token": "<mask>"} if mask else {}))


def make_tiny(kind: str, path: str | Path, seed: int = 0) -> Path:
    """Write a tiny random model of the given kind to path (Hub layout, LMs with a tokenizer)."""
    path = Path(path)
    adapter, model = adapter_of(kind), build_tiny(kind, seed)
    if adapter.backend == "timm":
        from timm.models import save_for_hf
        save_for_hf(model, str(path), model_args=adapter.tiny_config(kind), safe_serialization=True)
    else:
        model.save_pretrained(path, safe_serialization=True)
        tiny_tokenizer(model.config.vocab_size, mask=adapter.task == "masked-lm").save_pretrained(path)
    return path


def example_inputs(kind: str, batch: int = 2, seq: int = 12, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    config = adapter_of(kind).tiny[kind]
    if is_image_model(kind):
        return torch.randn(batch, 3, config["img_size"], config["img_size"], generator=gen)
    return torch.randint(0, config["vocab_size"], (batch, seq), generator=gen)


def outputs(model: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """Logits of an LM (token ids in) or a classifier (images in)."""
    with torch.no_grad():
        if inputs.is_floating_point():
            return model(inputs)
        from .sources.models import lm_logits
        return lm_logits(model(input_ids=inputs))
