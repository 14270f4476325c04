"""``hf-rebasin inspect MODEL``: architecture, adapter, sizes and the symmetry group that will be used."""
from __future__ import annotations

import json

import torch

from .adapters import get_adapter
from .models import library_of, read_config_json, _timm_name
from .symmetry import describe_group


def describe(source: str) -> dict:
    """Everything inspect shows, from the config alone (weights are not loaded)."""
    hub_config = read_config_json(source)
    if library_of(hub_config) == "timm":
        import timm
        with torch.device("meta"):
            model = timm.create_model(_timm_name(source), pretrained=False)
        adapter, config = get_adapter(type(model).__name__), model
        eps = float(model.blocks[0].norm1.eps)
    else:
        import transformers
        architectures = hub_config.get("architectures") or [""]
        adapter = get_adapter(architectures[0])
        config = transformers.AutoConfig.from_pretrained(source)
        with torch.device("meta"):
            model = getattr(transformers, adapter.architecture)(config)
        eps = next(float(getattr(config, k)) for k in ("layer_norm_eps", "rms_norm_eps", "layer_norm_epsilon")
                   if hasattr(config, k)) if adapter.architecture != "OlmoForCausalLM" else 1e-5
    spec = adapter.spec(config)
    return {
        "source": source, "architecture": adapter.architecture, "library": adapter.library,
        "parameters": sum(p.numel() for p in model.parameters()),
        "d_model": spec.d_model, "layers": spec.n_layers, "heads": spec.n_heads, "kv_heads": spec.n_kv_heads,
        "head_dim": spec.head_dim, "ffn_dim": spec.ffn_dim, "glu": spec.glu,
        ("vocab_size" if spec.token_embedding else "num_classes"): spec.n_out,
        "rotary_dims": spec.rotary_dims, "norm_eps": eps,
        "symmetry_group": describe_group(spec), "notes": list(spec.notes),
    }


def run(args) -> int:
    info = describe(args.model)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    width = max(len(k) for k in info)
    for key, value in info.items():
        if isinstance(value, list):
            print(f"{key}:")
            for line in value:
                print(f"  - {line}")
        else:
            shown = f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else value
            print(f"{key:<{width}}  {shown}")
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("inspect", help="show a model's architecture, sizes and symmetry group")
    parser.add_argument("model", help="Hugging Face Hub id or local folder")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(func=run)
