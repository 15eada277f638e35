"""Gateway replica process: the OpenAI-compatible HTTP API on a port shared by every replica.

The replica binds its listening socket itself with SO_REUSEPORT, so `gateway.replicas` processes
accept on one port and the kernel spreads connections over them; a replica that dies loses
only its own connections (clients retry, or resume a stream with Last-Event-ID). It reaches the
tokenizers through the asyncio client SDK, which fails requests over between tokenizer replicas.
Light: no torch.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import os
import socket
from pathlib import Path

import uvicorn

from client.async_sdk import AsyncClient
from ipc import messages as m
from ipc.config import ADAPTER_COMMAND_MARGIN_S
from services.audit import ApiKeyFailures, AuditLog, audit_log_path
from services.common.image_fetch import RemoteImages
from services.common.images import image_rules_of
from services.common.text import Tokenizer
from services.gateway.access_log import AccessLog
from services.gateway.app import Gateway, GatewaySettings
from services.gateway.connection import guarded_protocol
from services.gateway.routes import build_app
from services.stage import (
    ControlChannel,
    Stage,
    StageProcess,
    confine_writes,
    drop_privileges,
    read_run_info,
)
from services.tls import RotatingTls

API_KEYS_ENV = "BRIGADE_API_KEYS"  # comma-separated; added to gateway.api_keys
LISTEN_BACKLOG = 2048
# The longest the control loop leaves the supervisor's commands unread.
COMMAND_POLL_S = 0.1
# glibc's mallopt parameters, and its ceiling on the mmap threshold (64-bit).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MAX_MMAP_THRESHOLD = 32 << 20


def listen_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(LISTEN_BACKLOG)
    sock.setblocking(False)
    return sock


def api_keys(configured: list[str]) -> frozenset[str]:
    from_env = [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",")]
    return frozenset(k for k in [*configured, *from_env] if k)


def keep_body_memory(max_body_bytes: int) -> None:
    """Have malloc serve blocks up to a body's size from its heap, and keep up to four of them
    there once freed. glibc maps every block over its threshold afresh and unmaps it on free, so
    each large body (its bytes, their joined copy, its decoded strings) was paged in anew: a 6 MB
    chat faulted about 4,000 pages, 10 ms of system time, as much as reading and decoding it took.
    Nothing where libc has no mallopt (musl)."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    threshold = min(max_body_bytes, MAX_MMAP_THRESHOLD)
    mallopt(M_MMAP_THRESHOLD, threshold)
    mallopt(M_TRIM_THRESHOLD, 4 * threshold)


def max_body_bytes(stage: Stage) -> int:
    """A prompt at the tokenizer's character limit with every character JSON-escaped (\\uXXXX),
    plus room for the rest of the body."""
    return 6 * stage.config.tokenizer.max_prompt_chars + (1 << 20)


async def control_loop(
    stage: Stage,
    control: ControlChannel,
    server: uvicorn.Server,
    gateway: Gateway,
    url: str,
    tls: RotatingTls | None,
) -> None:
    """Ready once the server listens; then heartbeats, rotated certificates, and the run's drain
    (Shutdown: new calls are refused, those in flight finish; SIGTERM stops the server)."""
    while not server.started:
        await asyncio.sleep(0.01)
    control.ready(url=url)
    stage.log.info("serving the OpenAI API at %s", url)
    while not server.should_exit:
        command = control.command()
        if isinstance(command, m.Shutdown):
            gateway.drain()
        elif isinstance(command, m.TopologyChanged):
            # Tokenizer replicas a hot reload added: run.json lists them once they are up.
            gateway.client.add_replicas(read_run_info(stage.run_dir).tokenizers)
        elif isinstance(command, m.Reconfigure):
            gateway.settings.default_max_tokens = command.default_max_tokens
        load = m.StageLoad(num_in_flight=gateway.num_in_flight, is_draining=gateway.is_draining)
        control.heartbeat(gateway.num_responses, has_work=False, load=load)
        gateway.settings.key_failures.flush()
        if tls is not None and (outcome := tls.poll()) is not None:
            gateway.metrics.tls_reloads.labels(outcome).inc()
        # Commands wait on this loop: a long heartbeat interval must not delay the drain's Shutdown.
        await asyncio.sleep(min(control.interval / 2, COMMAND_POLL_S))


async def serve(stage: Stage, control_channel: ControlChannel) -> None:
    config = stage.config.gateway
    sock = listen_socket(config.host, config.port)
    # Bound (a port below 1024 needs root): now the run's user, and writes only in the run dir.
    drop_privileges(stage.config.supervisor.run_as, stage.is_supervised)
    confine_writes(stage)
    keys = stage.info.network.keys  # a stage's own key: the run's client key file may be elsewhere
    curve = {"server_key": keys.server_public, "keys": (keys.stage_public, keys.stage_secret)} if keys else {}
    client = AsyncClient(stage.run_dir, **curve)
    keep_body_memory(max_body_bytes(stage))
    audit = AuditLog(audit_log_path(stage.run_dir, stage.config.observability.audit_log), stage.name)
    tls = RotatingTls(config.tls, audit) if config.tls.certfile else None
    settings = GatewaySettings(
        model=stage.info.model,  # gateway.served_model_name, or the model's (ipc.config.served_model_name)
        max_model_len=stage.info.served_max_model_len,  # within the model's and its draft's
        api_keys=api_keys(config.api_keys),
        max_concurrent_requests=config.max_concurrent_requests,
        max_body_bytes=max_body_bytes(stage),
        run_dir=stage.run_dir,
        key_failures=ApiKeyFailures(audit),
        max_prompt_chars=stage.config.tokenizer.max_prompt_chars,
        max_messages=stage.config.tokenizer.max_messages,
        template_timeout_s=stage.config.tokenizer.template_timeout_s,
        default_max_tokens=stage.config.tokenizer.default_max_tokens,
        body_timeout_s=config.body_timeout_s,
        responses_max_stored=config.responses_max_stored,
        responses_max_age_s=config.responses_max_age_s,
        sse_keepalive_s=config.sse_keepalive_s,
        reasoning_parser=config.reasoning_parser,
        max_costly_compiles=stage.config.structured.max_costly_compiles,
        costly_compile_window_s=stage.config.structured.costly_compile_window_s,
        max_oversized_requests=config.max_oversized_requests,
        oversized_window_s=config.oversized_window_s,
        adapters=tuple(stage.config.lora.adapters),
        access_log=AccessLog(config.access_log, stage.name) if config.access_log.path else None,
        cors_origins=tuple(config.cors_origins),
        max_loras=stage.config.lora.max_loras,
        accept_priority=config.accept_priority,
        adapter_command_timeout_s=stage.config.lora.unload_wait_s + ADAPTER_COMMAND_MARGIN_S + 30.0,
        max_image_bytes=stage.config.encoder.max_image_bytes,
        max_image_pixels=stage.config.encoder.max_image_pixels,
    )
    model_dir = Path(stage.info.model_dir)
    gateway = Gateway(
        settings,
        client,
        Tokenizer(model_dir),
        image_rules=image_rules_of(model_dir),
        remote_images=RemoteImages.of(stage.config.encoder),
    )
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(gateway),
            loop="none",
            http=guarded_protocol(config.header_timeout_s, config.max_header_bytes, config.write_timeout_s),
            timeout_keep_alive=config.keep_alive_timeout_s,
            lifespan="off",
            access_log=False,
            log_config=None,
            timeout_graceful_shutdown=stage.config.supervisor.drain_timeout_s,
            # uvicorn wraps the socket with this context (services/tls.py)
            ssl_context_factory=(lambda *_: tls.listener) if tls is not None else None,
        )
    )
    host = f"[{config.host}]" if ":" in config.host else config.host
    url = f"{'https' if tls else 'http'}://{host}:{config.port}/v1"
    control = asyncio.create_task(control_loop(stage, control_channel, server, gateway, url, tls))
    if tls is not None:
        # The header deadline starts once a connection's handshake is done (its protocol is made
        # then): a connection that never finishes one would be held for asyncio's own handshake
        # timeout, 60 s, not header_timeout_s. uvicorn takes no handshake timeout of its own.
        loop = asyncio.get_running_loop()
        loop.create_server = functools.partial(  # type: ignore[method-assign]
            loop.create_server, ssl_handshake_timeout=config.header_timeout_s
        )
    try:
        await server.serve(sockets=[sock])
    finally:
        control.cancel()
        settings.key_failures.flush(force=True)
        gateway.close()  # uvicorn runs without lifespan events here: no shutdown hook would fire
        await client.close()


class GatewayProcess(StageProcess):
    """The skeleton's setup and close around uvicorn's asyncio loop, which owns the signals
    (SIGTERM drains open requests) and runs the control channel as one of its tasks."""

    kind = "gateway"

    def run(self) -> None:
        import uvloop

        uvloop.run(serve(self.stage, self.control))
        self.close()


if __name__ == "__main__":
    GatewayProcess().run()
