"""Writing a canonical graph as a checkpoint of the ORIGINAL class (loads with the stock ``from_pretrained`` /
``timm.create_model``): safetensors shards streamed part by part, with the config, tokenizer or preprocessing
beside them."""
from __future__ import annotations

from pathlib import Path

import torch

from ..sources.models import AveragedCheckpoints, Loaded, config_changes, own_tensors, state_dict_parts
from .io import DEFAULT_SHARD_BYTES, ShardWriter


def save(graph, template: Loaded, out_dir: str | Path, *, dtype: torch.dtype | None = None,
         max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """Write the graph as a checkpoint of the template's class (loads with the stock loader), streamed part by
    part into safetensors shards of at most max_shard_bytes, in `dtype` (default: the source's stored dtype;
    arithmetic is fp32, the cast is last), with the config, tokenizer or preprocessing beside it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = dtype or template.files.dtype
    with ShardWriter(out_dir, "model", max_shard_bytes) as writer:
        averaged = isinstance(graph, AveragedCheckpoints)  # the averaged tensors themselves, config unchanged
        for part in graph.checkpoint_parts() if averaged else state_dict_parts(graph, template):
            # under the names the class's own save_pretrained writes, in the layout of the source's files
            part = template.adapter.to_files(part, None if averaged else template.files)
            for name, value in own_tensors(part, torch.float32).items():
                writer.add(name, value.to(dtype))
    changes = config_changes(graph, template)
    template.backend.write_companions(template, changes, dtype, out_dir)


def save_trained(model: torch.nn.Module, graph, template: Loaded, out_dir: str | Path, *,
                 dtype: torch.dtype | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """Write a model built from `graph` (instantiate) whose weights were then trained (merge --refine-steps): the
    tensors save() would write for the graph, by the same names and in the same configuration, with the model's
    trained values."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = dtype or template.files.dtype
    saved_names = template.adapter.saved_names
    module_names = {saved: name for name, saved in saved_names.items()}
    trained = model.state_dict()
    with ShardWriter(out_dir, "model", max_shard_bytes) as writer:
        averaged = isinstance(graph, AveragedCheckpoints)
        for part in graph.checkpoint_parts() if averaged else state_dict_parts(graph, template):
            names = {name: name if name in trained else module_names.get(name, name) for name in part}
            for name, value in own_tensors({name: trained[own] for name, own in names.items()}, torch.float32).items():
                writer.add(saved_names.get(name, name), value.to(dtype))
    template.backend.write_companions(template, config_changes(graph, template), dtype, out_dir)


def export(graph, template: Loaded, out_dir: str | Path, **options) -> None:
    save(graph, template, out_dir, **options)
