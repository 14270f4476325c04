"""Random-init Pythia models built on the device directly, for benchmarks/gpu_check.py.

The model is built on the meta device (parameters without memory, buffers real: hf_rebasin's `empty_weights`),
then every parameter is drawn on the device itself from a generator there: no copy of the model is ever made on
the host, and nothing is written to disk.  Initialisation as benchmarks/merge_size.py writes its checkpoints:
weights ~ N(0, 0.02), norm gains 1 ± 0.1, biases ~ N(0, 0.01).  Its canonical graph is computed on the device by
the adapter (`to_canonical`) and then kept where learned matching reads it from (the host, as a pipeline run keeps
its graphs: only the learning copies go to the device).

The template (`template_for`) is what hf_rebasin.sources.models.load returns for a checkpoint folder, made from
the config alone: a folder holding only config.json (no weight files: learned matching never reads the
template's weights)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from merge_size import PYTHIA, config_of  # noqa: E402

from hf_rebasin.core.canonical import Graph  # noqa: E402
from hf_rebasin.sources.backends import backend_of, empty_weights  # noqa: E402
from hf_rebasin.sources.models import Loaded  # noqa: E402

# the dry-run's shape, beside the published ones: (hidden, layers, heads, FFN, vocabulary) as merge_size.PYTHIA
PYTHIA.setdefault("tiny", (64, 2, 4, 256, 512))


def template_for(name: str, folder: Path) -> Loaded:
    """A Loaded for the published config `name` (as models.load reads a folder), from a folder holding its
    config.json alone."""
    import json
    folder.mkdir(parents=True, exist_ok=True)
    config_of(name).save_pretrained(folder)
    hub_config = json.loads((folder / "config.json").read_text())
    backend = backend_of(hub_config)
    adapter, config = backend.configure(folder, hub_config)
    return Loaded(f"pythia-{name} (random init, seed per model)", adapter, backend, config, hub_config, folder, None)


def initial_value(name: str, shape: tuple, generator: torch.Generator, device) -> torch.Tensor:
    """A parameter's random initial value, drawn on `device`: biases N(0, 0.01), other vectors (norm gains)
    N(1, 0.1), matrices N(0, 0.02)."""
    value = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
    if name.endswith(".bias"):
        return value.mul_(0.01)
    if len(shape) == 1:
        return value.mul_(0.1).add_(1.0)
    return value.mul_(0.02)


def build_on_device(template: Loaded, seed: int, device) -> nn.Module:
    """A model of the template's class and config, fp32, every parameter drawn on `device` (nothing of it on the
    host), eval mode.  Deterministic in (seed, device)."""
    model = template.backend.build(template, {})  # parameters on meta, buffers real (on the host: small)
    generator = torch.Generator(device=device).manual_seed(seed)
    for module_name, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            full = f"{module_name}.{name}" if module_name else name
            value = initial_value(full, tuple(param.shape), generator, device)
            module._parameters[name] = nn.Parameter(value, requires_grad=False)
    model.to(device)  # the buffers (rotary frequencies)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:
        raise RuntimeError(f"still on the meta device after building: {left[:4]}")
    return model.eval()


def canonical_graph(model: nn.Module, template: Loaded, to: str | torch.device = "cpu") -> Graph:
    """The model's canonical graph (computed where the model is), its tensors then moved to `to`."""
    graph = template.adapter.to_canonical(model.state_dict(), template.config, template.source)
    return graph.replace({k: v.detach().to(to) for k, v in graph.params.items()})


def parameter_count(name: str) -> int:
    """Parameters of the config `name`, counted on the meta device."""
    from transformers import GPTNeoXForCausalLM
    with empty_weights():
        model = GPTNeoXForCausalLM(config_of(name))
    return sum(p.numel() for p in model.parameters())
