"""Checks that refuse a run before any stage spawns, when a stage would only fail at start-up
and its restarts would loop: a device layout this host lacks, a model the configured
tensor_parallel cannot split, a KV budget that cannot hold one sequence. Each message names the
setting to change."""

from __future__ import annotations

import json
import math
import ssl
import subprocess
import sys
from pathlib import Path

from ipc.config import Config, NetworkConfig
from ipc.embedding_cache import EmbeddingCache
from ipc.ports import is_loopback
from ipc.sampling_defaults import run_defaults
from services.common.checkpoint_files import text_weight_names
from services.common.images import ImageRules
from services.common.pooling import embedding_of
from services.common.vision_language import is_vision_language, language_model_config
from services.tls import build_context

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class Refused(Exception):
    """The config cannot run here; the message says why and what to change."""


def check_hosts(network: NetworkConfig, hosts: dict[str, str]) -> None:
    """Stages on other hosts (`hosts`: stage name -> address) must reach this one, and links
    that leave loopback need CURVE."""
    if hosts and is_loopback(network.host):
        raise Refused(
            f"network.host is {network.host}, but stages run on other hosts ({sorted(set(hosts.values()))}) "
            "that must reach this one: set network.host to this host's address"
        )
    if not network.curve and not all(map(is_loopback, hosts.values())):
        raise Refused("network.curve: stages on other hosts need CURVE (plain tcp:// only on loopback)")


def check_tls_files(config: Config) -> None:
    """gateway.tls's files must load before the gateways start, or every replica would fail on
    them (a file missing or unreadable, a key that is not the certificate's, a CA file without
    a certificate)."""
    if not config.gateway.tls.certfile:
        return
    try:
        build_context(config.gateway.tls)
    except (ssl.SSLError, OSError) as exc:
        raise Refused(f"gateway.tls: the certificate files do not load: {exc}") from None


def cuda_device_count() -> int:
    """The CUDA devices this host has (0 when torch cannot tell), asked of a child so that the
    supervisor never imports torch."""
    count = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    return int(count.stdout.strip() or 0) if count.returncode == 0 else 0


def check_layout(config: Config) -> None:
    """The workers' device layout against engine.devices and the CUDA devices present."""
    engine = config.engine
    num_workers = engine.data_parallel * engine.tensor_parallel
    if engine.devices and len(engine.devices) != num_workers:
        raise Refused(
            f"engine.devices lists {len(engine.devices)} devices but data_parallel x tensor_parallel = "
            f"{engine.data_parallel} x {engine.tensor_parallel} = {num_workers} workers need one each"
        )
    if len(set(engine.devices)) != len(engine.devices):
        raise Refused(f"engine.devices has duplicates: {engine.devices}")
    if engine.device != "cuda":
        return
    present = cuda_device_count()
    wanted = engine.devices or list(range(num_workers))
    missing = [d for d in wanted if d >= present]
    if missing:
        raise Refused(
            f"engine.device is cuda and the layout needs devices {wanted}, but this host has {present} "
            f"CUDA device(s): {missing} missing. Lower data_parallel / tensor_parallel or set engine.devices."
        )


def check_encoders(config: Config, model_dir: Path) -> None:
    """A run with encoders (at start, or a hot reload that adds them: their cache_bytes is the
    start's) needs a model that reads images, and caches that hold the largest image the model's
    rules make, or every request with such an image would be refused."""
    encoder = config.encoder
    if not encoder.num_encoders:
        return
    checkpoint = json.loads((model_dir / "config.json").read_text())
    if not is_vision_language(checkpoint):
        setting, undo = (
            ("encoder.in_worker is true", "false")
            if encoder.in_worker
            else (f"encoder.replicas is {encoder.replicas}", "0")
        )
        raise Refused(
            f"{setting}, but {model_dir.name} reads no images "
            f"(architectures {checkpoint.get('architectures')}): set it to {undo}"
        )
    try:
        rules = ImageRules.from_dir(model_dir)
    except (OSError, ValueError, KeyError) as exc:
        raise Refused(f"{model_dir.name}'s image rules do not load: {exc}") from None
    # As the encoder lays its cache out (services/encoder/server.py): pages of the fewest tokens a
    # tile takes, each a row of the language model's width; an image takes a run of them.
    page_rows, width = rules.fewest_tile_tokens, int(language_model_config(checkpoint)["hidden_size"])
    most = rules.most_image_tokens
    needed = -(-most // page_rows)
    if EmbeddingCache.pages_in(encoder.cache_bytes, page_rows, width) < needed:
        smallest = EmbeddingCache.segment_bytes(needed, page_rows, width)
        raise Refused(
            f"encoder.cache_bytes={encoder.cache_bytes} cannot hold one of {model_dir.name}'s largest images "
            f"({most} image tokens, {needed} pages of {page_rows} x {width} float32s): set "
            f"encoder.cache_bytes >= {smallest}"
        )


def check_lm_head(model_dir: Path, checkpoint: dict) -> None:
    """A run that generates needs the LM head: a checkpoint without lm_head.weight whose
    embeddings are untied (a base model's own save, as Qwen3-Embedding's are) would leave the
    worker failing to load, restart after restart. Only a config that says its embeddings are
    untied is held to it (as HF saves write it): without the key the family's default decides,
    which is the worker's to know (services/gpu_worker/architectures.py), and its load says so."""
    tied = language_model_config(checkpoint).get("tie_word_embeddings", True)
    if tied or "lm_head.weight" in text_weight_names(model_dir):
        return
    raise Refused(
        f"{model_dir.name} has no LM head: its checkpoint lacks lm_head.weight and its embeddings are "
        "untied (tie_word_embeddings false), so it cannot generate; it embeds: set model.task to embed"
    )


def served_max_model_len(config: Config, model_dir: Path) -> int:
    """The longest sequence the run serves: `model.max_model_len` within the model's own maximum
    and, with a draft model, the draft's (the worker's rule: model_runner.py `ModelRunner`). The
    workers tell their scheduler; run.json tells the tokenizers and gateways, which report it
    (/v1/models, /tokenize, the SDK's health) and must not say more than the scheduler admits."""
    raw = language_model_config(json.loads((model_dir / "config.json").read_text()))
    length = min(config.model.max_model_len, int(raw.get("max_position_embeddings", 2048)))
    if config.speculative.method == "draft_model":
        draft = language_model_config(
            json.loads((Path(config.speculative.model) / "config.json").read_text())
        )
        length = min(length, int(draft.get("max_position_embeddings", 2048)))
    return length


def check_model(config: Config, model_dir: Path) -> dict[str, float | int]:
    """The prepared model's config.json against tensor_parallel and the KV budget (the same rules
    the worker applies: services/gpu_worker/model.py `Shard.of`, model_runner.py `num_kv_blocks`).
    Returns the sampling values that requests which set none will take (`run_defaults`)."""
    try:
        checkpoint = json.loads((model_dir / "config.json").read_text())
        raw = language_model_config(checkpoint)
        num_heads = int(raw["num_attention_heads"])
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        head_dim = int(raw.get("head_dim") or raw["hidden_size"] // num_heads)
        # DeepSeek's latent attention caches a latent and a rope key per token, whole on every
        # rank (architectures.MlaConfig): one "KV head" that its query heads split over the ranks.
        latent_width = int(raw.get("kv_lora_rank") or 0)
        if latent_width:
            latent_width += int(raw["qk_rope_head_dim"])
            num_kv_heads = 1
        num_layers, intermediate = int(raw["num_hidden_layers"]), int(raw["intermediate_size"])
        vocab_size = int(raw["vocab_size"])  # the supervisor sizes the grammar bitmask by it
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise Refused(f"{model_dir}/config.json is not a usable model config: {exc!r}") from None
    if vocab_size < 1:
        raise Refused(f"{model_dir}/config.json: vocab_size must be >= 1, got {vocab_size}")
    check_encoders(config, model_dir)
    try:  # every stage reads it at start: a run that cannot say how it embeds never starts
        embedding = embedding_of(config.model, model_dir)
    except ValueError as exc:
        raise Refused(str(exc)) from None
    if embedding is None:
        check_lm_head(model_dir, checkpoint)
    try:  # the tokenizers read the same defaults at start; a bad file would crash-loop them
        sampling_defaults = run_defaults(
            model_dir,
            config.model.generation_config,
            config.model.override_generation_config,
            is_embedded_model=not config.model.path,
        )
    except ValueError as exc:
        raise Refused(str(exc)) from None
    tp = config.engine.tensor_parallel
    if num_kv_heads < tp and tp % num_kv_heads:
        raise Refused(
            f"engine.tensor_parallel={tp} cannot split {model_dir.name}: it must be <= or a multiple of the "
            f"model's {num_kv_heads} KV heads"
        )
    if num_kv_heads < tp and num_heads % tp:
        raise Refused(
            f"engine.tensor_parallel={tp} cannot split {model_dir.name}: its {num_heads} attention heads do "
            f"not divide evenly over {tp} ranks"
        )
    if intermediate % tp:
        raise Refused(
            f"engine.tensor_parallel={tp} cannot split {model_dir.name}: its intermediate size "
            f"{intermediate} is not divisible by {tp}"
        )
    # A mixture of experts splits each expert's (and the shared expert's) columns the same way, or
    # with expert parallelism divides the experts, whole, among the ranks.
    num_experts = int(
        raw.get("num_experts") or raw.get("num_local_experts") or raw.get("n_routed_experts") or 0
    )
    if config.engine.expert_parallel and not num_experts:
        raise Refused(f"engine.expert_parallel: {model_dir.name} is not a mixture of experts")
    if config.engine.expert_parallel and num_experts % tp:
        raise Refused(
            f"engine.expert_parallel cannot divide {model_dir.name}'s {num_experts} experts among "
            f"engine.tensor_parallel={tp} ranks"
        )
    split_keys = ("shared_expert_intermediate_size",) if config.engine.expert_parallel else (
        "moe_intermediate_size", "shared_expert_intermediate_size",
    )  # fmt: skip
    for key in split_keys:
        if int(raw.get(key) or 0) % tp:
            raise Refused(
                f"engine.tensor_parallel={tp} cannot split {model_dir.name}: its {key} {raw[key]} is not "
                f"divisible by {tp}"
            )
    if raw.get("model_type") == "olmoe" and tp > num_kv_heads:
        raise Refused(
            f"engine.tensor_parallel={tp} cannot split {model_dir.name}: OLMoE's q/k norms span all heads, "
            f"so tensor_parallel must not exceed num_key_value_heads ({num_kv_heads})"
        )
    engine = config.engine
    if engine.device != "cpu":
        return sampling_defaults  # a CUDA worker's budget depends on free device memory: it checks at start
    dtype = "float32" if config.model.dtype == "auto" else config.model.dtype
    # engine.kv_cache_dtype in another dtype than the model's: the cache's bytes are all the budget
    # below counts; latent attention keeps its caches in the model's dtype (the worker refuses too).
    rounded_cache = engine.kv_cache_dtype not in ("auto", dtype)
    if rounded_cache:
        if latent_width:
            raise Refused(
                f"engine.kv_cache_dtype={engine.kv_cache_dtype} cannot serve {model_dir.name}: latent attention "
                "(DeepSeek) keeps its caches in the model's dtype; use auto"
            )
        dtype = engine.kv_cache_dtype
    rank_kv_heads = math.ceil(num_kv_heads / tp)  # the rank with the most KV heads sets the block count
    token_width = latent_width or 2 * rank_kv_heads * head_dim  # elements per token and layer
    bytes_per_block = num_layers * engine.block_size * token_width * DTYPE_BYTES[dtype]
    max_model_len = served_max_model_len(config, model_dir)
    what = model_dir.name
    if config.speculative.method == "draft_model":
        # The draft's cache takes as many blocks from the same budget (one rank, full attention
        # heads; prepare_model has checked its config), and its length bounds the run's.
        draft = language_model_config(
            json.loads((Path(config.speculative.model) / "config.json").read_text())
        )
        if rounded_cache and draft.get("kv_lora_rank"):
            raise Refused(
                f"engine.kv_cache_dtype={engine.kv_cache_dtype} cannot serve the draft model "
                f"{Path(config.speculative.model).name}: latent attention (DeepSeek) keeps its caches in the "
                "model's dtype; use auto"
            )
        draft_heads = int(draft["num_attention_heads"])
        draft_kv_heads = int(draft.get("num_key_value_heads") or draft_heads)
        draft_head_dim = int(draft.get("head_dim") or draft["hidden_size"] // draft_heads)
        bytes_per_block += (
            int(draft["num_hidden_layers"])
            * engine.block_size
            * 2
            * draft_kv_heads
            * draft_head_dim
            * DTYPE_BYTES[dtype]
        )
        what += " and its draft model"
    num_blocks = max((engine.kv_cache_mib << 20) // bytes_per_block, 1)
    if num_blocks * engine.block_size < max_model_len:
        need_mib = math.ceil(math.ceil(max_model_len / engine.block_size) * bytes_per_block / (1 << 20))
        raise Refused(
            f"engine.kv_cache_mib={engine.kv_cache_mib} holds {num_blocks} KV block(s) of {engine.block_size} "
            f"tokens of {what} ({bytes_per_block} bytes each in {dtype}), which cannot hold one "
            f"sequence of max_model_len={max_model_len}: set engine.kv_cache_mib >= {need_mib} or lower "
            "model.max_model_len"
        )
    return sampling_defaults
