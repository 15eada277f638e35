"""CURVE key material of a run: who holds which key pair, and the certificate files they live in.

A run has three key pairs (z85-encoded, as libzmq's CURVE wants them):

- `server`: every socket that binds a tcp:// link;
- `stage`: every stage's connecting socket; the internal links accept only this key;
- `client`: SDK clients; a tokenizer's client-facing socket accepts it (and the stage key, which
  the gateway uses), so that holding the client key never opens the engine's internal links.

The files are ZeroMQ's certificate format (`zmq.auth.load_certificate` reads them):
`NAME.key` holds the public key, `NAME.key_secret` both. Secret files must be private (0600):
whoever reads one can talk to the run.

    python -m ipc.keys DIR      # make a key set for `network.keys_dir` (--force replaces one)
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq
import zmq.auth

KEY_NAMES = ("server", "stage", "client")
SECRET_SUFFIX = ".key_secret"


class BadKeyFile(ValueError):
    """A key file that is missing, unreadable, malformed or readable by others."""


@dataclass(frozen=True)
class CurveKeys:
    """A CURVE key pair, z85-encoded."""

    public: bytes
    secret: bytes


@dataclass(frozen=True)
class CurveServer:
    """Server side: this socket's keys and the only client public keys it accepts."""

    keys: CurveKeys
    client_public_keys: tuple[bytes, ...]


@dataclass(frozen=True)
class CurveClient:
    """Client side: this socket's keys and the server's public key."""

    keys: CurveKeys
    server_public_key: bytes


class RunKeys(msgspec.Struct, frozen=True):
    """The key material every stage needs (in run.json, which is private to the run's user)."""

    server_public: str
    server_secret: str
    stage_public: str
    stage_secret: str
    client_public: str

    def internal_server(self) -> CurveServer:
        """A stage-to-stage link's server: only the stages may connect."""
        return CurveServer(_pair(self.server_public, self.server_secret), (self.stage_public.encode(),))

    def public_server(self) -> CurveServer:
        """A tokenizer's client-facing socket: SDK clients and stages (the gateway) may connect."""
        allowed = (self.stage_public.encode(), self.client_public.encode())
        return CurveServer(_pair(self.server_public, self.server_secret), allowed)

    def stage_client(self) -> CurveClient:
        """What a stage connects with."""
        return CurveClient(_pair(self.stage_public, self.stage_secret), self.server_public.encode())


def _pair(public: str, secret: str) -> CurveKeys:
    return CurveKeys(public.encode(), secret.encode())


def check_secret_file(path: Path) -> None:
    """A secret key file must be a regular file that only its owner can read."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise BadKeyFile(f"key file {path} does not exist") from None
    if not stat.S_ISREG(st.st_mode):
        raise BadKeyFile(f"key file {path} is not a regular file")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise BadKeyFile(
            f"key file {path} has mode {stat.S_IMODE(st.st_mode):o}; a secret key must be private "
            f"(chmod 600 {path})"
        )


def load_secret_file(path: Path | str) -> CurveKeys:
    """The key pair of a `NAME.key_secret` certificate file."""
    path = Path(path)
    check_secret_file(path)
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise BadKeyFile(f"key file {path} is not a ZeroMQ secret certificate: {exc}") from None
    if not secret or len(public) != 40 or len(secret) != 40:
        raise BadKeyFile(f"key file {path} holds no z85 CURVE key pair (a public .key file?)")
    return CurveKeys(public, secret)


def load_public_key(value: bytes | str | Path) -> bytes:
    """A public key given as its 40 z85 characters, or as a certificate file holding it."""
    if isinstance(value, bytes | str) and len(value) == 40 and not os.path.exists(value):
        return value.encode() if isinstance(value, str) else value
    path = Path(os.fsdecode(value))
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise BadKeyFile(
            f"{value!r} is neither a 40-character z85 public key nor a certificate file: {exc}"
        ) from None
    if len(public) != 40:
        raise BadKeyFile(f"certificate {path} holds no z85 public key")
    return public


def load_run_keys(directory: Path | str) -> RunKeys:
    """The run's key set from `network.keys_dir`: server, stage and client secret certificates."""
    directory = Path(directory)
    pairs = {name: load_secret_file(directory / f"{name}{SECRET_SUFFIX}") for name in KEY_NAMES}
    return _run_keys(pairs)


def _run_keys(pairs: dict[str, CurveKeys]) -> RunKeys:
    server, stage, client = (pairs[name] for name in KEY_NAMES)
    return RunKeys(
        server.public.decode(), server.secret.decode(), stage.public.decode(), stage.secret.decode(),
        client.public.decode(),
    )  # fmt: skip


def create_key_files(directory: Path | str) -> RunKeys:
    """A fresh key set written to `directory` (created 0700; secret files 0600)."""
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.chmod(0o700)
    pairs = {}
    for name in KEY_NAMES:
        for suffix in (".key", SECRET_SUFFIX):
            (directory / f"{name}{suffix}").unlink(missing_ok=True)
        public_file, secret_file = zmq.auth.create_certificates(directory, name)
        Path(secret_file).chmod(0o600)
        Path(public_file).chmod(0o600)
        pairs[name] = load_secret_file(secret_file)
    return _run_keys(pairs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ipc.keys", description="Make a CURVE key set for network.keys_dir."
    )
    parser.add_argument("directory", type=Path, help="where to write it (created 0700; files 0600)")
    parser.add_argument(
        "--force", action="store_true", help="replace a key set already there (its holders are cut off)"
    )
    args = parser.parse_args(argv)
    held = [
        name
        for name in KEY_NAMES
        for suffix in (".key", SECRET_SUFFIX)
        if (args.directory / (name + suffix)).exists()
    ]
    if held and not args.force:
        parser.error(
            f"{args.directory} holds a key set already ({', '.join(sorted(set(held)))}); replacing it cuts off "
            "every stage and client that uses it: pass --force to replace it"
        )
    keys = create_key_files(args.directory)
    for name in KEY_NAMES:
        print(args.directory / (name + SECRET_SUFFIX))
    print(f"server public key: {keys.server_public}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
