"""What an adapter is: plain functions from a checkpoint's state dict to the canonical graph and back."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from ..canonical import Graph, Spec


class UnsupportedModelError(ValueError):
    """The model's class or one of its features is outside what hf-rebasin can align exactly."""


@dataclass(frozen=True)
class Adapter:
    architecture: str  # class name as in config.architectures / timm's model class
    library: str  # "transformers" or "timm"
    spec: Callable[[Any], Spec]  # config -> Spec
    to_canonical: Callable[[dict[str, Tensor], Any], Graph]  # (state_dict, config) -> Graph
    from_canonical: Callable[[Graph, Any], tuple[dict[str, Tensor], dict]]  # -> (state_dict, config changes)
    # module paths (with {i} for the layer) whose INPUT is: the residual stream entering layer i ("block"),
    # the concatenated head outputs ("attn_out"), the FFN hidden activations ("ffn_hidden") -- for activation matching
    modules: dict[str, str] = field(default_factory=dict)


class StateReader:
    """A state dict that records which keys were read, so that nothing is silently dropped."""

    def __init__(self, state_dict: dict[str, Tensor], architecture: str):
        self.sd, self.architecture, self.taken = state_dict, architecture, set()

    def __call__(self, key: str) -> Tensor:
        self.taken.add(key)
        return self.sd[key].to(torch.float32) if self.sd[key].is_floating_point() else self.sd[key]

    def get(self, key: str) -> Tensor | None:
        return self(key) if key in self.sd else None

    def tied(self, source: str, alias: str) -> Tensor:
        """Read a tied weight through its source key; the alias key (same tensor) counts as read."""
        self.taken.add(alias)
        return self(source)

    def has(self, key: str) -> bool:
        return key in self.sd

    def finish(self, ignore: tuple[str, ...] = ()) -> None:
        left = sorted(k for k in self.sd if k not in self.taken and not k.endswith(ignore))
        if left:
            shown = ", ".join(left[:6]) + (f" (+{len(left) - 6} more)" if len(left) > 6 else "")
            raise UnsupportedModelError(
                f"{self.architecture}: parameters hf-rebasin does not know how to align: {shown}. "
                "This variant of the architecture is not supported (aligning it would silently drop these).")


def linear_in(reader: StateReader, prefix: str) -> tuple[Tensor, Tensor | None]:
    """An nn.Linear as (W, b) in row-vector form: W is (d_in, d_out)."""
    return reader(prefix + ".weight").T, reader.get(prefix + ".bias")


def safe_divide(numerator: Tensor, gain: Tensor, floor: float = 1e-12) -> Tensor:
    """numerator / gain elementwise, with gains of magnitude below floor replaced by ±floor
    (their reader rows are scaled by the same tiny gain, so the product stays right)."""
    sign = torch.where(gain < 0, -1.0, 1.0)
    return numerator / torch.where(gain.abs() < floor, sign * floor, gain)
