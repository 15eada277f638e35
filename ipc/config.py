"""The run configuration: one YAML file decoded by msgspec into frozen, typed structs.

Every field is documented in docs/config.md. Errors name the field path and the problem, e.g.
`engine.max_num_seqs: expected int >= 1, got -3`. This module is light (no torch): every stage
reads the same config from the run directory.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import pwd
import re
import stat
import unicodedata
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml

from ipc.ports import PORT_SPAN, PORTS_PER_KIND, is_loopback

Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Fraction = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
# Waits take their timeouts up to threading.TIMEOUT_MAX (~292 years on Linux), sockets as much:
# past it, Event.wait and settimeout raise OverflowError (the MLflow sink's thread died on
# observability.mlflow.interval_s 1.0e+10, an image fetch on encoder.remote_image_timeout_s).
MAX_SECONDS = 1e9  # ~31 years
Seconds = Annotated[float, msgspec.Meta(gt=0.0, le=MAX_SECONDS)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
# A stage's processes (replicas, engine groups): past a few hundred a typo (an extra zero or
# three) would fork until the host runs out of processes or memory, long before any check says so.
MAX_PROCESSES_PER_STAGE = 256
Replicas = Annotated[int, msgspec.Meta(ge=1, le=MAX_PROCESSES_PER_STAGE)]
ReplicasOrNone = Annotated[int, msgspec.Meta(ge=0, le=MAX_PROCESSES_PER_STAGE)]
# Ranks of one engine group: each rank reads every step slot, and a ring has room for 504 readers;
# 64 is past any real host or Ray placement of one group.
MAX_TENSOR_PARALLEL = 64
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0.0)]


class ConfigError(ValueError):
    """A config file or override that does not fit the schema; the message names the field."""


class ModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    path: str = ""  # "" = the embedded SmolLM2-135M-Instruct
    revision: str = ""  # of a hub id in `path`: a branch, tag or commit; "" = main
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: Positive = 2048
    cache_dir: str = ""  # "" = ~/.cache/brigade/models
    generation_config: Literal["auto", "none"] = "auto"  # sampling defaults from the model's file, or not
    # on top of those, e.g. {"temperature": 0.7}; checked before a run starts
    # (ipc.sampling_defaults.check_generation_overrides: its checks need the sampling messages)
    override_generation_config: dict[str, Any] = {}
    # Serve the model for embeddings (prefill only, one pooled vector per input): `embed`, or
    # `auto` = embed where the checkpoint says so (a sentence-transformers modules.json beside the
    # weights, or an encoder-only architecture), else generate. services/common/pooling.py.
    task: Literal["auto", "generate", "embed"] = "auto"
    # How an embed model pools its token states when the checkpoint's sentence-transformers
    # 1_Pooling/config.json does not say: "" = last for a decoder, cls for an encoder.
    pooling: Literal["", "last", "mean", "cls"] = ""
    # L2-normalize the vectors; None = as the checkpoint's modules.json says (a Normalize module),
    # else on.
    normalize: bool | None = None


class EngineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    device: Literal["cpu", "cuda"] = "cpu"
    data_parallel: Replicas = 1
    tensor_parallel: Annotated[int, msgspec.Meta(ge=1, le=MAX_TENSOR_PARALLEL)] = 1
    # A mixture of experts' experts divided among the tensor-parallel ranks, whole, rather than
    # each expert's columns split over every rank (services/gpu_worker/model.py Shard).
    expert_parallel: bool = False
    devices: list[NonNegative] = []  # CUDA device ids for all workers, in order; [] = 0..D*T-1
    block_size: Positive = 16
    kv_cache_mib: Positive = 512  # CPU KV budget per worker
    gpu_memory_utilization: Fraction = 0.9
    max_num_seqs: Positive = 64
    max_num_batched_tokens: Positive = 2048
    max_num_waiting: Positive = 1024
    enable_prefix_caching: bool = True
    threads: NonNegative = 0  # CPU threads per worker; 0 = all cores
    cpu_int8_activations: bool = False  # GGUF-block GEMVs on 8-bit activations (changes the numbers)
    # Steps of 5+ rows (prefills, batched decodes) multiply in bf16 where the CPU has it (changes the numbers)
    cpu_wide_step_dtype: Literal["float32", "bfloat16"] = "float32"
    # The paged KV cache's dtype: auto = the model's; bfloat16 under a float32 CPU model halves
    # its memory and the bytes decode attention reads (changes the numbers)
    kv_cache_dtype: Literal["auto", "bfloat16"] = "auto"
    # CUDA: decode steps of up to this many sequences replay CUDA graphs captured at start, one
    # per padded batch size (services/gpu_worker/cuda_graphs.py); 0 = every step eager.
    cuda_graph_max_batch: NonNegative = 256
    cpu_affinity: bool = True  # CPU workers' threads one per core, other stages off their main cores
    step_timeout_s: Seconds = 120.0  # below supervisor.hang_timeout_s (see check_timeouts)


class TokenizerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    replicas: Replicas = 1
    default_max_tokens: Positive = 256
    # A request's work budget on the single-threaded tokenizer (and the gateway's /tokenize): all
    # the text that reaches the chat template (tool calls and tools JSON included) and the prompt
    # it renders to, the number of messages, and the time the template may take to render.
    max_prompt_chars: Positive = 1_000_000
    max_messages: Positive = 4096
    template_timeout_s: Seconds = 1.0
    stall_timeout_s: Seconds = 10.0  # a request quiet this long is checked with its scheduler
    # A client whose queue is full (it reads slowly) has its replies held and sent once it reads;
    # one whose queue takes none of them for this long is treated as gone: its requests are aborted.
    slow_client_timeout_s: Seconds = 30.0


class StructuredConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Budgets of structured output (docs/structured_output.md, "Budgets"): what one constraint
    may cost the scheduler before it is refused, or failed while it generates."""

    compile_timeout_ms: Positive = 1000  # compile + first mask of one constraint
    max_grammar_mib: Positive = 16  # memory that compile + first mask may allocate
    grammar_cache_mib: Positive = 128  # compiled grammars kept, estimated by their allocations
    mask_timeout_ms: Positive = 200  # one request's mask in one step
    lexer_fuel: Positive = 200_000  # llguidance's initial_lexer_fuel (its default: 1_000_000)
    # A client (API key, else address) with this many constraints refused as over the compile
    # budgets above within costly_compile_window_s gets 429 for its constrained requests until
    # the oldest leaves the window (services/gateway/refusal_limits.py); 0 = no limit.
    max_costly_compiles: NonNegative = 4
    costly_compile_window_s: Seconds = 60.0


MAX_SPECULATIVE_TOKENS = 16  # proposals one row verifies per step (sizes the step-result slots)
# LoRA slots: a step's header names each slot's adapter (up to 256 characters), and the few it
# copies in ahead, within the ring slot's header room (ipc/step_plan.py HEADER_BYTES).
MAX_LORA_SLOTS = 32


class SpeculativeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Speculative decoding (docs/speculative.md): names as vLLM's speculative_config."""

    method: Literal["none", "ngram", "draft_model"] = "none"
    num_speculative_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_SPECULATIVE_TOKENS)] = 4
    prompt_lookup_min: Positive = 1  # the n-gram proposer's shortest match
    prompt_lookup_max: Positive = 4  # and its longest (the longest that matches wins)
    # draft_model: the draft's HF-format directory (absolute), a smaller model with the target's
    # vocabulary, run by the same worker (services/gpu_worker/draft.py).
    model: str = ""


class DetokenizerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    replicas: Replicas = 1


class EncoderConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The encoder stage (services/encoder/): a vision-language model's vision tower. 0 replicas:
    none (a text model, or a vision-language model served for text only)."""

    replicas: ReplicasOrNone = 0
    # No encoder stage: the worker of engine group 0 (rank 0) runs the tower between its steps, as
    # an in-process vision tower would: the baseline benchmarks/encoder_bench.py measures the stage
    # against. It serves the endpoint and the cache of encoder 0. Needs replicas 0.
    in_worker: bool = False
    # The cache of image embeddings each replica keeps in shared memory (ipc/embedding_cache.py).
    cache_bytes: Positive = 256 << 20
    # One image: its file (a data URL's decoded bytes, or a fetched body), and its pixels (checked
    # from its header, before it is decoded).
    max_image_bytes: Positive = 10 << 20
    max_image_pixels: Positive = 40_000_000
    # http(s) image URLs, fetched by the tokenizers (services/common/image_fetch.py): on, as in
    # vLLM; from any host unless `remote_image_domains` lists some (each with its subdomains).
    remote_images: bool = True
    remote_image_domains: list[str] = []
    remote_image_timeout_s: Seconds = 10.0  # one image's whole fetch, redirects included
    remote_image_max_redirects: NonNegative = 5

    @property
    def num_encoders(self) -> int:
        """The encoders the tokenizers ask, each at `Endpoints.encoder(i)` with its cache at
        `Endpoints.embedding_cache(i)`: the replicas, or the one in the worker (`in_worker`)."""
        return 1 if self.in_worker else self.replicas


class GatewayTlsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """HTTPS at the gateway (services/tls.py); the files are read again when they change."""

    certfile: str = ""  # PEM: the server's certificate (chain); "" = plain HTTP
    keyfile: str = ""  # PEM: its private key
    client_ca: str = ""  # PEM: CAs whose client certificates are required (mTLS); "" = none asked


class AccessLogConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One JSON line per API call (services/access_log.py)."""

    path: str = ""  # "" = no access log
    max_bytes: Positive = 64 << 20  # the file is rotated before it would grow past this
    backups: NonNegative = 3  # rotated files kept: path.1 ... path.N
    include_text: bool = False  # the prompts and the output text too


class GatewayConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    replicas: ReplicasOrNone = 1  # HTTP processes sharing one port (SO_REUSEPORT); 0 = no HTTP API
    host: str = "127.0.0.1"
    port: Port = 8000
    api_keys: list[str] = []  # [] = open, unless BRIGADE_API_KEYS lists some
    # Web pages of these origins may call the API from a browser (CORS; "*" = any, vLLM's and
    # llama-server's default). [] = none: a page the user visits cannot use a server on their host.
    cors_origins: list[str] = []
    served_model_name: str = ""  # "" = the model's name
    max_concurrent_requests: Positive = 512  # per replica; past it, 429
    # /v1/responses kept for previous_response_id and GET, in <run-dir>/responses (every replica's)
    responses_max_stored: NonNegative = 1000  # 0 = store none (store: true is then ignored)
    responses_max_age_s: Seconds = 7 * 86400.0
    # Slow clients (slowloris): the request line and headers must arrive within header_timeout_s
    # and in at most max_header_bytes, the body within body_timeout_s; an idle kept-alive
    # connection is closed after keep_alive_timeout_s. A client that stops reading its response
    # (its writes stay blocked for write_timeout_s) is treated as gone: the connection is dropped.
    header_timeout_s: Seconds = 10.0
    max_header_bytes: Positive = 64 * 1024
    body_timeout_s: Seconds = 60.0
    keep_alive_timeout_s: Seconds = 5.0
    write_timeout_s: Seconds = 30.0
    # Whether an API client may set vLLM's `priority` (as vLLM's --scheduling-policy priority):
    # one that may can put its requests ahead of every other client's, and theirs first in line
    # to be preempted; off, a non-zero priority is a 400. The SDK's clients always may.
    accept_priority: bool = False
    # A client with max_oversized_requests requests refused for their size (body bytes, messages,
    # prompt characters, nesting) within oversized_window_s gets 429 for its large bodies, before
    # they are read, until the oldest leaves the window (services/gateway/refusal_limits.py); 0 = off.
    max_oversized_requests: NonNegative = 4
    oversized_window_s: Seconds = 60.0
    # A stream waiting for output (a long prefill, a queue) sends an SSE comment line this often,
    # so that proxies and load balancers do not close it as idle.
    sse_keepalive_s: Seconds = 15.0
    # How reasoning models' <think>...</think> (or harmony's analysis channel) becomes
    # reasoning_content (services/gateway/reasoning.py): auto = from the model's architecture,
    # chat template and tokenizer, none = left in the content.
    reasoning_parser: Literal["auto", "none", "qwen3", "deepseek_r1", "harmony"] = "auto"
    tls: GatewayTlsConfig = GatewayTlsConfig()
    access_log: AccessLogConfig = AccessLogConfig()


class SupervisorConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    restart_intensity: NonNegative = 5  # restarts allowed per stage within restart_period_s
    restart_period_s: Seconds = 60.0
    backoff_initial_s: Seconds = 0.2
    backoff_max_s: Seconds = 5.0
    heartbeat_interval_s: Seconds = 0.5
    hang_timeout_s: Seconds = 180.0  # a stage with work and no progress this long is restarted
    start_timeout_s: Seconds = 600.0
    drain_timeout_s: Seconds = 10.0
    metrics_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8001  # 0 = no /metrics endpoint
    metrics_host: str = ""  # where /metrics listens; "" = gateway.host
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    # Started as root, every stage runs as this user (a name or a uid), the gateway once it has
    # bound its port (services/privileges.py); "" = the supervisor's own user.
    run_as: str = ""


class MlflowConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    tracking_uri: str = ""  # "" = off; sqlite:///path.db, http://host:5000, file:/path
    experiment: str = "brigade"
    interval_s: Seconds = 30.0
    sample_requests: NonNegative = 0  # requests (prompt and output) logged per interval; 0 = none
    max_buffered: Positive = 1000  # points kept while the server is unreachable; older ones are dropped


class ObservabilityConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    audit_log: str = ""  # "" = <run-dir>/audit.log
    mlflow: MlflowConfig = MlflowConfig()


class ClusterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    backend: Literal["local", "ray"] = "local"  # ray: stages placed on a Ray cluster (pip install '.[ray]')
    ray_address: str = "auto"  # ray.init's address; auto = the cluster this host belongs to
    engine_resources: dict[str, float] = {}  # custom resources one engine group takes from its node
    engine_cpus: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0  # CPUs one engine group takes from its node
    light_resources: dict[str, float] = {}  # what each tokenizer, detokenizer, gateway takes; {} = head node
    placement_timeout_s: Seconds = 120.0  # an engine group with no node by then fails the start


class NetworkConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    transport: Literal["ipc", "tcp"] = "ipc"  # tcp = every ZeroMQ link over tcp://, even on one host
    host: str = "127.0.0.1"  # this host's address: where peers connect to its tcp:// links
    bind_host: str = ""  # the address tcp:// links listen on; "" = host (0.0.0.0 = every interface)
    port_base: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0  # 0 = the supervisor picks free ports
    curve: bool = True  # CURVE on every tcp:// link; false only when listening on loopback
    keys_dir: str = ""  # "" = a fresh key set per run under <run-dir>/curve; else read from here


# Beyond lora.unload_wait_s, how long every engine group has to answer a LoRA adapter command
# (the tokenizer's deadline; the gateway's client waits a little longer, to hear it).
ADAPTER_COMMAND_MARGIN_S = 150.0


class LoraConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """LoRA adapters (docs/lora.md): PEFT adapter directories checked against the model and
    kept resident in the worker's slots."""

    # Adapters resident and running at once, in as many slots per worker (one more, a spare,
    # where max_cpu_loras is larger: num_slots); 0 = adapters off
    max_loras: NonNegative = 0
    max_rank: Positive = 64  # an adapter of a higher rank is refused
    # The slots' A and B: "auto" = the model's dtype (float32 on the CPU: PEFT's numbers exactly);
    # "bfloat16" halves the bytes a decode step reads for them, rounding each weight to bfloat16.
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # Adapters loaded at once (lora.adapters and those loaded at run time), waiting in the
    # workers' host memory for a slot; 0 = max_loras (every adapter has a slot of its own).
    max_cpu_loras: NonNegative = 0
    adapters: dict[str, str] = {}  # name -> PEFT adapter directory, loaded at start
    # An unload that waits for the requests using its adapter gives up (409) after this long.
    unload_wait_s: Seconds = 60.0

    @property
    def num_slots(self) -> int:
        """The workers' slots: max_loras, plus one spare where adapters outnumber them (max_cpu_loras
        above max_loras), which running requests never hold all of at once, so that the next
        adapter is always copied in ahead of the step that admits its request
        (services/scheduler/lora_residency.py)."""
        return self.max_loras + (1 if 0 < self.max_loras < self.max_cpu_loras else 0)


class AutoscaleConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The number of engine groups, decided from their load (supervision/autoscale.py); off by
    default, when engine.data_parallel alone sets it."""

    enabled: bool = False
    min_groups: Replicas = 1
    max_groups: Replicas = 4  # and no more than the host's devices (or cores) on the local backend
    # Targets per group; a group above any of them asks for more groups. 0 = not a signal.
    target_waiting: Annotated[float, msgspec.Meta(gt=0.0)] = 4.0  # requests waiting in its scheduler
    target_running: NonNegativeFloat = 0.0  # sequences in its running batch
    target_kv_usage: Fraction = 0.8  # fraction of its KV blocks in use
    target_ttft_s: NonNegativeFloat = 0.0  # time to first token, where the samples carry it
    # Hysteresis: groups are removed only while the load would stay under this fraction of the
    # targets on the groups that remain, for all of scale_down_window_s.
    scale_down_ratio: Annotated[float, msgspec.Meta(gt=0.0, lt=1.0)] = 0.5
    scale_down_window_s: NonNegativeFloat = 60.0
    scale_up_cooldown_s: NonNegativeFloat = 30.0  # since the last change, before adding groups
    scale_down_cooldown_s: NonNegativeFloat = 120.0  # since the last change, before removing groups


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: ModelConfig = ModelConfig()
    engine: EngineConfig = EngineConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    detokenizer: DetokenizerConfig = DetokenizerConfig()
    encoder: EncoderConfig = EncoderConfig()
    gateway: GatewayConfig = GatewayConfig()
    supervisor: SupervisorConfig = SupervisorConfig()
    observability: ObservabilityConfig = ObservabilityConfig()
    cluster: ClusterConfig = ClusterConfig()
    network: NetworkConfig = NetworkConfig()
    structured: StructuredConfig = StructuredConfig()
    lora: LoraConfig = LoraConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    autoscale: AutoscaleConfig = AutoscaleConfig()


_PATH_IN_ERROR = re.compile(r"at `\$\.?(.*?)`")
_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `(.*?)`")
_KEY_IN_ERROR = re.compile(r"at `key` in `\$\.?(.*?)`")
_MISSING = object()


def _lookup(raw: Any, path: str) -> Any:
    node = raw
    for part in path.split(".") if path else []:
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _explain(exc: msgspec.ValidationError, raw: Any) -> str:
    """msgspec says ``Expected `int` >= 1 - at `$.engine.max_num_seqs` ``; we say
    `engine.max_num_seqs: expected int >= 1, got -3`."""
    text = str(exc)
    key_error = _KEY_IN_ERROR.search(text)
    if key_error:
        return f"{key_error.group(1) or 'the top level'}: field names must be strings"
    match = _PATH_IN_ERROR.search(text)
    where = match.group(1) if match else ""
    unknown = _UNKNOWN_FIELD.search(text)
    if unknown:
        field = f"{where}.{unknown.group(1)}" if where else unknown.group(1)
        return f"{field}: unknown field (see docs/config.md for the schema)"
    problem = _PATH_IN_ERROR.sub("", text).strip().rstrip("-").strip().replace("`", "")
    problem = problem[:1].lower() + problem[1:]
    value = _lookup(raw, where)
    if value is not _MISSING and ", got" not in problem and not problem.startswith("invalid enum value"):
        problem += f", got {value!r}"
    elif isinstance(value, str) and problem.endswith(", got str"):
        problem += f" {value[:80]!r}"
        if problem.startswith("expected float") and _is_exponent_text(value):
            # YAML 1.1 (PyYAML's) reads 1e-3 or 1.0e3 as text: its floats need a dot and a signed exponent.
            problem += " (YAML reads it as text: write 1.0e-3 or 1.0e+3 for a number with an exponent)"
    return f"{where}: {problem}" if where else problem


def _is_exponent_text(text: str) -> bool:
    try:
        return math.isfinite(float(text)) and "e" in text.lower()
    except ValueError:
        return False


class _ConfigLoader(yaml.SafeLoader):
    """yaml.SafeLoader, but a key given twice in one mapping is an error: PyYAML keeps the last,
    so a second `engine:` section silently dropped every setting of the first."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._checked: set[int] = set()

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        # Each mapping's own keys, the first time it is flattened: flattening copies the keys of a
        # `<<: *base` (which the mapping may override) into its node, and a mapping merged into
        # another is flattened before it is built.
        if id(node) not in self._checked:
            self._checked.add(id(node))
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = (
                    "="
                    if key_node.tag == "tag:yaml.org,2002:value"
                    else self.construct_object(key_node, deep=True)
                )
                try:
                    is_repeated = key in seen
                except TypeError:  # unhashable: SafeLoader's own construct_mapping says so
                    continue
                if is_repeated:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"found duplicate key {key!r}",
                        key_node.start_mark,
                    )
                seen.add(key)
        super().flatten_mapping(node)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        # YAML 1.1 reads `010` as octal 8 and `1:30` as base 60 (90): a config meaning ten or one
        # minute thirty would silently get another number (`07` reads the same either way).
        number = self._number(node, super().construct_yaml_int)
        digits = node.value.replace("_", "").lstrip("+-")
        if ":" in digits:
            raise AmbiguousNumber(node, number, "base 60, for the colon")
        if len(digits) > 1 and digits[0] == "0" and digits.isdigit() and int(digits, 8) != int(digits, 10):
            raise AmbiguousNumber(node, number, "octal, for the leading 0")
        return number

    def construct_yaml_float(self, node: yaml.ScalarNode) -> float:
        number = self._number(node, super().construct_yaml_float)
        if ":" in node.value:  # base 60 as well: `1:30.5` is 90.5
            raise AmbiguousNumber(node, number, "base 60, for the colon")
        return number

    @staticmethod
    def _number(node: yaml.ScalarNode, construct: Any) -> Any:
        # An explicit `!!int abc` or `!!int 08` reaches the constructor unchecked by the resolver.
        try:
            return construct(node)
        except ValueError:
            raise yaml.constructor.ConstructorError(
                None, None, f"{node.value!r} is not the number its tag says", node.start_mark
            ) from None


class AmbiguousNumber(yaml.constructor.ConstructorError):
    """A number YAML 1.1 reads otherwise than it looks (octal, base 60)."""

    def __init__(self, node: yaml.ScalarNode, number: float, why: str) -> None:
        super().__init__(
            None,
            None,
            f"{node.value!r} reads in YAML 1.1 as {number} ({why}): write the number without it, or quote "
            "it if it is text",
            node.start_mark,
        )


_ConfigLoader.add_constructor("tag:yaml.org,2002:int", _ConfigLoader.construct_yaml_int)
_ConfigLoader.add_constructor("tag:yaml.org,2002:float", _ConfigLoader.construct_yaml_float)


def _parse_scalar(text: str, key: str) -> Any:
    """`--set` values are YAML scalars: 3, 0.5, true, bfloat16, [0, 1]."""
    try:
        return yaml.load(text, Loader=_ConfigLoader) if text.strip() else ""
    except yaml.constructor.ConstructorError as exc:
        raise ConfigError(f"--set {key}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set value {text!r} is not a YAML scalar: {exc}") from None
    except RecursionError:  # as a file's, in _read_yaml
        raise ConfigError(f"--set value {text[:40]!r}... is nested too deeply to be a config value") from None


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """Apply one `key.path=value` override to the raw (not yet typed) config mapping."""
    key, sep, value = assignment.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set expects key.path=value, got {assignment!r}")
    parts = key.strip().split(".")
    if "" in parts:  # msgspec would name the field "" (`engine.: unknown field`), or nothing at all
        raise ConfigError(
            f"--set expects key.path=value with a field name between every two dots, got {assignment!r}"
        )
    if parts[0] in DEPRECATED_SECTIONS:
        new = DEPRECATED_SECTIONS[parts[0]]
        logging.getLogger("brigade.config").warning(
            "%s: section %r is deprecated: call it %r", key, parts[0], new
        )
        parts[0] = new
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{key}: {part} is not a section")
        node = child
    node[parts[-1]] = _parse_scalar(value, key.strip())


MAX_CONFIG_BYTES = 1 << 20
# Every value of a file within MAX_CONFIG_BYTES takes a byte or more of it; only YAML aliases
# (of aliases) make more.
MAX_CONFIG_VALUES = MAX_CONFIG_BYTES


def _check_expansion(raw: Any) -> None:
    """A YAML alias can name a list many times over, or a node inside itself: a few hundred bytes
    that expand to millions of values (the "billion laughs"), or without end. Refused here, before
    the checks' messages, a reload's comparison and its audit line, or run.json would expand them
    (a reload that compared a node containing itself ended the run with a RecursionError)."""
    count = 0
    enclosing: set[int] = set()  # ids of the containers on the path to the node being walked
    stack: list[tuple[Any, str, bool]] = [(raw, "", False)]
    while stack:
        node, path, is_exit = stack.pop()
        if is_exit:
            enclosing.discard(id(node))
            continue
        count += 1
        if count > MAX_CONFIG_VALUES:
            raise ConfigError(
                f"{path or 'the top level'}: the config expands to more than {MAX_CONFIG_VALUES} values "
                "(YAML aliases of aliases?)"
            )
        if isinstance(node, dict):
            children = [(f"{path}.{key}" if path else str(key), value) for key, value in node.items()]
        elif isinstance(node, list):
            children = [(f"{path}[{index}]", value) for index, value in enumerate(node)]
        else:
            continue
        if id(node) in enclosing:
            raise ConfigError(f"{path}: contains itself (a YAML alias of an anchor around it)")
        enclosing.add(id(node))
        stack.append((node, path, True))
        stack.extend((child, child_path, False) for child_path, child in reversed(children))


def _read_config_bytes(path: str | Path, regular_file_only: bool) -> bytes:
    """The file's bytes, at most MAX_CONFIG_BYTES. With `regular_file_only`, nothing else is
    read (a FIFO, a device), and the open never blocks: a supervisor reloading its config must
    not hang in open() or read() until someone writes to a FIFO."""
    flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_NONBLOCK if regular_file_only else 0)
    fd = os.open(path, flags)
    try:
        if regular_file_only and not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"{path} is not a regular file (a FIFO or a device?): not read")
        data = b""
        while len(data) <= MAX_CONFIG_BYTES:
            chunk = os.read(fd, MAX_CONFIG_BYTES + 1 - len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path} is over {MAX_CONFIG_BYTES} bytes: too large to be a config")
    return data


def _read_yaml(path: str | Path, regular_file_only: bool = False) -> Any:
    try:
        text = _read_config_bytes(path, regular_file_only).decode("utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path} is not UTF-8 text: byte 0x{exc.object[exc.start]:02x} at offset {exc.start}"
        ) from None
    try:
        raw = yaml.load(text, Loader=_ConfigLoader)
        # An empty file is all defaults; `[]`, `false` or `0` are not mappings (load_config refuses them).
        return {} if raw is None else raw
    except AmbiguousNumber as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark else "?"
        raise ConfigError(f"{path}: line {line}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{path} is nested too deeply to be a config") from None


def check_finite(struct: msgspec.Struct, prefix: str = "") -> None:
    """Every number of the typed fields is finite: run.json, which every stage reads the config
    from, is JSON, where .inf becomes null, so that a stage's first start would fail to read it.
    (model.override_generation_config, untyped, refuses them in check_generation_overrides.)"""
    for field in msgspec.structs.fields(struct):
        path, value = f"{prefix}{field.name}", getattr(struct, field.name)
        if isinstance(value, msgspec.Struct):
            check_finite(value, path + ".")
            continue
        if isinstance(value, float):
            numbers = {path: value}
        elif field.type == dict[str, float]:
            numbers = {f"{path}.{key}": amount for key, amount in value.items()}
        else:
            continue
        for where, number in numbers.items():
            if not math.isfinite(number):
                raise ConfigError(f"{where}: expected a finite number, got {number!r}")


def check_timeouts(config: Config) -> None:
    """The supervisor must not give up on a stage before that stage could give up on what it waits
    for: the scheduler waits up to step_timeout_s on its workers (then kills them itself), and
    only heartbeats in between, so a hang_timeout_s as short would blame it for a stuck worker."""
    step, hang = config.engine.step_timeout_s, config.supervisor.hang_timeout_s
    if step >= hang:
        raise ConfigError(
            f"engine.step_timeout_s ({step:g}) must be below supervisor.hang_timeout_s ({hang:g}): a stuck "
            "worker is detected by its scheduler after step_timeout_s, and the supervisor would otherwise "
            "restart the waiting scheduler first"
        )
    beat = config.supervisor.heartbeat_interval_s
    if beat >= hang:
        raise ConfigError(
            f"supervisor.heartbeat_interval_s ({beat:g}) must be below supervisor.hang_timeout_s ({hang:g}), "
            "or every stage looks hung between two heartbeats"
        )
    first, most = config.supervisor.backoff_initial_s, config.supervisor.backoff_max_s
    if first > most:
        raise ConfigError(
            f"supervisor.backoff_initial_s ({first:g}) must be at most supervisor.backoff_max_s ({most:g}): "
            "the wait before a restart starts at the first and doubles up to the second"
        )


def check_engine(config: Config) -> None:
    """Options that would silently do nothing where they cannot apply are refused instead."""
    if config.engine.cpu_int8_activations and (
        config.engine.device != "cpu" or config.model.dtype not in ("auto", "float32")
    ):
        raise ConfigError(
            "engine.cpu_int8_activations: applies to the CPU path in float32 only (engine.device=cpu, "
            f"model.dtype auto or float32), got engine.device={config.engine.device}, model.dtype={config.model.dtype}"
        )
    if config.engine.cpu_wide_step_dtype != "float32" and (
        config.engine.device != "cpu" or config.model.dtype not in ("auto", "float32")
    ):
        raise ConfigError(
            f"engine.cpu_wide_step_dtype={config.engine.cpu_wide_step_dtype}: applies to the CPU path in float32 "
            f"only (engine.device=cpu, model.dtype auto or float32), got engine.device={config.engine.device}, "
            f"model.dtype={config.model.dtype}"
        )
    device, dtype = config.engine.device, config.model.dtype
    if dtype == "auto":
        dtype = "float32" if device == "cpu" else "bfloat16"
    if (
        config.engine.kv_cache_dtype == "bfloat16"
        and dtype != "bfloat16"
        and (device, dtype) != ("cpu", "float32")
    ):
        raise ConfigError(
            "engine.kv_cache_dtype=bfloat16: a bfloat16 cache under another dtype's model is the CPU path's, "
            f"under float32 (engine.device=cpu, model.dtype auto or float32); got engine.device={device}, "
            f"model.dtype={config.model.dtype}"
        )


EMBEDDED_MODEL = "SmolLM2-135M-Instruct"  # the name of the model an empty model.path serves


def served_model_name(config: Config) -> str:
    """The name clients send, /v1/models lists and every metric's model_name label carries."""
    return config.gateway.served_model_name or config.model.path or EMBEDDED_MODEL


MAX_ADAPTER_NAME_CHARS = 256  # a LoRA adapter's name: bounded before it reaches an error message
LORA_OFF = "LoRA adapters are off (lora.max_loras is 0)"  # what a load is told then, wherever it is refused
# Unicode's control, format (bidi overrides, zero-width), line and paragraph separator categories.
UNPRINTED_CATEGORIES = ("Cc", "Cf", "Zl", "Zp")


def adapter_name_problem(name: str) -> str:
    """Why `name` cannot name a LoRA adapter ("" when it can): empty, too long, or with control,
    format or separator characters (a newline, U+2028, would split the log lines and status
    output that name it; a bidi override would make them read otherwise)."""
    if not name or len(name) > MAX_ADAPTER_NAME_CHARS:
        return f"must be a name of 1 to {MAX_ADAPTER_NAME_CHARS} characters"
    if any(unicodedata.category(char) in UNPRINTED_CATEGORIES for char in name):
        return f"must not contain control characters (newlines, tabs, bidi overrides...), got {name!r}"
    return ""


def adapter_path_problem(path: str) -> str:
    """Why `path` cannot name a LoRA adapter's files ("" when it can): relative (to which
    process's directory?), or holding a NUL, which no file's path does (a worker's open would
    raise ValueError)."""
    if not os.path.isabs(path):
        return f"must be an absolute adapter directory or .gguf file, got {path!r}"
    if "\0" in path:
        return f"must not contain a NUL character, got {path!r}"
    return ""


def check_lora(config: Config) -> None:
    """Adapters that could never be loaded, or a list with adapters off, are refused here."""
    lora = config.lora
    if lora.max_loras > MAX_LORA_SLOTS:
        raise ConfigError(
            f"lora.max_loras: at most {MAX_LORA_SLOTS} slots (the step header names each one's adapter)"
        )
    if lora.max_cpu_loras and not lora.max_loras:
        raise ConfigError(
            f"lora.max_cpu_loras ({lora.max_cpu_loras}) with lora.max_loras 0: adapters are off, so none "
            "can be loaded; set lora.max_loras to the adapters that may run at once"
        )
    if lora.max_cpu_loras and lora.max_cpu_loras < lora.max_loras:
        raise ConfigError(
            f"lora.max_cpu_loras ({lora.max_cpu_loras}) is under lora.max_loras ({lora.max_loras}): "
            "every adapter in a slot is one of those in host memory"
        )
    capacity = max(lora.max_cpu_loras, lora.max_loras)
    if len(lora.adapters) > capacity:
        raise ConfigError(
            f"lora.adapters: {len(lora.adapters)} adapters, more than lora.max_cpu_loras / lora.max_loras "
            f"({capacity}) allow (0 = adapters off)"
        )
    for name, path in lora.adapters.items():
        if problem := adapter_name_problem(name):
            raise ConfigError(f"lora.adapters: an adapter's name {problem}")
        if problem := adapter_path_problem(path):
            raise ConfigError(f"lora.adapters.{name}: the path {problem}")
        if name == served_model_name(config):
            raise ConfigError(f"lora.adapters.{name}: the served model's name; name the adapter otherwise")


def check_speculative(config: Config) -> None:
    """The n-gram bounds must leave some n to match, and a draft model needs its directory (the
    supervisor checks its files against the target's before any stage starts:
    supervision/run.py `prepare_model`)."""
    spec = config.speculative
    if spec.method == "draft_model" and not os.path.isabs(spec.model):
        raise ConfigError(
            "speculative.model: speculative.method draft_model needs the draft model's directory, "
            f"an absolute path; got {spec.model!r}"
        )
    if spec.method == "ngram" and spec.model:
        raise ConfigError(
            f"speculative.model ({spec.model!r}) is the draft of speculative.method draft_model; "
            "method ngram proposes from the prompt and would ignore it: drop one of them"
        )
    if spec.method == "draft_model" and config.engine.tensor_parallel > 1:
        raise ConfigError(
            "speculative.method draft_model runs the draft on one rank: engine.tensor_parallel must be 1, "
            f"got {config.engine.tensor_parallel}"
        )
    if spec.prompt_lookup_min > spec.prompt_lookup_max:
        raise ConfigError(
            f"speculative.prompt_lookup_min ({spec.prompt_lookup_min}) must be <= "
            f"speculative.prompt_lookup_max ({spec.prompt_lookup_max})"
        )


# Ray's own resources, which the config names by their fields (engine_cpus; GPUs come from
# engine.tensor_parallel), so that one amount has one place.
_RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


def check_cluster(config: Config) -> None:
    """Resource amounts that Ray could never place, and a Ray backend without Ray installed,
    are refused here rather than as a placement that waits forever or an ImportError."""
    cluster = config.cluster
    for section in ("engine_resources", "light_resources"):
        for name, amount in getattr(cluster, section).items():
            if name in _RAY_BUILTIN_RESOURCES:
                raise ConfigError(
                    f"cluster.{section}.{name}: {name} is Ray's own resource; use cluster.engine_cpus for CPUs, "
                    "engine.device=cuda with engine.tensor_parallel for GPUs, and custom names here"
                )
            if not amount > 0:
                raise ConfigError(f"cluster.{section}.{name}: expected an amount > 0, got {amount!r}")
    if cluster.backend != "ray":
        return
    if config.engine.device == "cpu" and cluster.engine_cpus == 0 and not cluster.engine_resources:
        raise ConfigError(
            "cluster.engine_cpus is 0 and cluster.engine_resources is empty: an engine group on the CPU "
            "would ask Ray for nothing, so nothing would say which nodes can hold it"
        )
    if importlib.util.find_spec("ray") is None:
        raise ConfigError(
            "cluster.backend: ray needs the ray package, which is not installed: pip install '.[ray]'"
        )


def check_encoder(config: Config) -> None:
    """The encoder in the worker replaces the encoder stage: one or the other, and on one host
    (the tokenizers find the worker of engine group 0 where encoder 0 would be, and every group's
    workers read its cache in shared memory)."""
    encoder = config.encoder
    if not encoder.in_worker:
        return
    if encoder.replicas:
        raise ConfigError(
            f"encoder.in_worker: the worker of engine group 0 runs the encoder, so there is no encoder "
            f"stage to start: set encoder.replicas to 0 (got {encoder.replicas})"
        )
    if config.cluster.backend == "ray":
        raise ConfigError(
            "encoder.in_worker runs on one host (the engine groups read the embeddings from the "
            "worker of group 0 in shared memory): with cluster.backend: ray use encoder.replicas"
        )


def check_autoscale(config: Config) -> None:
    """Bounds that contradict each other or the run's start, and a fixed device list (which
    fixes the number of groups), are refused rather than corrected behind the operator's back."""
    autoscale, engine = config.autoscale, config.engine
    if not autoscale.enabled:
        return
    if autoscale.min_groups > autoscale.max_groups:
        raise ConfigError(
            f"autoscale.min_groups ({autoscale.min_groups}) must be at most autoscale.max_groups "
            f"({autoscale.max_groups})"
        )
    if not autoscale.min_groups <= engine.data_parallel <= autoscale.max_groups:
        raise ConfigError(
            f"engine.data_parallel ({engine.data_parallel}) is the number of engine groups the run starts "
            f"with: it must be within autoscale.min_groups..max_groups ({autoscale.min_groups}.."
            f"{autoscale.max_groups})"
        )
    if engine.devices:
        raise ConfigError(
            "engine.devices lists one device per worker, which fixes the number of engine groups: leave it "
            "empty with autoscale.enabled (groups then take devices 0, 1, ... in order)"
        )
    if config.network.transport == "tcp" and autoscale.max_groups > PORTS_PER_KIND:
        raise ConfigError(
            f"autoscale.max_groups: at most {PORTS_PER_KIND} engine groups over tcp:// (one port each), "
            f"got {autoscale.max_groups}"
        )


def check_run_as(config: Config) -> None:
    """supervisor.run_as must name a user of this host (the stages become it)."""
    name = config.supervisor.run_as
    if not name:
        return
    try:
        pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
    except KeyError:
        raise ConfigError(f"supervisor.run_as: there is no user {name!r} on this host") from None


def check_gateway_tls(config: Config) -> None:
    """A certificate without its key (or the other way round), or client CAs without a server
    certificate, would serve something other than what was asked for."""
    tls = config.gateway.tls
    if bool(tls.certfile) != bool(tls.keyfile):
        raise ConfigError("gateway.tls: certfile and keyfile go together (set both, or neither)")
    if tls.client_ca and not tls.certfile:
        raise ConfigError(
            "gateway.tls.client_ca: client certificates need HTTPS: set certfile and keyfile too"
        )


WILDCARD_HOSTS = ("0.0.0.0", "::", "")  # listening on every address, each one's port included


def check_metrics_port(config: Config) -> None:
    """The supervisor's /metrics binds its port before the gateways start: on the gateways' own
    port and address it took that port from them, and every gateway failed to start on it."""
    gateway, supervisor = config.gateway, config.supervisor
    if not gateway.replicas or supervisor.metrics_port != gateway.port or config.cluster.backend != "local":
        return
    metrics_host = supervisor.metrics_host or gateway.host
    if metrics_host == gateway.host or metrics_host in WILDCARD_HOSTS or gateway.host in WILDCARD_HOSTS:
        raise ConfigError(
            f"supervisor.metrics_port: {supervisor.metrics_port} is gateway.port too (/metrics on "
            f"{metrics_host!r}, the gateways on {gateway.host!r}): set another port for one of them, "
            "or supervisor.metrics_port 0 for no /metrics"
        )


def check_network(config: Config) -> None:
    """tcp:// links: CURVE unless only this host can reach them, and ports that fit the layout
    (ipc/endpoints.py gives each link kind a block of PORTS_PER_KIND ports from port_base)."""
    network = config.network
    if network.transport != "tcp":
        return
    listen = network.bind_host or network.host
    if not network.curve and not (is_loopback(listen) and is_loopback(network.host)):
        raise ConfigError(
            f"network.curve: plain tcp:// without CURVE listening on {listen!r} would let anyone who "
            "reaches that address read prompts and drive the engine; set network.curve: true, or "
            "bind to loopback (network.host and network.bind_host 127.0.0.1)"
        )
    if network.port_base and network.port_base + PORT_SPAN > 65536:
        raise ConfigError(
            f"network.port_base: the run uses {PORT_SPAN} ports from port_base; {network.port_base} "
            f"leaves too few below 65536 (use at most {65536 - PORT_SPAN})"
        )
    counts = {
        "tokenizer.replicas": config.tokenizer.replicas,
        "detokenizer.replicas": config.detokenizer.replicas,
        "encoder.replicas": config.encoder.replicas,
        "engine.data_parallel": config.engine.data_parallel,
    }
    for path, count in counts.items():
        if count > PORTS_PER_KIND:
            raise ConfigError(f"{path}: at most {PORTS_PER_KIND} over tcp:// (one port each), got {count}")
    if network.keys_dir and not Path(network.keys_dir).is_dir():
        raise ConfigError(
            f"network.keys_dir: {network.keys_dir} is not a directory (make one: python -m ipc.keys DIR)"
        )


def load_config(
    path: str | Path | None, overrides: list[str] | tuple[str, ...] = (), regular_file_only: bool = False
) -> Config:
    """Read a YAML config file (None = all defaults), apply overrides, validate. A reload passes
    `regular_file_only` (see _read_config_bytes); a start reads `--config <(...)` too."""
    raw = _read_yaml(path, regular_file_only) if path is not None else {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    _rename_deprecated_sections(raw)
    for assignment in overrides:
        apply_override(raw, assignment)
    _check_expansion(raw)
    try:
        config = msgspec.convert(raw, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(exc, raw)) from None
    check_finite(config)
    check_timeouts(config)
    check_engine(config)
    check_lora(config)
    check_speculative(config)
    check_encoder(config)
    check_cluster(config)
    check_network(config)
    check_gateway_tls(config)
    check_metrics_port(config)
    check_autoscale(config)
    check_run_as(config)
    return config


# Old section name -> its name now. The tokenizer stage's section was called `frontend` until the
# stage got one name everywhere (docs/architecture.md, "Names").
DEPRECATED_SECTIONS = {"frontend": "tokenizer"}


def _rename_deprecated_sections(raw: dict[str, Any]) -> None:
    for old, new in DEPRECATED_SECTIONS.items():
        if old not in raw:
            continue
        section = raw.pop(old)
        if not isinstance(section, dict):
            raise ConfigError(f"{old}: must be a mapping (and it is deprecated: call the section {new!r})")
        current = raw.setdefault(new, {})
        if not isinstance(current, dict):
            raise ConfigError(f"{new}: must be a mapping")
        both = sorted(set(section) & set(current))
        if both:
            raise ConfigError(f"{both} set under both {old!r} (deprecated) and {new!r}: keep only {new!r}")
        current.update(section)
        logging.getLogger("brigade.config").warning("config section %r is deprecated: call it %r", old, new)
