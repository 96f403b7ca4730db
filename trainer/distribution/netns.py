"""A private network namespace with only loopback, for clusters that run on this machine.

TensorFlow's gRPC servers listen on `0.0.0.0:<port>` whatever the cluster spec names, unauthenticated, and
run any graph sent to them (docs/design.md, rule 12). A local cluster only talks over loopback, so it runs
in a network namespace whose only interface is `lo`. Unprivileged Linux allows this through a user
namespace (as `unshare -rn`): own uid/gid mapped onto themselves (files keep their owner), `lo` brought up;
children inherit it, the filesystem, pids and signals are the host's. Only a single-threaded process can
enter, so `enter` runs before TensorFlow loads (it starts threads); a process that has loaded it
re-executes itself with `REQUEST` set and the new image enters at its first line (`enter_if_requested`).
Where none of this is possible, one `warning:` line says what is exposed and how to close it.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import subprocess
import sys
from collections.abc import Sequence

# The process's state, in its environment for children and a re-executed image: "enter" asks the next image
# to enter; "net:[inode]" means inside that namespace; "exposed": entering failed and the warning was printed.
STATE_ENV = "TRAINER_PRIVATE_NETWORK"
REQUEST = "enter"
EXPOSED = "exposed"

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1


class Unavailable(Exception):
    """This process cannot enter a private network namespace (the message says why)."""


def _current_namespace() -> str:
    return os.readlink("/proc/self/ns/net")


def is_private() -> bool:
    state = os.environ.get(STATE_ENV, "")
    return state.startswith("net:") and sys.platform == "linux" and state == _current_namespace()


def enter() -> None:
    """Moves this (single-threaded) process into a new user + network namespace, `lo` up; Unavailable (the
    process unchanged) where the kernel refuses, RuntimeError where `lo` then cannot be set up."""
    if sys.platform != "linux":
        raise Unavailable(f"network namespaces are Linux-only (this is {sys.platform})")
    if len(os.listdir("/proc/self/task")) > 1:
        raise Unavailable("the process already runs threads, so it cannot enter a user namespace")
    uid, gid = os.getuid(), os.getgid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
        raise Unavailable(f"unshare(CLONE_NEWUSER|CLONE_NEWNET) failed: {os.strerror(ctypes.get_errno())}")
    try:
        _map_ids(uid, gid)
        _bring_loopback_up()
    except OSError as error:
        raise RuntimeError(f"entered a private network namespace but could not set it up: {error}") from error
    os.environ[STATE_ENV] = _current_namespace()


def _map_ids(uid: int, gid: int) -> None:
    """Maps our own uid and gid onto themselves (only one id each: more needs newuidmap)."""
    _write("/proc/self/setgroups", "deny")  # required before an unprivileged gid_map
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _bring_loopback_up() -> None:
    """`ip link set lo up`, by ioctl (no `ip` binary needed); a new namespace's `lo` is down."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(sock, _SIOCGIFFLAGS, request)[:18])[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))


def warn_exposed(what: str, reason: str) -> None:
    os.environ[STATE_ENV] = EXPOSED
    print(
        f"warning: {what} is reachable from the network: its TensorFlow servers listen on all "
        f"addresses, unauthenticated, and run any graph sent to them (no private network "
        f"namespace: {reason}); allow unprivileged user namespaces (sysctl "
        f"user.max_user_namespaces > 0) or block these ports with a firewall",
        file=sys.stderr,
        flush=True,
    )


def isolate(what: str) -> bool:
    """Enters the private namespace now (before TensorFlow loads), or warns once; whether it is isolated."""
    if is_private():
        return True
    if os.environ.get(STATE_ENV) == EXPOSED:
        return False
    try:
        enter()
    except Unavailable as error:
        warn_exposed(what, str(error))
        return False
    return True


def enter_if_requested(what: str) -> None:
    """An entry point's first line: enters if the image that exec'd this one asked to, and records whether
    this process could re-execute itself into one later (only if still single-threaded here)."""
    global _can_reexec
    _can_reexec = len(os.listdir("/proc/self/task")) == 1 if sys.platform == "linux" else False
    if os.environ.get(STATE_ENV) == REQUEST:
        del os.environ[STATE_ENV]
        isolate(what)


_can_reexec = False


def can_enter() -> str | None:
    """None if a fresh process here can enter a private namespace, else why not (~0.1 s)."""
    if sys.platform != "linux":
        return f"network namespaces are Linux-only (this is {sys.platform})"
    probe = subprocess.run(
        [sys.executable, os.path.abspath(__file__)],
        env={**os.environ, STATE_ENV: ""},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if probe.returncode == 0:
        return None
    lines = probe.stderr.strip().splitlines()
    return lines[-1] if lines else f"probe exited with code {probe.returncode}"


def reexec_isolated(what: str, extra_args: Sequence[str] = ()) -> None:
    """Replaces this process (same pid, argv + `extra_args`) by one that enters, for a process with threads
    whose entry point called `enter_if_requested`; returns (after the one warning) where that is impossible."""
    if is_private() or os.environ.get(STATE_ENV) == EXPOSED:
        return
    no_reexec = "this entry point does not re-execute itself into one before TensorFlow loads"
    if (reason := can_enter() if _can_reexec else no_reexec) is not None:
        warn_exposed(what, reason)
        return
    os.environ[STATE_ENV] = REQUEST
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:], *extra_args])


if __name__ == "__main__":  # the probe of `can_enter`: exits 0 once inside, else says why
    try:
        enter()
    except Unavailable as refused:
        sys.exit(str(refused))
