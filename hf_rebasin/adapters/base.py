"""What an adapter is: everything hf-rebasin knows about one architecture, in one class.

An adapter converts a checkpoint's state dict to the canonical graph and back (per layer, so that a
layer can be converted on its own), and says what the rest of the package needs to know about the
architecture: its library (backend), norm eps and where the config keeps it, context length, the config
fields two mergeable models must share, the modules activation matching listens to, and the tiny
variants the tests build.  Adapters register themselves (``@register``); adding an architecture is
adding one file to this folder."""
from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from ..core.canonical import Graph, Spec
from ..errors import ModelLoadError, UnsupportedModelError

REGISTRY: dict[str, Adapter] = {}


def register(cls: type[Adapter]) -> type[Adapter]:
    """Class decorator: make the adapter known under its architecture name."""
    REGISTRY[cls.architecture] = cls()
    return cls


class Adapter:
    """Base class; an architecture overrides the conversion methods and the facts below."""

    architecture: ClassVar[str]  # class name as in config.architectures / timm's model class
    backend: ClassVar[str] = "transformers"  # "transformers" or "timm" (see backends.py)
    # checkpoint keys that carry no weights (buffers some versions save), by suffix
    ignored_suffixes: ClassVar[tuple[str, ...]] = ()
    # other names checkpoint files give a parameter: {name in the model class: (names in files, ...)}
    checkpoint_aliases: ClassVar[dict[str, tuple[str, ...]]] = {}
    # config fields that must be equal for two models to be aligned (beyond the Spec's shapes)
    compatibility_fields: ClassVar[tuple[str, ...]] = ()
    # timm model_args that only say whether some biases exist (the canonical form always has them, the export
    # switches them on): two models differing in them have the same canonical structure and align
    bias_args: ClassVar[tuple[str, ...]] = ()
    # module paths, with {i} for the layer, whose INPUT is: the residual stream entering block i ("block"),
    # the concatenated head outputs ("attn_out"), the FFN hidden activations ("ffn_hidden"), the stream
    # entering the final norm ("final") -- for activation matching
    modules: ClassVar[dict[str, str]] = {}
    # tiny variants for tests and demos: name -> config keyword arguments (timm: create_model arguments)
    tiny: ClassVar[dict[str, dict]] = {}

    # --- facts read from a config ------------------------------------------------------------------
    def spec(self, config) -> Spec:
        raise NotImplementedError

    def norm_eps(self, config) -> float:
        raise NotImplementedError

    def context_length(self, config) -> int | None:
        """Longest token sequence the model takes (None for image models)."""
        return None

    def eps_config_changes(self, eps: float) -> dict:
        """Config changes that set the exported norm eps (empty where the class fixes it)."""
        return {}

    def tiny_config(self, variant: str):
        """The config (transformers) or create_model arguments (timm) of a tiny variant."""
        raise NotImplementedError

    # --- conversion, per part --------------------------------------------------------------------------
    def outside_to_canonical(self, read: StateReader, config, spec: Spec) -> dict[str, Tensor]:
        """Canonical tensors outside the layers: embed.*, head.*, final_norm.bias."""
        raise NotImplementedError

    def layer_to_canonical(self, read: StateReader, config, spec: Spec, i: int) -> dict[str, Tensor]:
        """Canonical tensors of layer i (layers.i.*)."""
        raise NotImplementedError

    def outside_from_canonical(self, params: dict[str, Tensor], config, spec: Spec) -> dict[str, Tensor]:
        raise NotImplementedError

    def layer_from_canonical(self, params: dict[str, Tensor], config, spec: Spec, i: int) -> dict[str, Tensor]:
        raise NotImplementedError

    def export_config_changes(self, graph: Graph, config) -> dict:
        """Config changes the export needs (untied embeddings, biases, the norm eps)."""
        return self.eps_config_changes(graph.norm_eps) if graph.spec.scale_exact else {}

    # --- whole models ---------------------------------------------------------------------------------
    def to_canonical(self, state_dict: dict[str, Tensor], config, source: str = "the checkpoint") -> Graph:
        spec = self.spec(config)
        read = StateReader(state_dict, self.architecture, source)
        params = self.outside_to_canonical(read, config, spec)
        for i in range(spec.n_layers):
            params.update(self.layer_to_canonical(read, config, spec, i))
        read.finish(self.ignored_suffixes)
        return Graph(spec, params, self.norm_eps(config))

    def from_canonical(self, graph: Graph, config) -> tuple[dict[str, Tensor], dict]:
        """(state dict of the original class, config changes)."""
        spec, params = graph.spec, graph.params
        state_dict = self.outside_from_canonical(params, config, spec)
        for i in range(spec.n_layers):
            prefix = f"layers.{i}."
            state_dict.update(self.layer_from_canonical(
                {k: v for k, v in params.items() if k.startswith(prefix)}, config, spec, i))
        return state_dict, self.export_config_changes(graph, config)

    def norm_modules(self, model: nn.Module) -> list[tuple[nn.Module, str]]:
        """(module, attribute) of every norm epsilon of a built model (learned matching sets it, since
        the residual scale g is exact only with eps scaled by g^2)."""
        out = []
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                out.append((module, "eps"))
            elif isinstance(getattr(module, "variance_epsilon", None), float):
                out.append((module, "variance_epsilon"))
        return out


class StateReader:
    """A state dict read key by key: records what was read, so that nothing is silently dropped, and
    refuses non-finite weights naming the checkpoint's own key (`checked`: the caller has already read every
    weight for that, as a checkpoint's files are once when a merge opens them)."""

    def __init__(self, state_dict: dict[str, Tensor], architecture: str, source: str = "the checkpoint",
                 checked: bool = False):
        self.sd, self.architecture, self.source, self.taken = state_dict, architecture, source, set()
        self.checked = checked

    def __call__(self, key: str) -> Tensor:
        self.taken.add(key)
        value = self.sd[key]
        if not value.is_floating_point():
            return value
        value = value.to(torch.float32, copy=True)  # never a view of a memory-mapped file
        if not self.checked and value.device.type != "meta" and not bool(torch.isfinite(value).all()):
            bad = int((~torch.isfinite(value)).sum())
            raise ModelLoadError(f"{self.source} has non-finite weights (NaN or inf): {bad} value"
                                 f"{'s' if bad > 1 else ''} in {key}")
        return value

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


def linear_in(read: StateReader, prefix: str) -> tuple[Tensor, Tensor | None]:
    """An nn.Linear as (W, b) in row-vector form: W is (d_in, d_out)."""
    return read(prefix + ".weight").T, read.get(prefix + ".bias")


def safe_divide(numerator: Tensor, gain: Tensor, floor: float = 1e-12) -> Tensor:
    """numerator / gain elementwise, with gains of magnitude below floor replaced by ±floor
    (their reader rows are scaled by the same tiny gain, so the product stays right)."""
    sign = torch.where(gain < 0, -1.0, 1.0)
    return numerator / torch.where(gain.abs() < floor, sign * floor, gain)


def filled(like: Tensor, size: int, value: float) -> Tensor:
    """A (size,) vector of `value` on the device and in the dtype of `like` (norm weights of an export)."""
    return torch.full((size,), value, dtype=like.dtype, device=like.device)
