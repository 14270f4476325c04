"""Tiny random-init models of every supported variant (tests, demos, size benchmarks).

``make_tiny(kind, path, seed)`` writes a checkpoint folder in the Hub layout of its library.
Weights are drawn so that every parameter matters (norm gains away from 1, non-zero biases,
unit-scale activations), which is what makes exactness tests able to fail."""
from __future__ import annotations

import math
from pathlib import Path

import torch

LM_CONFIGS: dict[str, tuple[str, dict]] = {
    "gpt_neox": ("GPTNeoXConfig", dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                                       intermediate_size=64, vocab_size=97, max_position_embeddings=64,
                                       rotary_pct=0.5, use_parallel_residual=True)),
    "gpt_neox_sequential": ("GPTNeoXConfig", dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                                                  intermediate_size=64, vocab_size=97, max_position_embeddings=64,
                                                  rotary_pct=0.25, use_parallel_residual=False,
                                                  attention_bias=False)),
    "llama_gqa_tied": ("LlamaConfig", dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                           num_hidden_layers=2, intermediate_size=48, vocab_size=97,
                                           max_position_embeddings=64, tie_word_embeddings=True)),
    "llama_untied_bias": ("LlamaConfig", dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
                                              num_hidden_layers=2, intermediate_size=48, vocab_size=97,
                                              max_position_embeddings=64, tie_word_embeddings=False,
                                              attention_bias=True, mlp_bias=True, head_dim=16)),
    "olmo": ("OlmoConfig", dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=48,
                                vocab_size=97, max_position_embeddings=64, tie_word_embeddings=True,
                                pad_token_id=1, bos_token_id=None, eos_token_id=2)),
    "olmo_clip_qkv": ("OlmoConfig", dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                                         intermediate_size=48, vocab_size=97, max_position_embeddings=64,
                                         tie_word_embeddings=False, clip_qkv=0.8, pad_token_id=1,
                                         bos_token_id=None, eos_token_id=2)),
    "gpt2": ("GPT2Config", dict(n_embd=32, n_head=4, n_layer=2, vocab_size=97, n_positions=64)),
}

VIT_CONFIGS: dict[str, dict] = {
    "vit": dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, mlp_ratio=2.0, num_classes=10,
                init_values=0.5),
    "vit_avgpool": dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, mlp_ratio=2.0,
                        num_classes=10, class_token=False, global_pool="avg", reg_tokens=1),
}

KINDS = tuple(LM_CONFIGS) + tuple(VIT_CONFIGS)


def randomise_(model: torch.nn.Module, seed: int) -> None:
    """Redraw every parameter: gains in [0.5, 1.5], biases ~ N(0, 0.1^2), matrices ~ N(0, 1/fan_in)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if param.dim() == 1 and leaf == "weight":  # norm gains
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
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
    if kind in VIT_CONFIGS:
        import timm
        model = timm.create_model("vit_tiny_patch16_224", pretrained=False, **VIT_CONFIGS[kind])
    else:
        import transformers
        config_name, kwargs = LM_CONFIGS[kind]
        config = getattr(transformers, config_name)(**kwargs)
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    randomise_(model, seed)
    return model.eval()


def tiny_tokenizer(vocab_size: int = 97):
    """A deterministic character-level tokenizer (the most frequent characters of a few stdlib modules'
    source, then <unk>) whose vocabulary fits the tiny LMs, so that they can be run on real text."""
    import collections
    import difflib
    import inspect
    import json
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast
    counts = collections.Counter("".join(inspect.getsource(m) for m in (json, difflib, inspect)))
    chars = sorted(counts, key=lambda c: (-counts[c], c))[: vocab_size - 2]
    vocab = {"<unk>": 0, "<|endoftext|>": 1, **{c: k + 2 for k, c in enumerate(chars)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.BPEDecoder()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>")


def make_tiny(kind: str, path: str | Path, seed: int = 0) -> Path:
    """Write a tiny random model of the given kind to path (Hub layout, LMs with a tokenizer)."""
    path = Path(path)
    model = build_tiny(kind, seed)
    if kind in VIT_CONFIGS:
        from timm.models import save_for_hf
        save_for_hf(model, str(path), model_args=VIT_CONFIGS[kind], safe_serialization=True)
    else:
        model.save_pretrained(path, safe_serialization=True)
        tiny_tokenizer(LM_CONFIGS[kind][1]["vocab_size"]).save_pretrained(path)
    return path


def example_inputs(kind: str, batch: int = 2, seq: int = 12, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind in VIT_CONFIGS:
        size = VIT_CONFIGS[kind]["img_size"]
        return torch.randn(batch, 3, size, size, generator=gen)
    return torch.randint(0, LM_CONFIGS[kind][1]["vocab_size"], (batch, seq), generator=gen)


def outputs(model: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """Logits of an LM (token ids in) or a classifier (images in)."""
    with torch.no_grad():
        if inputs.is_floating_point():
            return model(inputs)
        return model(input_ids=inputs).logits
