"""Turn the configured model into an HF-format directory (GGUF files are converted once, then
cached) and print its path. The supervisor runs this as a child process,

    python -m services.gpu_worker.prepare SOURCE CACHE_DIR REVISION [DRAFT_DIR]
                                                                      ("" = the default for each)

so that it never imports the loader's heavy dependencies itself (torch, gguf). It lives beside
the loader: the worker's folder owns model files. DRAFT_DIR (speculative.model) is checked
against the model (architectures.py `check_draft_model`). A failure is one line on stderr
and exit code 1."""

from __future__ import annotations

import sys
from pathlib import Path

from services.gpu_worker.architectures import check_draft_model, config_from_dir
from services.gpu_worker.loader import prepare_model


def main(argv: list[str]) -> int:
    source, cache_dir, revision, *draft = argv
    try:
        model_dir = prepare_model(source or None, Path(cache_dir) if cache_dir else None, revision)
        if draft:
            check_draft_model(config_from_dir(model_dir), Path(draft[0]))
    except (OSError, ValueError) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(model_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
