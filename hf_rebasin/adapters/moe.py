"""The sparse mixture-of-experts block of the LLaMA-like MoE classes (Mixtral, OLMoE, Qwen2-MoE, Qwen3-MoE), shared
by their adapters: a linear router (no bias) whose softmax picks the top-k experts, each expert a SwiGLU FFN, and
for Qwen2-MoE a shared expert with a sigmoid gate.  Canonical form and group: core/experts.py.

Two weight layouts reach users, and both are read:

* per expert (the Hub's files, and what transformers 5's own save_pretrained writes): ``experts.N.w1/w3/w2``
  (Mixtral, under ``block_sparse_moe``) or ``experts.N.gate_proj/up_proj/down_proj``, one (F, d) or (d, F) matrix
  per expert;
* fused (transformers 5's modules, and files saved from their state dict): ``experts.gate_up_proj`` (E, 2F, d),
  gate rows first, and ``experts.down_proj`` (E, d, F).

The conversion to the module (``layer_from_canonical``) is in the fused names of the class; an export is written
in the layout of its source's files (``to_files``), so the stock loader reads it either way.

The pre-FFN norm's gain folds into everything that reads its output: the router, every expert's gate and up,
the shared expert and its gate."""
from __future__ import annotations

import re

import torch

from ..core.canonical import Spec, fold_norm, layer_key
from ..errors import UnsupportedModelError
from .base import first_set
from .llama import PROJECTIONS, WRITES

ATTENTION_READS = {k: v for k, v in PROJECTIONS.items() if k.startswith("attn.")}
ATTENTION_WRITES = {k: v for k, v in WRITES.items() if k.startswith("attn.")}
FUSED = ("experts.gate_up_proj", "experts.down_proj")
# routing some configs can ask for that these classes' forward does not compute (other classes' settings, set by
# hand): refused by name rather than aligned as if the router were plain top-k
ROUTING_REFUSED = {"n_group": "grouped top-k routing", "topk_group": "grouped top-k routing",
                   "routed_scaling_factor": "scaled routing weights", "scoring_func": "a non-softmax router score",
                   "topk_method": "a non-standard top-k method", "expert_capacity": "expert-choice / capacity routing"}


class SparseMoe:
    """Mixin for a LLaMA-like adapter whose FFN is a sparse MoE block (put it first in the bases)."""

    projections, writes = ATTENTION_READS, ATTENTION_WRITES  # the attention's nn.Linear layers; the FFN is below
    block = "mlp"  # the sparse block's module name in the class
    file_block = "mlp"  # its name in per-expert files
    expert_files = ("gate_proj", "up_proj", "down_proj")  # per-expert files' names of gate, up, down
    expert_dim_field = "moe_intermediate_size"
    shared = False  # a shared expert (shared_expert.*, shared_expert_gate)

    # --- facts ------------------------------------------------------------------------------------------
    def n_experts(self, config) -> int:
        return int(first_set(config, ("num_local_experts", "num_experts")))

    def moe_fields(self, config) -> dict:
        for name, what in ROUTING_REFUSED.items():
            if getattr(config, name, None) not in (None, 1, 1.0, "softmax", "greedy"):
                raise UnsupportedModelError(f"{self.architecture}: {name}={getattr(config, name)!r} asks for {what}, "
                                            "which hf-rebasin does not align (only plain softmax top-k routing)")
        sparse_step = getattr(config, "decoder_sparse_step", 1)
        if getattr(config, "mlp_only_layers", None) or sparse_step not in (None, 1):
            raise UnsupportedModelError(
                f"{self.architecture}: dense FFN layers among the MoE layers (mlp_only_layers="
                f"{getattr(config, 'mlp_only_layers', None)}, decoder_sparse_step={sparse_step}) are not supported: "
                "only models whose every layer is a sparse MoE block")
        return dict(n_experts=self.n_experts(config), expert_dim=getattr(config, self.expert_dim_field),
                    top_k=config.num_experts_per_tok, shared_expert=self.shared,
                    ffn_dim=config.shared_expert_intermediate_size if self.shared else 0)

    def moe_facts(self, config) -> dict:
        return {"norm_topk_prob": bool(getattr(config, "norm_topk_prob", True)), "hidden_act": config.hidden_act}

    def moe_notes(self, config) -> tuple[str, ...]:
        e, k = self.n_experts(config), config.num_experts_per_tok
        return (f"{e} experts per layer, top-{k} softmax routing; experts permute with the router's rows",)

    # --- reading ----------------------------------------------------------------------------------------
    def _files_prefix(self, read, i: int) -> tuple[str, bool]:
        """The block's prefix in the files and whether they hold it per expert (else fused)."""
        fused = f"model.layers.{i}.{self.block}."
        if read.has(fused + FUSED[0]):
            return fused, False
        return f"model.layers.{i}.{self.file_block}.", True

    def moe_to_canonical(self, read, config, spec: Spec, i: int, gain) -> dict:
        pre, per_expert = self._files_prefix(read, i)
        e, f = spec.n_experts, spec.expert_dim
        if per_expert:
            g, u, dn = self.expert_files
            gate = torch.cat([read(f"{pre}experts.{k}.{g}.weight").T for k in range(e)], 1)
            up = torch.cat([read(f"{pre}experts.{k}.{u}.weight").T for k in range(e)], 1)
            down = torch.cat([read(f"{pre}experts.{k}.{dn}.weight").T for k in range(e)], 0)
        else:
            gate_up = read(pre + FUSED[0])  # (E, 2F, d)
            gate = gate_up[:, :f].permute(2, 0, 1).reshape(-1, e * f)
            up = gate_up[:, f:].permute(2, 0, 1).reshape(-1, e * f)
            down = read(pre + FUSED[1]).transpose(1, 2).reshape(e * f, -1)
        reads = {"moe.router": read(pre + "gate.weight").T, "moe.gate": gate, "moe.up": up}
        if self.shared:
            reads["mlp.shared_gate"] = read(pre + "shared_expert_gate.weight").T
            for name in ("gate", "up"):
                reads[f"mlp.{name}"] = read(f"{pre}shared_expert.{name}_proj.weight").T
        p = {layer_key(i, name): fold_norm(gain, None, w, None)[0] for name, w in reads.items()}
        p[layer_key(i, "moe.down")] = down
        if self.shared:
            p[layer_key(i, "mlp.down")] = read(pre + "shared_expert.down_proj.weight").T
        return p

    # --- writing ----------------------------------------------------------------------------------------
    def moe_from_canonical(self, p: dict, spec: Spec, i: int) -> dict:
        """The block's tensors under the class's own (fused) parameter names."""
        pre, e, f = f"model.layers.{i}.{self.block}.", spec.n_experts, spec.expert_dim
        as_experts = lambda w: w.reshape(-1, e, f).permute(1, 2, 0)  # (d, E·F) -> (E, F, d)
        sd = {pre + "gate.weight": p[layer_key(i, "moe.router")].T,
              pre + FUSED[0]: torch.cat([as_experts(p[layer_key(i, "moe.gate")]),
                                         as_experts(p[layer_key(i, "moe.up")])], 1),
              pre + FUSED[1]: p[layer_key(i, "moe.down")].reshape(e, f, -1).transpose(1, 2)}
        if self.shared:
            sd[pre + "shared_expert_gate.weight"] = p[layer_key(i, "mlp.shared_gate")].T
            for name in ("gate", "up", "down"):
                sd[f"{pre}shared_expert.{name}_proj.weight"] = p[layer_key(i, f"mlp.{name}")].T
        return sd

    def to_files(self, part: dict, files) -> dict:
        """The export's tensors under the names of the source's files: per expert where the source is."""
        if files is None or not any(".experts.0." in name for name in files):
            return super().to_files(part, files)
        out = {}
        for name, value in part.items():
            match = re.fullmatch(r"(model\.layers\.\d+\.)" + self.block + r"\.(.*)", name)
            if not match:
                out[name] = value
                continue
            pre, rest = match.group(1) + self.file_block + ".", match.group(2)
            g, u, dn = self.expert_files
            if rest == FUSED[0]:
                f = value.shape[1] // 2
                for k in range(value.shape[0]):
                    out[f"{pre}experts.{k}.{g}.weight"] = value[k, :f]
                    out[f"{pre}experts.{k}.{u}.weight"] = value[k, f:]
            elif rest == FUSED[1]:
                for k in range(value.shape[0]):
                    out[f"{pre}experts.{k}.{dn}.weight"] = value[k]
            else:
                out[pre + rest] = value
        return out

    # --- the hooks of the LLaMA-like adapter --------------------------------------------------------------
    def spec(self, config, **overrides):
        return super().spec(config, **{**self.moe_fields(config), **overrides})

    def notes(self, config) -> tuple[str, ...]:
        return super().notes(config) + self.moe_notes(config)

    def config_facts(self, config) -> dict:
        facts = {**super().config_facts(config), **self.moe_facts(config)}
        facts.pop("mlp_bias", None)  # the classes' experts have no biases
        return facts

    def layer_to_canonical(self, read, config, spec, i):
        p = super().layer_to_canonical(read, config, spec, i)
        gain = self.gain(read, f"model.layers.{i}.post_attention_layernorm.weight")
        p.update(self.moe_to_canonical(read, config, spec, i, gain))
        return p

    def layer_from_canonical(self, p, config, spec, i):
        sd = super().layer_from_canonical(p, config, spec, i)
        sd.update(self.moe_from_canonical(p, spec, i))
        return sd

    def module_parts(self, files):
        """Files (per expert or fused) as parts of the class's state dict: a layer's experts stacked when its last
        per-expert tensor has been read, every other tensor as it is (the router renamed to the class's block)."""
        pattern = re.compile(r"model\.layers\.(\d+)\." + self.file_block + r"\.(experts\.(\d+)\.(\w+)\.weight|.*)")
        g, u, dn = self.expert_files
        counts: dict[int, set] = {}  # the experts each layer's files hold (names only: nothing is read)
        for name in files:
            match = pattern.fullmatch(name)
            if match is not None and match.group(3) is not None:
                counts.setdefault(int(match.group(1)), set()).add(int(match.group(3)))
        pending: dict[int, dict] = {}
        for name in files:
            match = pattern.fullmatch(name)
            if match is None:
                yield {name: files[name]}
                continue
            i, pre = int(match.group(1)), f"model.layers.{match.group(1)}.{self.block}."
            if match.group(3) is None:
                yield {pre + match.group(2): files[name]}
                continue
            held = pending.setdefault(i, {})
            held[(match.group(4), int(match.group(3)))] = files[name]
            e = len(counts[i])
            if len(held) == 3 * e and all((n, k) in held for n in (g, u, dn) for k in range(e)):
                gate, up, down = (torch.stack([held[(n, k)] for k in range(e)]) for n in (g, u, dn))
                yield {pre + FUSED[0]: torch.cat([gate, up], 1), pre + FUSED[1]: down}
                del pending[i]
        if pending:
            raise ValueError(f"{self.architecture}: incomplete experts in the files of layers {sorted(pending)}")
