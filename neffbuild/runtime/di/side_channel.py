"""The DI side channel: length-prefixed JSON messages over TCP, a threaded server and a client.

A message is an 8-byte little-endian length then that many bytes of UTF-8 JSON. The server
answers each message with one message: ``handlers[msg["op"]](msg)``, or ``{"error": ...}``;
``close`` ends a session. The client waits for an answer in short slices and gives up when
the peer closed the connection (a dead process's sockets are closed by its kernel), when its
``alive`` check fails, or when the timeout passes: ``ChannelClosed`` or ``ChannelTimeout``,
both ``KVTransferError``s that the caller names a request in.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Callable

from neffbuild.errors import KVTransferError

MAX_FRAME = 64 << 20
SLICE = 0.25  # seconds between liveness checks while waiting for an answer

Handler = Callable[[dict], dict]


class ChannelClosed(KVTransferError):
    """The peer closed the side channel (its process died or stopped serving)."""


class ChannelTimeout(KVTransferError):
    """The peer did not answer within the call's timeout."""


class RemoteError(KVTransferError):
    """The peer answered with an error (its handler raised or refused the message)."""


def send_msg(sock: socket.socket, msg: dict) -> None:
    data = json.dumps(msg).encode()
    sock.sendall(struct.pack("<Q", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None, alive: Callable[[], bool] | None) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except TimeoutError:
            if alive is not None and not alive():
                raise ChannelClosed("the peer's process is gone") from None
            if deadline is not None and time.monotonic() > deadline:
                raise ChannelTimeout("no answer in time") from None
            continue
        except OSError as exc:
            raise ChannelClosed(f"side channel error: {exc}") from None
        if not chunk:
            raise ChannelClosed("side channel closed by the peer")
        buf += chunk
    return bytes(buf)


def recv_msg(sock: socket.socket, timeout: float | None = None, alive: Callable[[], bool] | None = None) -> dict:
    """One message; waits in ``SLICE`` steps when the socket has a timeout set (``Client`` sets it)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    (n,) = struct.unpack("<Q", _recv_exact(sock, 8, deadline, alive))
    if n > MAX_FRAME:
        raise KVTransferError(f"side channel frame of {n} bytes is above the {MAX_FRAME}-byte limit")
    return json.loads(_recv_exact(sock, n, deadline, alive))


class Server:
    """Answers messages on ``host:port`` (port 0 picks a free one), one thread per connection."""

    def __init__(self, handlers: dict[str, Handler], port: int = 0, host: str = "127.0.0.1"):
        self.handlers = dict(handlers)
        self._sock: socket.socket | None = socket.create_server((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name=f"side-channel-{self.port}").start()

    def _accept(self) -> None:
        while self._sock is not None:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._session, args=(conn,), daemon=True).start()

    def _session(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    msg = recv_msg(conn)
                except (KVTransferError, OSError, ValueError):
                    return
                op = msg.get("op")
                if op == "close":
                    send_msg(conn, {"ok": True})
                    return
                try:
                    handler = self.handlers.get(op)
                    reply = handler(msg) if handler else {"error": f"unknown side-channel op {op!r}"}
                except Exception as exc:
                    reply = {"error": f"{type(exc).__name__}: {exc}"}
                try:
                    send_msg(conn, reply)
                except OSError:
                    return

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


class Client:
    """One connection to a ``Server``; ``call`` sends a message and waits for its answer."""

    def __init__(self, host: str, port: int, *, connect_timeout: float = 30.0, alive: Callable[[], bool] | None = None):
        self.host, self.port, self.alive = host, port, alive
        try:
            self._sock: socket.socket | None = socket.create_connection((host, port), timeout=connect_timeout)
        except OSError as exc:
            raise ChannelClosed(f"cannot reach the side channel at {host}:{port} ({exc})") from None
        self._sock.settimeout(SLICE)
        self._lock = threading.Lock()

    def call(self, op: str, timeout: float = 30.0, **payload) -> dict:
        """One answer; ``{"error": ...}`` raises ``RemoteError``, a dead or silent peer ``ChannelClosed`` /
        ``ChannelTimeout`` (after ``timeout`` seconds)."""
        if self._sock is None:
            raise ChannelClosed(f"side channel to {self.host}:{self.port} is closed")
        with self._lock:
            try:
                send_msg(self._sock, {"op": op, **payload})
            except OSError as exc:
                raise ChannelClosed(f"side channel to {self.host}:{self.port}: {exc}") from None
            reply = recv_msg(self._sock, timeout, self.peer_alive)
        if "error" in reply:
            raise RemoteError(reply["error"])
        return reply

    def peer_alive(self) -> bool:
        """False once the peer has closed the connection (checked without consuming data), or ``alive`` fails."""
        if self.alive is not None and not self.alive():
            return False
        if self._sock is None:
            return False
        try:
            return self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except (BlockingIOError, TimeoutError):
            return True
        except OSError:
            return False

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            return
        try:
            send_msg(sock, {"op": "close"})
            recv_msg(sock, timeout=2.0)
        except (OSError, KVTransferError, ValueError):
            pass
        sock.close()
