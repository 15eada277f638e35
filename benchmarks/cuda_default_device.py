"""A pytest plugin for benchmarks/gpu_check.py: the kernel tests make their tensors without a
device, so with CUDA as torch's default device they run the Triton kernels on the GPU.

    python -m pytest tests/test_kernels.py -p benchmarks.cuda_default_device -k triton
"""

from __future__ import annotations

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    torch.set_default_device("cuda")
