"""timm ``VisionTransformer`` (Hub timm format: config.json + model.safetensors): patch-embedding
conv, class/register tokens, learned position embedding, pre-norm blocks with optional
LayerScale, final ``norm`` (token pooling) or ``fc_norm`` (average pooling), linear ``head``.

For timm the "config" these functions take is the built model itself (its modules say what the
variant is; a model on the meta device will do); the LayerNorm eps is fixed in the model code, so
the residual scale g stays 1."""
from __future__ import annotations

import torch
from torch import nn

from ..core.canonical import Spec, centre, fold_norm, layer_key
from ..errors import UnsupportedModelError
from .base import Adapter, filled, linear_in, register


def check_variant(model) -> None:
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


def final_norm(model) -> str:
    return "fc_norm" if isinstance(model.fc_norm, nn.LayerNorm) else "norm"


TOKENS = (("cls", "cls_token"), ("reg", "reg_token"), ("pos", "pos_embed"))


@register
class VisionTransformer(Adapter):
    architecture = "VisionTransformer"
    backend = "timm"
    modules = {"block": "blocks.{i}", "attn_out": "blocks.{i}.attn.proj", "ffn_hidden": "blocks.{i}.mlp.fc2"}
    tiny = {
        "vit": dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, mlp_ratio=2.0, num_classes=10,
                    init_values=0.5),
        "vit_avgpool": dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, mlp_ratio=2.0,
                            num_classes=10, class_token=False, global_pool="avg", reg_tokens=1),
    }
    timm_name = "vit_tiny_patch16_224"  # the registered timm model the tiny variants are built from

    def spec(self, model) -> Spec:
        check_variant(model)
        attn, d = model.blocks[0].attn, model.embed_dim
        embeddings = ["patch", "patch_bias"] + [n for n in ("cls", "reg") if getattr(model, f"{n}_token") is not None]
        if model.pos_embed is not None:
            embeddings.append("pos")
        return Spec(
            architecture=self.architecture, d_model=d, n_layers=len(model.blocks), n_heads=attn.num_heads,
            n_kv_heads=attn.num_heads, head_dim=attn.head_dim, ffn_dim=model.blocks[0].mlp.fc1.out_features,
            n_out=model.num_classes, glu=False, rotary_dims=0, centred=True, scale_exact=False,
            embeddings=tuple(embeddings), token_embedding=None,
            notes=("norm gains/biases and LayerScale absorbed into the linear layers next to them; LayerNorms "
                   "exported with weight 1 and bias 0, LayerScale with gamma 1",))

    def norm_eps(self, model) -> float:
        return float(model.blocks[0].norm1.eps)

    def tiny_config(self, variant: str):
        return dict(self.tiny[variant])

    def outside_to_canonical(self, read, model, spec):
        d, p = spec.d_model, {}
        p["embed.patch"] = centre(read("patch_embed.proj.weight").permute(1, 2, 3, 0))  # (C, p, p, d)
        patch_bias = read.get("patch_embed.proj.bias")
        p["embed.patch_bias"] = centre(patch_bias if patch_bias is not None else p["embed.patch"].new_zeros(d))
        for name, key in TOKENS:
            if name in spec.embeddings:
                p[f"embed.{name}"] = centre(read(key))
        norm = final_norm(model)
        w, b = linear_in(read, "head")
        p["head.weight"], p["head.bias"] = fold_norm(read(norm + ".weight"), read(norm + ".bias"), w, b)
        return p

    def layer_to_canonical(self, read, model, spec, i):
        d, pre, p = spec.d_model, f"blocks.{i}.", {}
        w, b = linear_in(read, pre + "attn.qkv")
        b = b if b is not None else w.new_zeros(3 * d)
        w, b = fold_norm(read(pre + "norm1.weight"), read(pre + "norm1.bias"), w, b)
        for j, name in enumerate("qkv"):
            p[layer_key(i, f"attn.{name}")] = w[:, j * d:(j + 1) * d]
            p[layer_key(i, f"attn.{name}_bias")] = b[j * d:(j + 1) * d]
        for name, module, ls in (("attn.o", "attn.proj", "ls1"), ("mlp.down", "mlp.fc2", "ls2")):
            w, b = linear_in(read, pre + module)
            b = b if b is not None else w.new_zeros(d)
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
        if model.patch_embed.proj.bias is not None:
            sd["patch_embed.proj.bias"] = p["embed.patch_bias"]
        for name, key in TOKENS:
            if name in spec.embeddings:
                sd[key] = p[f"embed.{name}"]
        norm = final_norm(model)
        sd[norm + ".weight"], sd[norm + ".bias"] = ones, zeros
        sd["head.weight"], sd["head.bias"] = p["head.weight"].T, p["head.bias"]
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
