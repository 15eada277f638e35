"""The CPU worker's large tensors (weights, KV pages) lie in transparent huge pages."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from services.gpu_worker.architectures import ModelConfig, MoeConfig
from services.gpu_worker.huge_pages import HUGE_PAGE_BYTES, SWITCH, huge_page_empty, huge_page_zeros
from services.gpu_worker.model import LlamaLayer, Shard, paged_kv_cache
from services.gpu_worker.parallel import Parallel
from tests.conftest import REPO_ROOT

CPU = torch.device("cpu")
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def grants_huge_pages() -> bool:
    return THP_SETTING.exists() and "[never]" not in THP_SETTING.read_text()


def mapping_of(address: int) -> dict[str, int] | None:
    """The /proc/self/smaps fields (kB) of the mapping holding `address`, None if none does."""
    fields: dict[str, int] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            if fields is not None:
                return fields
            fields = {} if start <= address < end else None
        elif fields is not None and head.endswith(":") and line.split()[1].isdigit():
            fields[head.rstrip(":")] = int(line.split()[1])  # kB, or THPeligible's 0 / 1
    return fields


@pytest.fixture(autouse=True)
def huge_pages_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SWITCH, raising=False)  # the default, whatever the shell running the tests set


def test_a_large_tensor_starts_on_a_huge_page_in_memory_asked_for_as_huge_pages() -> None:
    tensor = huge_page_zeros((3, 1 << 20), torch.float32, CPU)  # 12 MB
    assert tensor.shape == (3, 1 << 20) and tensor.dtype == torch.float32
    assert tensor.data_ptr() % HUGE_PAGE_BYTES == 0
    assert tensor.abs().sum().item() == 0
    tensor.fill_(2.5)
    assert tensor.sum().item() == 2.5 * tensor.numel()
    mapping = mapping_of(tensor.data_ptr())
    assert mapping is not None
    if not grants_huge_pages() or "THPeligible" not in mapping:
        pytest.skip(f"{THP_SETTING}: never, or a kernel that does not say THPeligible")
    # Whether the kernel may back the mapping with huge pages (under `madvise`, only if asked):
    # how many it does depends on how fragmented memory is.
    assert mapping["THPeligible"] == 1, mapping


def test_switched_off_the_memory_is_torchs() -> None:
    """In a fresh process: in this one, heap memory that numpy freed (it madvises its arrays of
    4 MB or more) may come back to torch's allocator still marked for huge pages."""
    code = textwrap.dedent(
        """
        import json, torch
        from services.gpu_worker.huge_pages import huge_page_zeros
        from tests.test_huge_pages import mapping_of
        tensor = huge_page_zeros((1 << 21,), torch.float32, torch.device("cpu"))
        print(json.dumps(mapping_of(tensor.data_ptr())))
        """
    )
    env = {**os.environ, SWITCH: "0", "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120, check=True)  # fmt: skip
    mapping = json.loads(done.stdout)
    assert mapping is not None
    if THP_SETTING.exists() and "[madvise]" in THP_SETTING.read_text() and "THPeligible" in mapping:
        assert mapping["THPeligible"] == 0, mapping  # torch's allocator asks for none


def test_the_mapping_goes_with_the_tensors_last_view() -> None:
    tensor = huge_page_empty((HUGE_PAGE_BYTES // 2,), torch.bfloat16, CPU)
    view = tensor.view(2, -1)[1]
    address = tensor.data_ptr()
    del tensor
    gc.collect()
    assert mapping_of(address) is not None  # the view keeps it
    del view
    gc.collect()
    assert mapping_of(address) is None


def test_small_tensors_and_other_devices_are_torch_empty() -> None:
    small = huge_page_empty((4, 1024), torch.float32, CPU)  # 16 KB: no huge page to fill
    assert small.shape == (4, 1024) and small.is_contiguous()
    meta = huge_page_zeros((1 << 21,), torch.float32, torch.device("meta"))
    assert meta.device.type == "meta" and meta.shape == (1 << 21,)


def test_a_layers_large_weights_and_the_kv_pages_start_on_huge_pages() -> None:
    config = ModelConfig(
        architecture="test", vocab_size=1, hidden_size=512, intermediate_size=1024,
        num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=1, rms_norm_eps=1e-6, tie_word_embeddings=True,
    )  # fmt: skip
    shard = Shard.of(config, Parallel())
    dense = LlamaLayer(config, shard, torch.float32, CPU)
    sparse_config = replace(config, moe=MoeConfig(16, 2, 256, True, 0, (True,)))
    sparse = LlamaLayer(
        sparse_config, Shard.of(sparse_config, Parallel()), torch.float32, CPU, is_sparse=True
    )
    large = [dense.gate_up, dense.down, sparse.experts_gate_up, sparse.experts_down]
    assert all(w.nbytes >= HUGE_PAGE_BYTES for w in large)
    assert [w.data_ptr() % HUGE_PAGE_BYTES for w in large] == [0] * len(large)
    ((keys, values),) = paged_kv_cache(
        config, 8, num_blocks=128, block_size=16, dtype=torch.float32, device=CPU
    )
    assert keys.data_ptr() % HUGE_PAGE_BYTES == 0 and values.data_ptr() % HUGE_PAGE_BYTES == 0
    assert keys.abs().sum().item() == 0  # zeroed: padding never reads garbage
