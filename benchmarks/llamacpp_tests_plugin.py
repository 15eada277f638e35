"""A pytest plugin (`-p llamacpp_tests_plugin`) for running llama.cpp's server tests
(tools/server/tests) against a Brigade gateway; see docs/gateway.md. It bends only what llama.cpp
does beyond OpenAI's API, so that the tests reach the API checks behind it:

- llama.cpp also serves its OpenAI routes without `/v1`; Brigade serves them under `/v1` only, as
  OpenAI does. llama.cpp's own routes (`/completion`, `/tokenize`, `/apply-template`, ...) stay as
  they are and answer 404.
- The tests name models llama.cpp ignores ("test", "gpt-3.5-turbo-instruct"); Brigade, as OpenAI
  and Anthropic do, answers 404 model_not_found for a model it does not serve, so the requests
  name the one it serves (BRIGADE_MODEL, default the embedded model's name). A null model stays
  null (a 400, as OpenAI's).
"""

import os
from typing import Any

import httpx
import requests
import utils  # llama.cpp's tests/utils.py

OPENAI_ROUTES = ("/chat/completions", "/completions", "/responses", "/models", "/embeddings")
SERVED_MODEL = os.environ.get("BRIGADE_MODEL", "SmolLM2-135M-Instruct")

_make_url = utils.ServerProcess.make_url
_post = requests.post
_build_request = httpx.Client.build_request


def make_url(self: utils.ServerProcess, path: str, host: str | None = None) -> str:
    if path.startswith(OPENAI_ROUTES):
        path = "/v1" + path
    return _make_url(self, path, host)


def served_model(body: Any) -> Any:
    if isinstance(body, dict) and body.get("model") is not None:
        return {**body, "model": SERVED_MODEL}
    return body


utils.ServerProcess.make_url = make_url
requests.post = lambda url, *args, json=None, **kwargs: _post(url, *args, json=served_model(json), **kwargs)
httpx.Client.build_request = lambda self, *args, json=None, **kwargs: _build_request(
    self, *args, json=served_model(json), **kwargs
)
