"""timm ``VisionTransformer`` (Hub timm format: config.json + model.safetensors): patch-embedding
conv, class/register tokens, learned position embedding (or none), optional pre-norm on the
embeddings (``norm_pre``, CLIP), pre-norm blocks with optional LayerScale, final ``norm`` (before
pooling) or ``fc_norm`` (after it), token or average pooling, linear ``head``.

For timm the "config" these functions take is the built model itself (its modules say what the
variant is; a model on the meta device will do); the LayerNorm eps is fixed in the model code, so
the residual scale g stays 1.

What is exact, and why (row vectors, C = I - 11^T/d, every norm a LayerNorm):

* LayerScale: ``x + gamma * f(x)`` is ``x + f'(x)`` with gamma folded into the rows of the write
  (attn.proj, mlp.fc2) -- exported with gamma = 1, which the stock constructor builds (init_values kept).
* class, register and distillation tokens, position embeddings (added before or after the prefix
  tokens are concatenated, ``no_embed_class``; resampled for ``dynamic_img_size``, a linear map along
  the token axis that commutes with any map of the channel axis): residual writes, transformed as W G.
* token pooling then ``fc_norm`` equals ``norm`` then token pooling; average pooling commutes with
  any linear map of the stream, so ``fc_norm`` after it and ``norm`` before it both fold into the head.
* no qkv / projection biases (``qkv_bias=False``, ``proj_bias=False``): the LayerNorm biases folded into
  the reads become q/k/v and fc1 biases, and a merge of two such models has biases that no LayerNorm
  bias can reproduce (d values against 3d), so the export sets qkv_bias / proj_bias = True in model_args.
* ``norm_pre``: x0 = n(e) diag(γ) + β, n the parameter-free LayerNorm, e the embeddings.  The
  embeddings feed only that norm, so they may move by their own H (orthogonal, H·1 = ±1:
  n(eH) = n(e)H); the stream moves by G; exactness needs n(e) H diag(γ') = n(e) diag(γ) G for every
  centred n(e), i.e. C H diag(γ') = C diag(γ) G.  For gains that are not all equal this holds only for
  G = H = ±P, P a permutation, with γ' = γ|G| (the gains permuted) and β' = βG: the residual group
  shrinks from rotations fixing the ones direction to ±permutations (Spec.residual "signed_permutation").
  The embeddings before the norm are centred (n ignores their mean); β is centred (every reader of
  the stream is a LayerNorm, blind to the mean).

Refused by name, with the reason: max / avgmax / attention-map pooling, no pooling, no final norm,
a norm inside the patch embedding, QK-norm / scale-norm / gated attention, gated (SwiGLU) MLPs,
norms other than LayerNorm, no classifier head."""
from __future__ import annotations

import torch
from torch import nn

from ..core.canonical import Spec, centre, fold_norm, layer_key
from ..errors import UnsupportedModelError
from .base import Adapter, filled, linear_in, register

POOLING_REFUSED = {
    "max": "max pooling takes a per-channel maximum over tokens, which commutes with no rotation of the residual "
           "stream and not with the centring the LayerNorms allow",
    "avgmax": "avgmax pooling has a per-channel maximum over tokens (see max)",
    "map": "attention-pool head (global_pool='map'): its latent query, norm and MLP are not adapted",
    "prr": "attention-pool head (global_pool='prr') is not adapted",
    "": "no pooling (global_pool=''): the model has no single classifier output",
}


def _problems(model, distilled: bool) -> list[str]:
    problems = []
    if model.num_classes == 0 or isinstance(model.head, nn.Identity):
        problems.append("no classifier head (num_classes=0)")
    if getattr(model, "attn_pool", None) is not None or model.global_pool not in ("token", "avg"):
        pool = model.global_pool
        problems.append(f"global_pool={pool!r}: " + POOLING_REFUSED.get(pool, "only 'token' and 'avg' are supported"))
    if isinstance(model.norm, nn.Identity) and isinstance(model.fc_norm, nn.Identity):
        problems.append("final_norm=False: the head would read the raw residual stream, whose mean the centred "
                        "canonical form drops (exact only behind a LayerNorm)")
    for name in ("norm_pre", "norm", "fc_norm"):
        module = getattr(model, name)
        if not isinstance(module, (nn.Identity, nn.LayerNorm)):
            problems.append(f"{name} is {type(module).__name__}, not LayerNorm")
    if not isinstance(getattr(model.patch_embed, "norm", nn.Identity()), nn.Identity):
        problems.append("embed_norm_layer (a norm inside the patch embedding, before the position embedding is "
                        "added: the patch embedding is then no residual write)")
    if distilled:
        if model.reg_token is not None:
            problems.append("reg_tokens with VisionTransformerDistilled (timm's distilled forward never adds them)")
        if not isinstance(model.fc_norm, nn.Identity):
            problems.append("fc_norm with VisionTransformerDistilled (its head never applies fc_norm)")
    return problems


def _block_problems(block) -> list[str]:
    if type(block).__name__ != "Block":
        return [f"block class {type(block).__name__} (only timm's pre-norm Block is adapted)"]
    problems, attn = [], block.attn
    if type(attn).__name__ != "Attention":
        problems.append(f"attention class {type(attn).__name__}")
    for name in ("q_norm", "k_norm", "norm"):
        if not isinstance(getattr(attn, name, nn.Identity()), nn.Identity):
            problems.append(f"attention {name} (QK-norm / scale-norm break the per-head maps)")
    if getattr(attn, "gate", None) is not None:
        problems.append("gated attention")
    if type(block.mlp).__name__ != "Mlp":
        problems.append(f"MLP class {type(block.mlp).__name__} (only timm's Mlp, fc1 -> activation -> fc2)")
    elif not isinstance(block.mlp.norm, nn.Identity):
        problems.append("scale_mlp_norm (a norm on the FFN hidden units)")
    for name in ("norm1", "norm2"):
        if not isinstance(getattr(block, name), nn.LayerNorm):
            problems.append(f"{name} is {type(getattr(block, name)).__name__}, not LayerNorm")
    return problems


def check_variant(model, architecture: str) -> None:
    if type(model).__name__ != architecture:
        raise UnsupportedModelError(f"timm {architecture} adapter given a {type(model).__name__}")
    problems = _problems(model, architecture == "VisionTransformerDistilled") + _block_problems(model.blocks[0])
    if problems:
        raise UnsupportedModelError(f"timm {architecture} variant not supported: " + "; ".join(problems))


def final_norm(model) -> str:
    return "fc_norm" if isinstance(model.fc_norm, nn.LayerNorm) else "norm"


def has_norm_pre(model) -> bool:
    return isinstance(model.norm_pre, nn.LayerNorm)


# canonical name -> model attribute of the embeddings beside the patch embedding
TOKENS = (("cls", "cls_token"), ("dist", "dist_token"), ("reg", "reg_token"), ("pos", "pos_embed"))
HEADS = ("head",)  # classifier heads, side by side in the canonical head.weight (d, len(HEADS) * n_classes)

NORM_PRE_NOTE = ("norm_pre (a LayerNorm on the embeddings, before the first block): its gains scale the stream after "
                 "the normalisation, where no linear layer can absorb them, so the residual group is reduced from "
                 "rotations fixing the ones direction to permutations of the channels (and -1 times them); "
                 "norm_pre is exported with its gains and bias (permuted)")


@register
class VisionTransformer(Adapter):
    architecture = "VisionTransformer"
    backend = "timm"
    kept_gains = ("norm_pre.weight",)  # a gain on the stream itself (CLIP-style towers) stays: it cannot be absorbed
    modules = {"block": "blocks.{i}", "attn_out": "blocks.{i}.attn.proj", "ffn_hidden": "blocks.{i}.mlp.fc2"}
    base = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, mlp_ratio=2.0, num_classes=10)
    tiny = {
        "vit": dict(base, init_values=0.5),
        "vit_avgpool": dict(base, class_token=False, global_pool="avg", reg_tokens=1),
        # class token + registers outside the position embedding, fc_norm after token pooling, no q/k/v or
        # projection biases, LayerScale
        "vit_registers": dict(base, reg_tokens=4, no_embed_class=True, fc_norm=True, qkv_bias=False,
                              proj_bias=False, init_values=0.5),
        # CLIP image tower layout: LayerNorm on the embeddings (no patch bias), quick-GELU
        "vit_norm_pre": dict(base, pre_norm=True, act_layer="quick_gelu"),
    }
    timm_name = "vit_tiny_patch16_224"  # the registered timm model the tiny variants are built from
    bias_args = ("qkv_bias", "proj_bias")
    heads = HEADS

    def spec(self, model) -> Spec:
        check_variant(model, self.architecture)
        attn, d = model.blocks[0].attn, model.embed_dim
        embeddings = ["patch"] + (["patch_bias"] if model.patch_embed.proj.bias is not None else [])
        embeddings += [name for name, attr in TOKENS if getattr(model, attr, None) is not None]
        notes = ["norm gains/biases and LayerScale absorbed into the linear layers next to them; LayerNorms "
                 "exported with weight 1 and bias 0, LayerScale with gamma 1"]
        if self.bias_changes(model):
            notes.append("exported with q/k/v and projection biases (qkv_bias / proj_bias = True in model_args): "
                         "the folded LayerNorm biases live there")
        if has_norm_pre(model):
            notes[0] = notes[0].replace("LayerNorms exported", "LayerNorms in the blocks and the head exported")
            notes.append(NORM_PRE_NOTE)
        return Spec(
            architecture=self.architecture, d_model=d, n_layers=len(model.blocks), n_heads=attn.num_heads,
            n_kv_heads=attn.num_heads, head_dim=attn.head_dim, ffn_dim=model.blocks[0].mlp.fc1.out_features,
            n_out=model.num_classes, glu=False, rotary_dims=0, centred=True, scale_exact=False,
            residual="signed_permutation" if has_norm_pre(model) else "orthogonal",
            embeddings=tuple(embeddings), token_embedding=None, notes=tuple(notes))

    def norm_eps(self, model) -> float:
        return float(model.blocks[0].norm1.eps)

    def tiny_config(self, variant: str):
        return dict(self.tiny[variant])

    @staticmethod
    def bias_changes(model) -> dict:
        """model_args the export changes: the biases the canonical form needs and the model lacks."""
        block, changes = model.blocks[0], {}
        if block.attn.qkv.bias is None:
            changes["qkv_bias"] = True
        if block.attn.proj.bias is None or block.mlp.fc1.bias is None or block.mlp.fc2.bias is None:
            changes["proj_bias"] = True
        return changes

    def export_config_changes(self, graph, model) -> dict:
        return self.bias_changes(model)

    def outside_to_canonical(self, read, model, spec):
        p = {"embed.patch": centre(read("patch_embed.proj.weight").permute(1, 2, 3, 0))}  # (C, p, p, d)
        if "patch_bias" in spec.embeddings:
            p["embed.patch_bias"] = centre(read("patch_embed.proj.bias"))
        for name, key in TOKENS:
            if name in spec.embeddings:
                p[f"embed.{name}"] = centre(read(key))
        if has_norm_pre(model):
            p["pre_norm.weight"], p["pre_norm.bias"] = read("norm_pre.weight"), centre(read("norm_pre.bias"))
        norm = final_norm(model)
        gamma, beta = read(norm + ".weight"), read(norm + ".bias")
        weights, biases = [], []
        for head in self.heads:
            w, b = linear_in(read, head)
            w, b = fold_norm(gamma, beta, w, b)
            weights.append(w)
            biases.append(b)
        p["head.weight"], p["head.bias"] = torch.cat(weights, dim=1), torch.cat(biases)
        return p

    def layer_to_canonical(self, read, model, spec, i):
        pre, p = f"blocks.{i}.", {}
        width = model.blocks[i].attn.attn_dim
        w, b = linear_in(read, pre + "attn.qkv")
        b = b if b is not None else w.new_zeros(3 * width)
        w, b = fold_norm(read(pre + "norm1.weight"), read(pre + "norm1.bias"), w, b)
        for j, name in enumerate("qkv"):
            p[layer_key(i, f"attn.{name}")] = w[:, j * width:(j + 1) * width]
            p[layer_key(i, f"attn.{name}_bias")] = b[j * width:(j + 1) * width]
        for name, module, ls in (("attn.o", "attn.proj", "ls1"), ("mlp.down", "mlp.fc2", "ls2")):
            w, b = linear_in(read, pre + module)
            b = b if b is not None else w.new_zeros(spec.d_model)
            gamma = read.get(pre + ls + ".gamma")
            if gamma is not None:
                w, b = w * gamma, b * gamma
            p[layer_key(i, name)], p[layer_key(i, name + "_bias")] = centre(w), centre(b)
        w, b = linear_in(read, pre + "mlp.fc1")
        w, b = fold_norm(read(pre + "norm2.weight"), read(pre + "norm2.bias"), w, b)
        p[layer_key(i, "mlp.up")] = w
        p[layer_key(i, "mlp.up_bias")] = b if b is not None else w.new_zeros(spec.ffn_dim)
        return p

    def outside_from_canonical(self, p, model, spec):
        ones, zeros = filled(p["head.weight"], spec.d_model, 1.0), filled(p["head.weight"], spec.d_model, 0.0)
        sd = {"patch_embed.proj.weight": p["embed.patch"].permute(3, 0, 1, 2)}
        if "patch_bias" in spec.embeddings:
            sd["patch_embed.proj.bias"] = p["embed.patch_bias"]
        for name, key in TOKENS:
            if name in spec.embeddings:
                sd[key] = p[f"embed.{name}"]
        if has_norm_pre(model):
            sd["norm_pre.weight"], sd["norm_pre.bias"] = p["pre_norm.weight"], p["pre_norm.bias"]
        norm = final_norm(model)
        sd[norm + ".weight"], sd[norm + ".bias"] = ones, zeros
        for head, w, b in zip(self.heads, p["head.weight"].chunk(len(self.heads), dim=1),
                              p["head.bias"].chunk(len(self.heads))):
            sd[head + ".weight"], sd[head + ".bias"] = w.T, b
        return sd

    def layer_from_canonical(self, p, model, spec, i):
        pre = f"blocks.{i}."
        lk = lambda name: p[layer_key(i, name)]
        ones, zeros = filled(lk("attn.o"), spec.d_model, 1.0), filled(lk("attn.o"), spec.d_model, 0.0)
        sd = {pre + "attn.qkv.weight": torch.cat([lk(f"attn.{n}") for n in "qkv"], dim=1).T,
              pre + "attn.qkv.bias": torch.cat([lk(f"attn.{n}_bias") for n in "qkv"]),
              pre + "attn.proj.weight": lk("attn.o").T, pre + "attn.proj.bias": lk("attn.o_bias"),
              pre + "mlp.fc1.weight": lk("mlp.up").T, pre + "mlp.fc1.bias": lk("mlp.up_bias"),
              pre + "mlp.fc2.weight": lk("mlp.down").T, pre + "mlp.fc2.bias": lk("mlp.down_bias")}
        for norm in ("norm1", "norm2"):
            sd[pre + norm + ".weight"], sd[pre + norm + ".bias"] = ones, zeros
        block = model.blocks[i]
        for ls in ("ls1", "ls2"):
            if hasattr(getattr(block, ls), "gamma"):
                sd[pre + ls + ".gamma"] = ones
        return sd
