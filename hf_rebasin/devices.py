"""Which device a --device option names (below the options and the methods, which both ask)."""
from __future__ import annotations


def resolve_device(device: str) -> str:
    """"auto": the GPU when torch sees one, else the CPU; anything else as given (cpu, cuda, cuda:N)."""
    import torch
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device
