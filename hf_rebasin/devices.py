"""Which device a --device option names (below the options and the methods, which both ask)."""
from __future__ import annotations


def resolve_device(device: str) -> str:
    """"auto": the GPU when torch sees one, else the CPU; anything else as given (cpu, cuda, cuda:N)."""
    import torch
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def device_problems(device: str | None, flag: str) -> list[str]:
    if device in (None, "auto", "cpu"):
        return []
    if device == "cuda" or device.startswith("cuda:"):
        import torch
        index = device.partition(":")[2]
        if index and not index.isdigit():
            return [f"{flag} {device!r} is not a device: use cpu, cuda or cuda:N"]
        if not torch.cuda.is_available():
            return [f"{flag} {device} was asked for, but torch sees no CUDA GPU: use {flag} cpu (or auto)"]
        if index and int(index) >= torch.cuda.device_count():
            return [f"{flag} {device}: only {torch.cuda.device_count()} CUDA GPU(s) are present"]
        return []
    return [f"{flag} {device!r} is not a device hf-rebasin runs on: use auto, cpu, cuda or cuda:N"]
