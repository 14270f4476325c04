"""The canonical graph: a pre-norm transformer whose every norm is a parameter-free RMSNorm.

Row-vector convention throughout: a linear layer is ``y = x @ W + b`` with ``W`` of shape
``(d_in, d_out)``.  A canonical graph is plain data: a :class:`Spec` (structure and the
symmetry constraints its architecture imposes) and a flat ``dict`` of tensors keyed as

    embed.<name>               residual WRITES with the residual width d as last dim
                               (token/position embeddings, patch conv, class token, ...)
    layers.<i>.attn.q|k|v      READS   (d, heads * head_dim), with ``_bias`` companions
    layers.<i>.attn.o          WRITE   (heads * head_dim, d), ``o_bias`` (d)
    layers.<i>.mlp.up|gate     READS   (d, ffn), with ``_bias`` companions
    layers.<i>.mlp.down        WRITE   (ffn, d), ``down_bias`` (d)
    head.weight / head.bias    READ    (d, n_out) / (n_out)
    final_norm.bias            a bias that has to stay inside the final norm (d), when the
                               reader after it has no bias to absorb it into
    layers.<i>.attn.post_norm  GAIN    (d): post-sublayer norms (OLMo-2, Gemma-2): the sublayer's
    layers.<i>.mlp.post_norm           output goes through a parameter-free RMSNorm and this gain
                                       before it is added to the stream (Spec.residual is then
                                       "signed_permutation": the gain cannot be absorbed)
    layers.<i>.attn.q_norm|k_norm      QK-norm gains, kept: over each head's dims and shared by the
                               heads (Spec.qk_norm "head", Qwen3) or over the whole projection
                               (Spec.qk_norm "projection", OLMo-2: permuted with the heads)
    layers.<i>.moe.router|up|gate|down, mlp.shared_gate   a mixture-of-experts block (core/experts.py); a
                               shared expert is the layer's mlp.*, its sigmoid gate mlp.shared_gate (d, 1)
    pre_norm.weight / .bias    gain and bias of a norm ON the stream (timm's norm_pre, BERT's embedding
                               LayerNorm): the gain moves with |G| (G a signed permutation), the bias with G
    layers.<i>.attn.stream_norm, .stream_norm_bias, and the same under mlp.: post-LN (BERT) norms on the
                               stream after each residual add, gain (|G|) and bias (G), kept
    head.transform (d, d)      TRANSIT: an MLM head's dense layer, reading the stream and writing a space
                               tied to it (the decoder is the token embedding): W -> G^T W |G| (through GELU
                               only a permutation passes), head.transform_bias -> b |G|; its LayerNorm's
                               head.norm.weight / .bias move with G (norm_bias)

The norms themselves carry no parameters; their epsilon is ``Graph.norm_eps``.
Every adapter maps its checkpoint to this form and back exactly (docs/design.md §2).
"""
from __future__ import annotations

import dataclasses
import functools
import operator
from dataclasses import dataclass, field

from torch import Tensor

WRITE_SUFFIXES = ("attn.o", "attn.o_bias", "mlp.down", "mlp.down_bias", "moe.down")
GAIN_SUFFIXES = ("attn.post_norm", "mlp.post_norm", "attn.stream_norm", "mlp.stream_norm")
NORM_BIAS_SUFFIXES = ("attn.stream_norm_bias", "mlp.stream_norm_bias")
NORM_BIAS_KEYS = ("final_norm.bias", "pre_norm.bias", "head.norm.weight", "head.norm.bias")
READ_SUFFIXES = ("attn.q", "attn.k", "attn.v", "mlp.up", "mlp.gate", "mlp.shared_gate", "moe.router", "moe.up",
                 "moe.gate")


@dataclass(frozen=True)
class Spec:
    """Structure of a canonical graph and the constraints on its symmetry group."""

    architecture: str  # class name of the source model, e.g. "GPTNeoXForCausalLM"
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    n_out: int  # vocabulary size or number of classes
    glu: bool  # gated FFN (SwiGLU): gate and up projections
    rotary_dims: int = 0  # rotary dimensions per head (0: no RoPE)
    rotary_layout: str = "half"  # "half": rotate_half pairs i with i + rotary_dims/2
    centred: bool = False  # exported with LayerNorm: the stream must stay centred, G·1 = ±1
    qk_maps: bool = True  # per-head QK maps are exact symmetries (False: clip_qkv, QK-norm with gains)
    ov_maps: bool = True  # per-head OV maps are exact symmetries (False: clip_qkv)
    residual: str = "orthogonal"  # the residual group: "orthogonal" or "signed_permutation" (post-norm gains)
    qk_norm: str = "none"  # QK-norm gains kept: "none", "head" (shared by the heads), "projection" (per coordinate)
    scale_exact: bool = True  # the norm eps can be rescaled in the exported config (g != 1 exact)
    # the residual group: "orthogonal" (rotations; fixing the ones direction when centred) or "signed_permutation"
    # (a norm gain on the stream itself, e.g. timm's norm_pre, forbids mixing channels; centred: one sign, G = ±P)
    residual: str = "orthogonal"
    embeddings: tuple[str, ...] = ("tok",)  # names of the embed.* write tensors
    token_embedding: str | None = "tok"  # the embedding indexed by vocabulary (None for ViT)
    n_experts: int = 0  # experts per MoE layer (0: a dense FFN); ffn_dim is then the shared expert's (0: none)
    expert_dim: int = 0  # hidden units of each expert
    top_k: int = 0  # experts routed per token
    shared_expert: bool = False  # a dense shared expert beside the routed ones (mlp.*, with mlp.shared_gate)
    notes: tuple[str, ...] = ()  # caveats of the round trip (for inspect and model cards)

    @property
    def head_maps(self) -> bool:
        """Some per-head map (QK or OV) is a symmetry."""
        return self.qk_maps or self.ov_maps

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def free_head_dims(self) -> int:
        return self.head_dim - self.rotary_dims


@dataclass
class Graph:
    """A canonical graph held in memory: every tensor in one dict."""

    spec: Spec
    params: dict[str, Tensor]
    norm_eps: float
    meta: dict = field(default_factory=dict)  # adapter-specific, non-tensor facts needed for export

    def replace(self, params: dict[str, Tensor] | None = None, **changes) -> Graph:
        return dataclasses.replace(self, params=dict(self.params if params is None else params), **changes)

    def outside(self) -> dict[str, Tensor]:
        """The tensors outside the layers (embed.*, head.*, final_norm.bias)."""
        return {k: v for k, v in self.params.items() if not k.startswith("layers.")}

    def layer(self, i: int) -> dict[str, Tensor]:
        prefix = f"layers.{i}."
        return {k: v for k, v in self.params.items() if k.startswith(prefix)}

    def materialise(self) -> Graph:
        return self


class LazyGraph:
    """A canonical graph computed part by part on demand (the tensors outside the layers, or one layer),
    so that a model larger than memory is only ever held one layer at a time.  ``params`` materialises the
    whole graph (once) for the small-model uses that want it."""

    spec: Spec
    norm_eps: float
    meta: dict = {}

    def outside(self) -> dict[str, Tensor]:
        raise NotImplementedError

    def layer(self, i: int) -> dict[str, Tensor]:
        raise NotImplementedError

    def parts(self):
        """("outside", tensors), then ("layer-00000", tensors), ...: one part computed per step of the iteration,
        so that a loop over them holds one part at a time (never unpack this into a tuple or list)."""
        yield "outside", self.outside()
        for i in range(self.spec.n_layers):
            yield f"layer-{i:05d}", self.layer(i)

    def materialise(self) -> Graph:
        params = {}
        for _, tensors in self.parts():
            params.update(tensors)
        return Graph(self.spec, params, self.norm_eps, dict(self.meta))

    @property
    def params(self) -> dict[str, Tensor]:
        if "_materialised" not in self.__dict__:
            self.__dict__["_materialised"] = self.materialise()
        return self.__dict__["_materialised"].params

    def replace(self, params: dict[str, Tensor] | None = None, **changes) -> Graph:
        return self.materialise().replace(params, **changes)


class InterpolatedGraph(LazyGraph):
    """sum_i w_i * graph_i, computed part by part."""

    def __init__(self, graphs: list, weights: list[float]):
        self.graphs, self.weights = list(graphs), [float(w) for w in weights]
        self.spec = graphs[0].spec
        self.norm_eps = float(sum(w * g.norm_eps for g, w in zip(graphs, self.weights)))
        self.meta = dict(getattr(graphs[0], "meta", {}) or {})

    def _used(self):
        """The graphs with a nonzero weight: one of weight 0 adds exactly nothing (the weights are finite, and
        so is every model: sources are checked), so it is not even read (an endpoint reads one model)."""
        used = [(g, w) for g, w in zip(self.graphs, self.weights) if w != 0.0] or list(zip(self.graphs, self.weights))
        return [g for g, _ in used], [w for _, w in used]

    def outside(self) -> dict[str, Tensor]:
        graphs, weights = self._used()
        return mix([g.outside() for g in graphs], weights)

    def layer(self, i: int) -> dict[str, Tensor]:
        graphs, weights = self._used()
        return mix([g.layer(i) for g in graphs], weights)


def mix(parts: list[dict[str, Tensor]], weights: list[float]) -> dict[str, Tensor]:
    """sum_i w_i * parts_i, tensor by tensor (the parts: the same keys, e.g. one layer of each model)."""
    if any(p.keys() != parts[0].keys() for p in parts[1:]):
        raise ValueError("cannot interpolate canonical graphs of different structure")
    return {k: functools.reduce(operator.add, (w * p[k] for p, w in zip(parts, weights))) for k in parts[0]}


def layer_key(i: int, name: str) -> str:
    return f"layers.{i}.{name}"


def residual_role(key: str) -> str | None:
    """How a tensor reacts to the residual rotation: 'write', 'read', 'norm_bias', 'gain', 'transit',
    'transit_bias' or None."""
    if key.startswith("embed."):
        return "write"
    if key in ("head.weight", "head.pooler"):
        return "read"
    if key in NORM_BIAS_KEYS:
        return "norm_bias"
    if key == "head.transform":
        return "transit"
    if key == "head.transform_bias":
        return "transit_bias"
    if key == "pre_norm.weight":
        return "gain"
    if key.startswith("layers."):
        suffix = key.split(".", 2)[2]
        if suffix in WRITE_SUFFIXES:
            return "write"
        if suffix in READ_SUFFIXES:
            return "read"
        if suffix in GAIN_SUFFIXES:
            return "gain"
        if suffix in NORM_BIAS_SUFFIXES:
            return "norm_bias"
    return None


# --- helpers the adapters share ---------------------------------------------------------------

def centre(w: Tensor) -> Tensor:
    """Right-multiply by C = I - 11^T/d: remove the mean along the residual (last) axis."""
    return w - w.mean(dim=-1, keepdim=True)


def fold_norm(gamma: Tensor | None, beta: Tensor | None, weight: Tensor, bias: Tensor | None):
    """Absorb a norm's affine (x*gamma + beta) into the reader (weight: (d, out)) after it."""
    new_w = weight if gamma is None else gamma[:, None] * weight
    if beta is None:
        return new_w, bias
    shift = beta @ weight
    return new_w, shift if bias is None else bias + shift


def interpolate(graphs: list, weights: list[float]):
    """The point sum_i w_i * graph_i of the canonical parameter space (lazy when any graph is lazy)."""
    first = graphs[0]
    if hasattr(first, "interpolate_points"):  # graphs interpolated in their own parameters (sources.models)
        return first.interpolate_points(graphs, weights)
    if any(isinstance(g, LazyGraph) for g in graphs):
        for other in graphs[1:]:
            if dataclasses.replace(other.spec, notes=()) != dataclasses.replace(first.spec, notes=()):
                raise ValueError("cannot interpolate canonical graphs of different structure")
        return InterpolatedGraph(graphs, weights)
    for other in graphs[1:]:
        same_spec = dataclasses.replace(other.spec, notes=()) == dataclasses.replace(first.spec, notes=())
        if not same_spec or other.params.keys() != first.params.keys():
            raise ValueError("cannot interpolate canonical graphs of different structure")
    params = mix([g.params for g in graphs], weights)
    eps = float(sum(w * g.norm_eps for g, w in zip(graphs, weights)))
    return first.replace(params, norm_eps=eps)
