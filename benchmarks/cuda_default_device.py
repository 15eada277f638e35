"""A pytest plugin for benchmarks/gpu_check.py: runs the Triton kernels' tests (written for the
interpreter on CPU tensors) on the GPU.

    TRITON_INTERPRET=0 python -m pytest tests/test_kernels.py -p benchmarks.cuda_default_device -k triton

CUDA becomes torch's default device, so the tensors a test makes without a device are on the GPU.
A few tests build some inputs on the CPU on purpose (`torch.from_numpy`, a rotary table made
for "cpu"); a CPU pointer handed to a compiled kernel fails before it runs, which would say nothing
about the kernel. So every `*_triton` launcher of kernels/ takes its CPU tensor arguments to the
GPU (in lists too), copies them back after the call (the launchers write some in place), and
returns its tensor outputs on the CPU when its first tensor argument was there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

KERNEL_MODULES = ("kv_store", "lora", "paged_attention", "rms_norm", "rotary", "token_bitmask")


def on_cuda(launch: Callable) -> Callable:
    @functools.wraps(launch)
    def wrapper(*args, **kwargs):
        moved: list[tuple[torch.Tensor, torch.Tensor]] = []

        def to_cuda(value):
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                moved.append((value, value.to("cuda")))
                return moved[-1][1]
            if isinstance(value, list | tuple):  # lora's per-module A and B lists
                return type(value)(map(to_cuda, value))
            return value

        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        out = launch(*map(to_cuda, args), **{k: to_cuda(v) for k, v in kwargs.items()})
        for original, copy in moved:
            original.copy_(copy)
        if first is None or first.device.type != "cpu":
            return out
        if isinstance(out, torch.Tensor):
            return out.cpu()
        if isinstance(out, tuple):
            return tuple(o.cpu() if isinstance(o, torch.Tensor) else o for o in out)
        return out

    return wrapper


def pytest_configure(config: pytest.Config) -> None:
    import importlib

    torch.set_default_device("cuda")
    # Before the test modules import the launchers by name.
    for name in KERNEL_MODULES:
        module = importlib.import_module(f"kernels.{name}")
        for attr in dir(module):
            if attr.endswith("_triton"):
                setattr(module, attr, on_cuda(getattr(module, attr)))
