#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU, Release, no curl) from the llama-cpp-python source
# distribution on PyPI, into a cache dir. Prints the binary's path on success.
#
#   benchmarks/build_llama_server.sh [CACHE_DIR]    # default ~/.cache/brigade/llama.cpp
#
# LLAMA_CPP_PYTHON_VERSION picks the sdist (default: the newest when this was last updated, so that
# a comparison names the llama.cpp it ran). Takes a while on a small machine (10-30 minutes on 2
# cores); reruns of the same version reuse the build, another version rebuilds.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${1:-${BRIGADE_CACHE:-$HOME/.cache/brigade}/llama.cpp}"
PIP="${PIP:-$(dirname "$0")/../.venv/bin/pip}"
[ -x "$PIP" ] || PIP="python3 -m pip"
BIN="$CACHE/build/bin/llama-server"

if [ -x "$BIN" ] && [ "$(cat "$CACHE/version" 2>/dev/null)" = "$VERSION" ]; then
  echo "$BIN"
  exit 0
fi
if [ "$(cat "$CACHE/version" 2>/dev/null)" != "$VERSION" ]; then
  rm -rf "$CACHE/src" "$CACHE/build"  # another version's (or an unstamped) source and build
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
# Nothing fetched while building: no curl or OpenSSL (the model is a local file), no prebuilt web
# UI download (the benchmark uses the API only); older sources ignore the flags they lack.
cmake -S "$CACHE/src" -B "$CACHE/build" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
  -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >&2
cmake --build "$CACHE/build" --target llama-server -j "$(nproc)" >&2
echo "$VERSION" >"$CACHE/version"
echo "$BIN"
