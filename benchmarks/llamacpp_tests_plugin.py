"""A pytest plugin (`-p llamacpp_tests_plugin`) for running llama.cpp's server tests
(tools/server/tests) against a Brigade gateway; see docs/gateway.md. It bends only what llama.cpp
does beyond OpenAI's API, so that the tests reach the API checks behind it:

- llama.cpp also serves its OpenAI routes without `/v1`; Brigade serves them under `/v1` only, as
  OpenAI does. llama.cpp's own routes (`/completion`, `/tokenize`, `/apply-template`, ...) stay as
  they are (Brigade serves the first ones: docs/gateway.md, "llama.cpp's own API").
- A test's server preset gives a request's defaults with server flags an external server does not
  get: `--n-predict` (the cap of a `/completion` without `n_predict`, which would otherwise
  generate to the end of the context) and `--seed` (the seed of one without `seed`). A
  `/completion` body without them gets the preset's.
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


def with_server_defaults(send: Any) -> Any:
    """`send` (make_request or make_stream_request), a /completion body given the preset's
    n_predict and seed where it has none."""

    def bounded(
        self: utils.ServerProcess, method: str, path: str, data: Any = None, *args: Any, **kwargs: Any
    ) -> Any:
        if path == "/completion" and isinstance(data, dict):
            defaults = {"n_predict": self.n_predict, "seed": self.seed}
            data = {**{k: v for k, v in defaults.items() if v is not None}, **data}
        return send(self, method, path, data, *args, **kwargs)

    return bounded


utils.ServerProcess.make_url = make_url
utils.ServerProcess.make_request = with_server_defaults(utils.ServerProcess.make_request)
utils.ServerProcess.make_stream_request = with_server_defaults(utils.ServerProcess.make_stream_request)
requests.post = lambda url, *args, json=None, **kwargs: _post(url, *args, json=served_model(json), **kwargs)
httpx.Client.build_request = lambda self, *args, json=None, **kwargs: _build_request(
    self, *args, json=served_model(json), **kwargs
)
