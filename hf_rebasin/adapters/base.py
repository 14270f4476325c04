"""What an adapter is: everything hf-rebasin knows about one architecture, in one class.

An adapter converts a checkpoint's state dict to the canonical graph and back (per layer, so that a
layer can be converted on its own), and says what the rest of the package needs to know about the
architecture: its library (backend), norm eps and where the config keeps it, context length, the config
fields two mergeable models must share, the modules activation matching listens to, and the tiny
variants the tests build.  Adapters register themselves (``@register``); adding an architecture is
adding one file to this folder."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

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
    task: ClassVar[str | None] = None  # what the model computes, where not its backend's task: "masked-lm"
    # checkpoint keys that carry no weights (buffers some versions save), by suffix
    ignored_suffixes: ClassVar[tuple[str, ...]] = ()
    # other names checkpoint files give a parameter: {name in the model class: (names in files, ...)}
    checkpoint_aliases: ClassVar[dict[str, tuple[str, ...]]] = {}
    # the name the class's own save_pretrained writes for a parameter, where it is not the parameter's name:
    # {name in the model class: name in the files it writes} (read as an alias too)
    saved_names: ClassVar[dict[str, str]] = {}
    # timm model_args that only say whether some biases exist (the canonical form always has them, the export
    # switches them on): two models differing in them have the same canonical structure and align
    bias_args: ClassVar[tuple[str, ...]] = ()
    # module paths, with {i} for the layer, whose INPUT is: the residual stream entering block i ("block"),
    # the concatenated head outputs ("attn_out"), the FFN hidden activations ("ffn_hidden"), the stream
    # entering the final norm ("final") -- for activation matching
    modules: ClassVar[dict[str, str]] = {}
    # norms whose gains the canonical form keeps (exported as they are), by a fragment of their parameter names; every
    # other norm is exported with unit gain, which a stored weight of `unit_gain` means (1; Gemma's 1 + w: 0)
    kept_gains: ClassVar[tuple[str, ...]] = ()
    unit_gain: ClassVar[float] = 1.0
    # tiny variants for tests and demos: name -> config keyword arguments (timm: create_model arguments)
    tiny: ClassVar[dict[str, dict]] = {}

    # --- facts read from a config ------------------------------------------------------------------
    def spec(self, config) -> Spec:
        raise NotImplementedError

    def norm_eps(self, config) -> float:
        raise NotImplementedError

    def tied_names(self, config) -> dict[str, str]:
        """{parameter: the parameter it is tied to} for ties the export keeps (written once, under the second name):
        a forward run with a state dict (functional_call on a model whose parameters were replaced) needs both."""
        return {}

    def refused(self, config) -> list[str]:
        """What hf-rebasin refuses for models of this class beyond unknown tensors, with the reasons (for inspect,
        where the class is not a causal LM or an image classifier)."""
        return []

    def context_length(self, config) -> int | None:
        """Longest token sequence the model takes (None for image models)."""
        return None

    def eps_config_changes(self, eps: float) -> dict:
        """Config changes that set the exported norm eps (empty where the class fixes it)."""
        return {}

    def config_facts(self, config) -> dict[str, Any]:
        """What the class's forward depends on beyond the Spec's shapes, by meaning ({fact: value}), resolved
        from whichever spelling the config was written in: two models can be aligned only if these are equal.
        The norm eps is not one (it is a parameter of the canonical graph, interpolated like the weights)."""
        return {}

    def file_aliases(self) -> dict[str, tuple[str, ...]]:
        """Every other name a parameter may have in checkpoint files (what the class saves, then older names)."""
        out = {name: (saved,) for name, saved in self.saved_names.items()}
        for name, names in self.checkpoint_aliases.items():
            out[name] = out.get(name, ()) + tuple(n for n in names if n not in out.get(name, ()))
        return out

    def tiny_config(self, variant: str):
        """The config (transformers) or create_model arguments (timm) of a tiny variant."""
        raise NotImplementedError

    def to_files(self, part: dict[str, Tensor], files) -> dict[str, Tensor]:
        """A part of the exported state dict under the names its files get: what the class's own save_pretrained
        writes (saved_names), or the layout of the source's files where a class has several (files: the source's
        CheckpointFiles, its names)."""
        return {self.saved_names.get(name, name): value for name, value in part.items()}

    def module_parts(self, files) -> Iterator[dict[str, Tensor]]:
        """Checkpoint files' tensors (a mapping read on demand) as parts of the class's state dict: one tensor at a
        time under its name, where the files use the class's names."""
        for name in files:
            yield {name: files[name]}

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
            elif type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "eps", None), float):
                out.append((module, "eps"))  # Gemma's RMSNorm keeps its eps as `eps`
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


def first_set(config, names: tuple[str, ...], default=None):
    """The first of config's attributes `names` that is set (not None): one setting under its spellings."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def rope_facts(config, reads_partial: bool = True) -> dict[str, Any]:
    """RoPE as the class's forward computes it, by meaning.  transformers 5 gathers every spelling (rope_theta,
    rotary_emb_base, rotary_pct, partial_rotary_factor, rope_scaling) into config.rope_parameters, and the
    forward reads only that; a config object without it (transformers 4) keeps them as attributes.
    reads_partial: whether the default RoPE of the class honours partial_rotary_factor (LLaMA's does not;
    its scaled variants do).  Classes with one RoPE per layer type get one set of facts per type."""
    default_theta = getattr(config, "default_theta", 10000.0)
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        return {f"{kind}.{k}": v for kind, sub in sorted(params.items())
                for k, v in _rope(sub, default_theta, 1.0, reads_partial).items()}
    if params:
        return _rope(params, default_theta, 1.0, reads_partial)
    return _rope(getattr(config, "rope_scaling", None) or {},
                 first_set(config, ("rope_theta", "rotary_emb_base"), default_theta),
                 first_set(config, ("partial_rotary_factor", "rotary_pct"), 1.0), reads_partial)


def _rope(params: dict, theta: float, partial: float, reads_partial: bool) -> dict[str, Any]:
    kind = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", partial) if reads_partial or kind != "default" else 1.0
    scaling = {k: v for k, v in sorted(params.items())
               if k not in ("rope_theta", "partial_rotary_factor", "rope_type", "type")}
    return {"rope_theta": float(params.get("rope_theta", theta)), "rotary_fraction": float(partial),
            "rope_type": kind, "rope_scaling": scaling or None}


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
