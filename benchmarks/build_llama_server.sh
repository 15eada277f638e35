#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU, Release, no curl) from the llama-cpp-python source
# distribution on PyPI, into a cache dir. Prints the binary's path on success.
#
#   benchmarks/build_llama_server.sh [CACHE_DIR]    # default ~/.cache/brigade/llama.cpp
#
# Takes a while on a small machine (about 10-20 minutes on 2 cores); reruns reuse the build.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.16}"
CACHE="${1:-${BRIGADE_CACHE:-$HOME/.cache/brigade}/llama.cpp}"
PIP="${PIP:-$(dirname "$0")/../.venv/bin/pip}"
[ -x "$PIP" ] || PIP="python3 -m pip"
BIN="$CACHE/build/bin/llama-server"

if [ -x "$BIN" ]; then
  echo "$BIN"
  exit 0
fi
mkdir -p "$CACHE"
if [ ! -d "$CACHE/src" ]; then
  $PIP download --no-binary llama-cpp-python --no-deps --dest "$CACHE/sdist" "llama-cpp-python==$VERSION" >&2
  tmp="$(mktemp -d "$CACHE/.src-XXXXXX")"
  tar -xzf "$CACHE"/sdist/llama_cpp_python-"$VERSION".tar.gz -C "$tmp"
  mv "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" "$CACHE/src"
  rm -rf "$tmp"
fi
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
cmake -S "$CACHE/src" -B "$CACHE/build" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
  -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >&2
cmake --build "$CACHE/build" --target llama-server -j "$(nproc)" >&2
echo "$BIN"
