"""HTTPS at the gateway (gateway.tls), with certificates rotated without a restart.

The listening socket is wrapped once, with a server context whose only job is to pick, for each
handshake, the context built from the files as they are now: OpenSSL calls the server-name
callback on every ClientHello (with or without SNI), and the callback switches the connection to
`current`. A connection keeps the context it shook hands with, so a stream in flight is not
touched by a rotation; the next connection gets the new certificate.

`poll` (the control loop calls it each heartbeat) re-reads the files when one of them changed on
disk (its mtime, size or inode). A new set that does not load (a key that does not match its
certificate, a half-written file, a CA file with no certificate) is refused: logged, counted and
audited, and the old context serves on. The files are read once per change, not per handshake.

With `client_ca`, a client must present a certificate that one of those CAs signed (mTLS); its
subject becomes the request's caller (services/gateway/connection.py puts it in the ASGI scope's
`tls` extension, app.py reads it from there).
"""

from __future__ import annotations

import logging
import os
import ssl

from ipc.config import GatewayTlsConfig
from services.audit import AuditLog

log = logging.getLogger(__name__)

FileStamp = tuple[int, int, int] | None  # mtime_ns, size, inode; None = missing


class TlsFileError(ssl.SSLError):
    """A file of gateway.tls that does not load, and why (ssl.SSLError's str is its args tuple)."""

    def __str__(self) -> str:
        return str(self.args[0])


def _stamp(path: str) -> FileStamp:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


def _pem_fault(config: GatewayTlsConfig) -> str | None:
    """Which of the pair is not PEM of its kind (ssl says only "PEM lib", naming no file)."""
    for field, marker, kind in (("certfile", b"-----BEGIN CERTIFICATE-----", "certificate"),
                                ("keyfile", b"PRIVATE KEY-----", "private key")):  # fmt: skip
        path = getattr(config, field)
        try:
            with open(path, "rb") as file:
                if marker not in file.read(1 << 20):
                    return f"gateway.tls.{field}: {path!r} holds no PEM {kind}"
        except OSError:
            return None
    return None


def build_context(config: GatewayTlsConfig) -> ssl.SSLContext:
    """A server context from the files as they are now; raises ssl.SSLError or OSError."""
    for field in ("certfile", "keyfile", "client_ca"):
        path = getattr(config, field)
        if path and not os.path.exists(path):  # ssl's own error names no file
            raise FileNotFoundError(f"gateway.tls.{field}: no file {path!r} (from {os.getcwd()})")
        if path and not os.path.isfile(path):
            raise OSError(f"gateway.tls.{field}: {path!r} is not a regular file")

    def no_passphrase() -> bytes:
        # Without a callback OpenSSL asks for the passphrase on the controlling terminal, where
        # there is one: the supervisor's check, or a replica's event loop at a rotation, would
        # wait there for ever.
        raise TlsFileError(
            f"gateway.tls.keyfile: {config.keyfile!r} is encrypted, and Brigade takes no passphrase: "
            "give it the key unencrypted (openssl pkey -in KEY -out KEY.plain), readable by the run's user only"
        )

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(config.certfile, config.keyfile, password=no_passphrase)
    except ssl.SSLError as exc:
        fault = _pem_fault(config) if "PEM lib" in str(exc) else None
        if "KEY_VALUES_MISMATCH" in str(exc):
            fault = f"gateway.tls.keyfile: {config.keyfile!r} is not the key of {config.certfile!r}"
        if fault is None:
            raise
        raise TlsFileError(fault) from None
    if config.client_ca:
        no_ca = f"gateway.tls.client_ca: {config.client_ca!r} holds no CA certificate"
        try:
            context.load_verify_locations(cafile=config.client_ca)
        except ssl.SSLError as exc:
            raise TlsFileError(
                no_ca if "NO_CERTIFICATE" in str(exc) else f"{no_ca} that loads: {exc}"
            ) from None
        if not context.get_ca_certs():
            raise TlsFileError(no_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class RotatingTls:
    """The current server context of a gateway replica, and the one its socket is wrapped with."""

    def __init__(self, config: GatewayTlsConfig, audit: AuditLog) -> None:
        self.config = config
        self.audit = audit
        self.paths = [p for p in (config.certfile, config.keyfile, config.client_ca) if p]
        self.stamps = [_stamp(p) for p in self.paths]
        self.current = build_context(config)  # a bad pair at start is the stage's start failure
        self.num_refused = 0
        # The listener's context: its own certificate is never sent (every handshake is moved to
        # `current` first), but OpenSSL wants one loaded, and it asks for client certificates the
        # same way `current` does (the verify mode is fixed when a connection is made).
        self.listener = build_context(config)
        self.listener.sni_callback = self._choose

    def _choose(self, connection: ssl.SSLObject, server_name: str | None, _: ssl.SSLContext) -> None:
        connection.context = self.current

    def poll(self) -> str | None:
        """Load the files again if any changed on disk: "applied", "refused" (the old context
        serves on), or None when nothing changed."""
        stamps = [_stamp(p) for p in self.paths]
        if stamps == self.stamps:
            return None
        self.stamps = stamps  # a refused set is not retried until its files change again
        try:
            context = build_context(self.config)
        except (ssl.SSLError, OSError, ValueError) as exc:
            self.num_refused += 1
            log.error(
                "gateway.tls: the changed files do not load (%s); serving on with the previous certificate",
                exc,
            )
            self.audit.record("tls_reload", outcome="refused", files=self.paths, error=str(exc)[:512])
            return "refused"
        self.current = context
        log.info("gateway.tls: certificate files changed on disk; new connections get the new ones")
        self.audit.record("tls_reload", outcome="applied", files=self.paths)
        return "applied"
