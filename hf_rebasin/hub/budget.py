"""What a learned-matching run will cost, before it starts: its training tokens, its arithmetic and the GPU hours they
imply.

An estimate from arithmetic, not a measurement. A step of lm/dual on T tokens costs at least a forward and backward
of one model (6·P·T flop for P parameters) plus the group elements acting on the weights, forward and backward
(about 4·d·P flop whatever the batch; d the residual width): 6·P·T·(1 + 2d/(3T)) per step (BENCHMARKS.md, step
cost); gradient checkpointing runs every forward twice, 8·P·T·(1 + 2d/(3T)). GPU hours take the GPU of Li & Shen's
runs (an RTX A6000: 154.8 dense bf16 TFLOPS) at an assumed 40 % of its peak; ``benchmarks/gpu_check.py`` measures
the real tokens/s of a GPU, which replaces the assumption.
"""
from __future__ import annotations

from dataclasses import dataclass

REFERENCE_GPU = "RTX A6000"
REFERENCE_TFLOPS = 154.8  # dense bf16 tensor throughput of the reference GPU
ASSUMED_UTILISATION = 0.40


@dataclass(frozen=True)
class TrainingBudget:
    params: int  # of one model
    d_model: int
    steps: int
    batch: int  # windows per step (all processes together)
    seq_len: int
    processes: int = 1
    checkpointing: bool = False

    @property
    def tokens(self) -> int:
        return self.steps * self.batch * self.seq_len

    @property
    def flops(self) -> float:
        per_step = self.batch * self.seq_len
        passes = 8.0 if self.checkpointing else 6.0  # forward 2, backward 4, a recomputed forward 2
        return passes * self.params * self.tokens * (1 + 2 * self.d_model / (3 * per_step))

    @property
    def gpu_hours(self) -> float:
        return self.flops / (REFERENCE_TFLOPS * 1e12 * ASSUMED_UTILISATION) / 3600

    def summary(self) -> str:
        wall = f", {self.gpu_hours / self.processes:.1f} h on {self.processes} GPUs" if self.processes > 1 else ""
        return (f"{self.steps:,} steps × {self.batch} × {self.seq_len} tokens = {self.tokens:,} training tokens; "
                f"{self.flops:.2e} flop ≈ {self.gpu_hours:.1f} GPU-hours{wall} on {REFERENCE_GPU}-class GPUs "
                f"(estimate: {ASSUMED_UTILISATION:.0%} of {REFERENCE_TFLOPS} bf16 TFLOPS assumed; "
                "benchmarks/gpu_check.py measures a GPU's tokens/s)")


def training_budget(source: str, steps: int, batch: int, seq_len: int | None = None, processes: int = 1,
                    checkpointing: bool = False) -> TrainingBudget:
    """The budget of learning on `source`'s architecture (a local folder or a Hub id; its config alone is read);
    seq_len None: merge's default, min(512, the model's context)."""
    from ..describe import describe
    facts = describe(source)
    seq_len = seq_len or min(512, facts["context_length"] or 512)
    return TrainingBudget(facts["parameters"], facts["d_model"], steps, batch, seq_len, processes, checkpointing)
