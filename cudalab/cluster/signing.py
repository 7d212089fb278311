"""Signed messages between a rank and the notebook watching it: HMAC-SHA256 over the frames.

As in jupyter_client's ``session.py``: every message is a list of ZeroMQ frames whose first
frame is the hex HMAC-SHA256 digest, under the connection file's key, of all the frames
after it, each fed to the HMAC in order. The receiver computes the digest of the frames it
got and compares it with :func:`hmac.compare_digest` before anything in them is decoded: a
message with a wrong, missing or malformed signature is dropped (and counted by its
receiver), never parsed.

Each frame's length is fed to the HMAC before the frame, so two messages whose frames
concatenate to the same bytes (``[b"ab", b"c"]`` and ``[b"a", b"bc"]``) sign differently.

A small message (every sample a rank publishes) is signed in one C call: its frames and
their lengths joined, then ``hmac.digest`` (the same HMAC as fed piece by piece, without
the Python of an ``hmac.HMAC`` object); a large one (a snapshot) is fed piece by piece to a
copy of the key's prepared HMAC, so it is not copied.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["KEY_BYTES", "new_key", "sign", "verify", "Signer"]

#: Bytes of a fresh key (:func:`new_key`); keys travel in connection files as hex.
KEY_BYTES = 32
#: The signature frame's length: 64 hex digits (SHA-256).
SIGNATURE_LENGTH = 64
#: Messages of at most this many bytes are signed by one ``hmac.digest`` over their joined
#: frames (a copy that costs less than the HMAC object's Python); larger ones piece by piece.
ONE_SHOT_BYTES = 64 << 10


def new_key() -> bytes:
    """A fresh random key of :data:`KEY_BYTES` bytes (``os.urandom``)."""
    return os.urandom(KEY_BYTES)


def sign(key: bytes, frames: Sequence[bytes]) -> bytes:
    """The signature of ``frames`` under ``key``: the hex HMAC-SHA256 digest, as ASCII bytes.

    Parameters
    ----------
    key : bytes
        The shared key (non-empty).
    frames : sequence of bytes
        The frames to sign, in order.

    Returns
    -------
    bytes
        64 lower-case hex digits.
    """
    if not key:
        raise ValueError("sign(): the key is empty; a connection's key is "
                         f"{KEY_BYTES} random bytes")
    return _digest(key, None, frames)


def _digest(key: bytes, prepared: Any, frames: Sequence[bytes]) -> bytes:
    """The hex signature of ``frames``: one ``hmac.digest`` over the frames joined with
    their lengths when small, else fed piece by piece to ``prepared`` (a fresh HMAC of
    ``key`` when None), copied."""
    total = 0
    for frame in frames:
        total += len(frame)
    if total <= ONE_SHOT_BYTES:
        parts: list[Any] = []
        for frame in frames:
            parts.append(len(frame).to_bytes(8, "little"))
            parts.append(frame)
        return hmac.digest(key, b"".join(parts), "sha256").hex().encode("ascii")
    mac = (prepared if prepared is not None else hmac.new(key, digestmod=hashlib.sha256)).copy()
    for frame in frames:
        mac.update(len(frame).to_bytes(8, "little"))
        mac.update(frame)
    return mac.hexdigest().encode("ascii")


def verify(key: bytes, signature: bytes, frames: Sequence[bytes]) -> bool:
    """Whether ``signature`` is the signature of ``frames`` under ``key`` (a constant-time
    comparison, :func:`hmac.compare_digest`); False for a signature of the wrong length."""
    if len(signature) != SIGNATURE_LENGTH:
        return False
    return hmac.compare_digest(sign(key, frames), bytes(signature))


class Signer:
    """Signs outgoing and checks incoming multipart messages with one key, counting the
    messages it refused.

    A message is ``[signature, *frames]``. Not thread-safe by itself: each socket's owner
    thread uses its own.
    """

    __slots__ = ("key", "rejected", "_prepared")

    def __init__(self, key: bytes):
        if not isinstance(key, bytes) or not key:
            raise ValueError("Signer: the key must be non-empty bytes")
        #: The shared key.
        self.key = key
        #: Messages refused by :meth:`unwrap` (bad or missing signature), >= 0.
        self.rejected = 0
        self._prepared = hmac.new(key, digestmod=hashlib.sha256)  # (copied per large message)

    def wrap(self, frames: Sequence[bytes]) -> list[bytes]:
        """``[signature, *frames]``: the message to send."""
        return [_digest(self.key, self._prepared, frames), *frames]

    def unwrap(self, message: Sequence[bytes]) -> list[bytes] | None:
        """The frames after the signature when it checks out; None (and :attr:`rejected`
        grows by one) otherwise. Nothing of the frames is looked at beyond their bytes."""
        if (len(message) < 2 or len(message[0]) != SIGNATURE_LENGTH
                or not hmac.compare_digest(_digest(self.key, self._prepared, message[1:]),
                                           bytes(message[0]))):
            self.rejected += 1
            return None
        return list(message[1:])
