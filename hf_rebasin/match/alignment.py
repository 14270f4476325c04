"""What every matching method takes and returns (the registry in __init__.py lists the methods; the methods
import this module, never the registry)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (torch is not needed to read the registry)
    from ..core.symmetry import Transform

DEFAULT_HOLDOUT = 32  # training examples held out to choose the returned learned parameters (at most)


@dataclass
class Alignment:
    """One transform per model (applied to that model's canonical graph), what the method logged and settled."""

    transforms: list[Transform]
    log: list[dict] = field(default_factory=list)
    settings: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def transform_a(self) -> Transform:
        return self.transforms[0]

    @property
    def transform_b(self) -> Transform:
        return self.transforms[1]


@dataclass
class MatchContext:
    """What a method may use besides the graphs (data-free methods ignore the data)."""

    options: Any  # options.MergeOptions
    template: Any = None  # models.Loaded of the first model (builds models for activations and the task loss)
    match_data: Any = None  # sources.eval_data.EvalData for activation matching
    train_data: Any = None  # sources.eval_data.EvalData for learned matching
    eval_data: Any = None  # the held-out data (learned matching's progress estimate)
    progress: bool = True
