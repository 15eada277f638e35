"""Least privilege for the stages: no new privileges, another user, and Landlock.

- `set_no_new_privs`: every stage, at start. Nothing it executes can gain privileges (setuid
  binaries, file capabilities), and it is what lets an unprivileged process restrict itself with
  Landlock.
- `drop_to(user)` (supervisor.run_as, when started as root): setgroups, setgid, setuid, in that
  order (the groups and the gid need root). The gateway drops once it has bound its port (one
  below 1024 needs root); the other stages at start, before they make their sockets, so that their
  socket files belong to that user and the other stages (that user too) can connect to them.
- `restrict_writes(paths)`: Landlock (Linux 5.13+), for the stages that parse untrusted input
  (the tokenizer and the gateway: JSON, chat templates): from then on the process may create,
  write, truncate, rename or remove files only beneath `paths` (the run dir, and the audit and
  access logs where they are elsewhere). Reads are not restricted. Where the kernel has no
  Landlock (the syscall is missing, or it is disabled), nothing is restricted and `status` says so.

Each call records what took effect; `active()` lists it for the stage's Ready (its `status` row).
"""

from __future__ import annotations

import ctypes
import grp
import logging
import os
import pwd
import stat
from pathlib import Path

log = logging.getLogger(__name__)

PR_SET_NO_NEW_PRIVS = 38
# x86_64 and aarch64 (the generic table) give Landlock the same numbers.
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1

# Filesystem access rights (include/uapi/linux/landlock.h) and the ABI version that added each.
WRITE_FILE, REMOVE_DIR, REMOVE_FILE = 1 << 1, 1 << 4, 1 << 5
MAKE_CHAR, MAKE_DIR, MAKE_REG, MAKE_SOCK = 1 << 6, 1 << 7, 1 << 8, 1 << 9
MAKE_FIFO, MAKE_BLOCK, MAKE_SYM = 1 << 10, 1 << 11, 1 << 12
REFER = 1 << 13  # ABI 2: rename and link across directories
TRUNCATE = 1 << 14  # ABI 3
WRITE_RIGHTS_V1 = (
    WRITE_FILE
    | REMOVE_DIR
    | REMOVE_FILE
    | MAKE_CHAR
    | MAKE_DIR
    | MAKE_REG
    | MAKE_SOCK
    | MAKE_FIFO
    | MAKE_BLOCK
    | MAKE_SYM
)
FILE_RIGHTS = WRITE_FILE | TRUNCATE  # the only ones of these a rule on a file (not a directory) may hold

_active: list[str] = []
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64)]  # the ABI 1 prefix: the kernel takes its size


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def active() -> list[str]:
    """The protections this process has put on itself, in the order they were applied."""
    return list(_active)


def set_no_new_privs() -> bool:
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_NO_NEW_PRIVS): %s", os.strerror(ctypes.get_errno()))
        return False
    _active.append("no_new_privs")
    return True


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where it has none (or it is disabled)."""
    version = _libc.syscall(
        SYS_LANDLOCK_CREATE_RULESET,
        None,
        ctypes.c_size_t(0),
        ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION),
    )
    return max(0, int(version))


def _write_rights(abi: int) -> int:
    return WRITE_RIGHTS_V1 | (REFER if abi >= 2 else 0) | (TRUNCATE if abi >= 3 else 0)


def restrict_writes(paths: list[Path]) -> bool:
    """Allow this process (and what it starts) to write only beneath `paths`; whether Landlock
    took effect. Needs no_new_privs (or CAP_SYS_ADMIN). A path that does not exist is skipped."""
    abi = landlock_abi()
    if abi == 0:
        log.info("Landlock: not offered by this kernel; writes are not restricted")
        return False
    handled = _write_rights(abi)
    ruleset = _libc.syscall(
        SYS_LANDLOCK_CREATE_RULESET,
        ctypes.byref(_RulesetAttr(handled)),
        ctypes.c_size_t(ctypes.sizeof(_RulesetAttr)),
        ctypes.c_uint32(0),
    )
    if ruleset < 0:
        log.warning(
            "Landlock: create_ruleset: %s; writes are not restricted", os.strerror(ctypes.get_errno())
        )
        return False
    try:
        for path in paths:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                allowed = handled if stat.S_ISDIR(os.fstat(fd).st_mode) else handled & FILE_RIGHTS
                rule = _PathBeneathAttr(allowed, fd)
                if (
                    _libc.syscall(
                        SYS_LANDLOCK_ADD_RULE,
                        ctypes.c_int(ruleset),
                        ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH),
                        ctypes.byref(rule),
                        ctypes.c_uint32(0),
                    )
                    != 0
                ):
                    raise OSError(
                        ctypes.get_errno(), f"landlock_add_rule {path}: {os.strerror(ctypes.get_errno())}"
                    )
            finally:
                os.close(fd)
        if _libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), f"landlock_restrict_self: {os.strerror(ctypes.get_errno())}")
    except OSError as exc:
        log.warning("Landlock: %s; writes are not restricted", exc.strerror)
        return False
    finally:
        os.close(ruleset)
    _active.append(f"landlock_v{abi}")
    return True


def resolve_user(name: str) -> tuple[int, int]:
    """supervisor.run_as (a user name, or a uid) as (uid, gid); KeyError if there is no such user."""
    entry = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
    return entry.pw_uid, entry.pw_gid


def drop_to(name: str) -> bool:
    """Become supervisor.run_as for good, when running as root; whether this process did."""
    if not name or os.geteuid() != 0:
        return False
    uid, gid = resolve_user(name)
    os.setgroups([gid])
    os.setgid(gid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise OSError(f"could not become uid {uid}")
    _active.append(f"user={pwd.getpwuid(uid).pw_name}")
    log.info("running as %s (uid %d, gid %d, group %s)", name, uid, gid, grp.getgrgid(gid).gr_name)
    return True
