"""The CPU path's C++ ops (cpu_ops.cpp): paged decode attention and the few-rows linear,
compiled on first use.

The host's C++ compiler builds it once per source and torch version into
$BRIGADE_CACHE/kernels (default ~/.cache/brigade/kernels): about 20 s the first time, a
quarter of a second to load after. Each build writes a private file and renames it into place,
so concurrent workers never wait on each other's lock and a killed build leaves nothing half
written. Without a compiler or AVX2 + FMA the CPU path keeps its torch ops (gather + SDPA,
F.linear); `load()` logs why.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
HEAD_DIMS = (16, 32, 64, 96, 128, 256)  # paged_decode's compiled head sizes
MAX_LINEAR_ROWS = 4  # few_rows_linear's
BUILD_TIMEOUT_S = 600
FLAGS = ("-shared", "-fPIC", "-std=c++20", "-O3", "-mavx2", "-mfma", "-fopenmp")


def _compile_command(output: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        os.environ.get("CXX", "c++"),
        str(SOURCE),
        *FLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-isystem{path}" for path in include_paths()),
        *(f"-L{path}" for path in library_paths()),
        "-lc10",
        "-ltorch_cpu",
        "-o",
        str(output),
    ]


def library_path() -> Path:
    """Where the build for this source, these flags and this torch lives."""
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join((*FLAGS, torch.__version__)).encode()).hexdigest()[:16]
    root = Path(os.environ.get("BRIGADE_CACHE", Path.home() / ".cache" / "brigade"))
    return root / "kernels" / f"cpu_ops-{key}.so"


@functools.cache
def load() -> bool:
    """Build (or find the build of) the op and load it; False, logged, where it cannot be."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        log.info("cpu_ops: this CPU has no AVX2; the CPU path keeps its torch ops")
        return False
    path = library_path()
    try:
        if not path.exists():
            log.info("cpu_ops: compiling the CPU kernels once (about 20 s) into %s", path)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so.tmp", dir=path.parent)
            os.close(fd)
            try:
                subprocess.run(
                    _compile_command(Path(tmp)), check=True, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
                )
                os.replace(tmp, path)
            finally:
                Path(tmp).unlink(missing_ok=True)
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        detail = exc.stderr[-2000:] if isinstance(exc, subprocess.CalledProcessError) else exc
        log.warning("cpu_ops: not available (%s); the CPU path keeps its torch ops", detail)
        return False
    return True


def has_paged_decode(head_dim: int, dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and head_dim in HEAD_DIMS and load()


def has_few_rows_linear(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and load()


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [S, Hq, D] (one token per sequence) over its context in the caches [N, block_size, Hk, D]:
    block_tables [S, max_blocks] and seq_lens [S] (int64 avoids a conversion per call) -> [S, Hq, D]."""
    return torch.ops.brigade.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale)


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for x of at most MAX_LINEAR_ROWS rows, from the [out, in] weight read once."""
    return torch.ops.brigade.few_rows_linear(x, weight, bias)
