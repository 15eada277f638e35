#!/usr/bin/env bash
# Run llama.cpp's own server tests (tools/server/tests: chat, completion, Responses, Anthropic,
# tokenize)
# against a running Brigade gateway, as an external server. See docs/gateway.md for the failures
# to expect (all specific to llama.cpp's test model, flags or endpoints).
#
#   benchmarks/llamacpp_server_tests.sh PORT [pytest args...]
#
# The tests come from the llama-cpp-python sdist on PyPI (it vendors llama.cpp; the same version as
# build_llama_server.sh) and run in a venv of their own (WORK, default /tmp/llamacpp-server-tests).
set -euo pipefail

PORT="$1"
shift
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
WORK="${WORK:-/tmp/llamacpp-server-tests}"
HERE="$(cd "$(dirname "$0")" && pwd)"
TESTS="$WORK/llama.cpp-$VERSION/tests"

mkdir -p "$WORK"
if [ ! -d "$TESTS" ]; then
  python3 -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK/sdist"
  tar -xzf "$WORK/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$WORK" \
    "llama_cpp_python-$VERSION/vendor/llama.cpp/tools/server/tests"
  mkdir -p "$(dirname "$TESTS")"
  mv "$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp/tools/server/tests" "$TESTS"
fi
if [ ! -x "$WORK/venv/bin/pytest" ]; then
  python3 -m venv "$WORK/venv"
  "$WORK/venv/bin/pip" install -q -r "$TESTS/requirements.txt" pytest-timeout
fi
cd "$TESTS"
DEBUG_EXTERNAL=1 PORT="$PORT" PYTHONPATH="$HERE:$TESTS" "$WORK/venv/bin/python" -m pytest \
  -p llamacpp_tests_plugin -p no:cacheprovider --timeout 120 -q -rf \
  unit/test_chat_completion.py unit/test_completion.py unit/test_compat_oai_responses.py \
  unit/test_compat_anthropic.py unit/test_tokenize.py "$@"
