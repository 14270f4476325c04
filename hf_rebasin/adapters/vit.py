"""timm ``VisionTransformer`` (Hub timm format: config.json + model.safetensors): patch-embedding
conv, class/register tokens, learned position embedding, pre-norm blocks with optional
LayerScale, final ``norm`` (token pooling) or ``fc_norm`` (average pooling), linear ``head``.

For timm the "config" these functions take is the built model itself (its modules say
what the variant is); the LayerNorm eps is fixed in the model code, so g stays 1."""
from __future__ import annotations

import torch
from torch import nn

from ..canonical import Graph, Spec, centre, fold_norm, layer_key
from .base import Adapter, StateReader, UnsupportedModelError, linear_in


def _check_variant(model) -> None:
    problems = []
    if type(model).__name__ != "VisionTransformer":
        problems.append(f"class {type(model).__name__}")
    if getattr(model, "attn_pool", None) is not None or model.global_pool not in ("token", "avg"):
        problems.append(f"global_pool={model.global_pool!r} (only 'token' and 'avg' pooling are supported)")
    if model.num_classes == 0 or isinstance(model.head, nn.Identity):
        problems.append("no classifier head (num_classes=0)")
    if not isinstance(model.norm_pre, nn.Identity):
        problems.append("pre_norm=True (a norm on the embeddings)")
    block = model.blocks[0]
    if type(block).__name__ != "Block":
        problems.append(f"block class {type(block).__name__}")
    else:
        attn = block.attn
        for name in ("q_norm", "k_norm", "norm"):
            if not isinstance(getattr(attn, name, nn.Identity()), nn.Identity):
                problems.append(f"attention {name} (QK-norm / scale-norm break the per-head maps)")
        if getattr(attn, "gate", None) is not None:
            problems.append("gated attention")
        if not hasattr(block.mlp, "fc1") or hasattr(block.mlp, "fc1_g"):
            problems.append(f"MLP class {type(block.mlp).__name__}")
        elif not isinstance(getattr(block.mlp, "norm", nn.Identity()), nn.Identity):
            problems.append("scale_mlp_norm")
        for name in ("norm1", "norm2"):
            if not isinstance(getattr(block, name), nn.LayerNorm):
                problems.append(f"{name} is {type(getattr(block, name)).__name__}, not LayerNorm")
    if problems:
        raise UnsupportedModelError("timm VisionTransformer variant not supported: " + "; ".join(problems))


def spec(model) -> Spec:
    _check_variant(model)
    attn, d = model.blocks[0].attn, model.embed_dim
    embeddings = ["patch", "patch_bias"] + [n for n in ("cls", "reg") if getattr(model, f"{n}_token") is not None]
    if model.pos_embed is not None:
        embeddings.append("pos")
    return Spec(
        architecture="VisionTransformer", d_model=d, n_layers=len(model.blocks), n_heads=attn.num_heads,
        n_kv_heads=attn.num_heads, head_dim=attn.head_dim, ffn_dim=model.blocks[0].mlp.fc1.out_features,
        n_out=model.num_classes, glu=False, rotary_dims=0, centred=True, scale_exact=False,
        embeddings=tuple(embeddings), token_embedding=None,
        notes=("norm gains/biases and LayerScale absorbed into the linear layers next to them; LayerNorms "
               "exported with weight 1 and bias 0, LayerScale with gamma 1",))


def _final_norm(model) -> str:
    return "fc_norm" if isinstance(model.fc_norm, nn.LayerNorm) else "norm"


def to_canonical(state_dict, model) -> Graph:
    s, r = spec(model), StateReader(state_dict, "VisionTransformer")
    d, p = s.d_model, {}
    p["embed.patch"] = centre(r("patch_embed.proj.weight").permute(1, 2, 3, 0))  # (C, p, p, d)
    patch_bias = r.get("patch_embed.proj.bias")
    p["embed.patch_bias"] = centre(patch_bias if patch_bias is not None else torch.zeros(d))
    for name, key in (("cls", "cls_token"), ("reg", "reg_token"), ("pos", "pos_embed")):
        if name in s.embeddings:
            p[f"embed.{name}"] = centre(r(key))
    for i in range(s.n_layers):
        pre = f"blocks.{i}."
        w, b = linear_in(r, pre + "attn.qkv")
        b = b if b is not None else torch.zeros(3 * d)
        w, b = fold_norm(r(pre + "norm1.weight"), r(pre + "norm1.bias"), w, b)
        for j, name in enumerate("qkv"):
            p[layer_key(i, f"attn.{name}")] = w[:, j * d:(j + 1) * d]
            p[layer_key(i, f"attn.{name}_bias")] = b[j * d:(j + 1) * d]
        for name, module, ls in (("attn.o", "attn.proj", "ls1"), ("mlp.down", "mlp.fc2", "ls2")):
            w, b = linear_in(r, pre + module)
            b = b if b is not None else torch.zeros(d)
            gamma = r.get(pre + ls + ".gamma")
            if gamma is not None:
                w, b = w * gamma, b * gamma
            p[layer_key(i, name)], p[layer_key(i, name + "_bias")] = centre(w), centre(b)
        w, b = linear_in(r, pre + "mlp.fc1")
        w, b = fold_norm(r(pre + "norm2.weight"), r(pre + "norm2.bias"), w, b if b is not None else None)
        p[layer_key(i, "mlp.up")], p[layer_key(i, "mlp.up_bias")] = w, (b if b is not None else torch.zeros(s.ffn_dim))
    norm = _final_norm(model)
    w, b = linear_in(r, "head")
    p["head.weight"], p["head.bias"] = fold_norm(r(norm + ".weight"), r(norm + ".bias"), w, b)
    r.finish()
    return Graph(s, p, float(model.blocks[0].norm1.eps), meta={"final_norm": norm})


def from_canonical(graph: Graph, model):
    s, p = graph.spec, graph.params
    ones, zeros = torch.ones(s.d_model), torch.zeros(s.d_model)
    sd = {"patch_embed.proj.weight": p["embed.patch"].permute(3, 0, 1, 2)}
    own = model.state_dict()
    if "patch_embed.proj.bias" in own:
        sd["patch_embed.proj.bias"] = p["embed.patch_bias"]
    for name, key in (("cls", "cls_token"), ("reg", "reg_token"), ("pos", "pos_embed")):
        if name in s.embeddings:
            sd[key] = p[f"embed.{name}"]
    for i in range(s.n_layers):
        pre = f"blocks.{i}."
        lk = lambda name: p[layer_key(i, name)]  # noqa: E731
        sd[pre + "attn.qkv.weight"] = torch.cat([lk(f"attn.{n}") for n in "qkv"], dim=1).T
        sd[pre + "attn.qkv.bias"] = torch.cat([lk(f"attn.{n}_bias") for n in "qkv"])
        sd[pre + "attn.proj.weight"], sd[pre + "attn.proj.bias"] = lk("attn.o").T, lk("attn.o_bias")
        sd[pre + "mlp.fc1.weight"], sd[pre + "mlp.fc1.bias"] = lk("mlp.up").T, lk("mlp.up_bias")
        sd[pre + "mlp.fc2.weight"], sd[pre + "mlp.fc2.bias"] = lk("mlp.down").T, lk("mlp.down_bias")
        for norm in ("norm1", "norm2"):
            sd[pre + norm + ".weight"], sd[pre + norm + ".bias"] = ones, zeros
        for ls in ("ls1", "ls2"):
            if pre + ls + ".gamma" in own:
                sd[pre + ls + ".gamma"] = ones
    norm = graph.meta.get("final_norm", _final_norm(model))
    sd[norm + ".weight"], sd[norm + ".bias"] = ones, zeros
    sd["head.weight"], sd["head.bias"] = p["head.weight"].T, p["head.bias"]
    missing = sorted(set(own) - set(sd))
    if missing:
        raise UnsupportedModelError(f"VisionTransformer export: no canonical value for {missing}")
    return sd, {}


MODULES = {"block": "blocks.{i}",
           "attn_out": "blocks.{i}.attn.proj",
           "ffn_hidden": "blocks.{i}.mlp.fc2"}

ADAPTER = Adapter("VisionTransformer", "timm", spec, to_canonical, from_canonical, modules=MODULES)
