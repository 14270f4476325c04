"""What `hf-rebasin inspect MODEL` shows: architecture, adapter, sizes, norm eps and the symmetry group
hf-rebasin will use for the model, from its config alone (no weights are loaded)."""
from __future__ import annotations

from .requirements import import_optional
from .sources.backends import TimmBackend, backend_of, read_config_json


def describe(source: str) -> dict:
    """Everything inspect shows, from the config alone (the model is built on the meta device).  A source that is
    no model (a misspelt folder, the Hub unreachable) is refused before torch is imported."""
    hub_config = read_config_json(str(source))
    backend = backend_of(hub_config)
    import torch

    from .adapters import get_adapter
    from .core.symmetry import describe_group
    if backend.name == "timm":
        timm = import_optional("timm")
        with torch.device("meta"):
            model = timm.create_model(TimmBackend.timm_name(str(source)), pretrained=False)
        adapter, config = get_adapter(type(model).__name__), model
    else:
        import transformers
        adapter = get_adapter((hub_config.get("architectures") or [""])[0])
        config = transformers.AutoConfig.from_pretrained(str(source))
        with torch.device("meta"):
            model = getattr(transformers, adapter.architecture)(config)
    spec = adapter.spec(config)
    return {
        "source": str(source), "architecture": adapter.architecture, "library": backend.name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "d_model": spec.d_model, "layers": spec.n_layers, "heads": spec.n_heads, "kv_heads": spec.n_kv_heads,
        "head_dim": spec.head_dim, "ffn_dim": spec.ffn_dim, "glu": spec.glu,
        **({"experts_per_layer": spec.n_experts, "expert_dim": spec.expert_dim, "top_k": spec.top_k,
            "shared_experts": int(spec.shared_expert)} if spec.n_experts else {}),
        ("vocab_size" if spec.token_embedding else "num_classes"): spec.n_out,
        "rotary_dims": spec.rotary_dims, "norm_eps": adapter.norm_eps(config),
        "context_length": adapter.context_length(config),
        "symmetry_group": describe_group(spec), "notes": list(spec.notes),
        # what two models of this class must agree in to be aligned, by meaning (any spelling of the config)
        "shared_settings": [f"{key}: {value}" for key, value in adapter.config_facts(config).items()],
        **({"task": adapter.task, "refused": adapter.refused(config)} if adapter.task else {}),
    }
