"""Signed messages between a rank and the notebook watching it: HMAC-SHA256 over the frames.

As in jupyter_client's ``session.py``: every message is a list of ZeroMQ frames whose first
frame is the hex HMAC-SHA256 digest, under the connection file's key, of all the frames
after it, each fed to the HMAC in order. The receiver computes the digest of the frames it
got and compares it with :func:`hmac.compare_digest` before anything in them is decoded: a
message with a wrong, missing or malformed signature is dropped (and counted by its
receiver), never parsed.

Each frame's length is fed to the HMAC before the frame, so two messages whose frames
concatenate to the same bytes (``[b"ab", b"c"]`` and ``[b"a", b"bc"]``) sign differently.

A :class:`Signer` keeps its key's two SHA-256 states of the HMAC construction (RFC 2104:
the key padded and XORed with the inner and the outer pad, already hashed) and signs a
message with a copy of each: the same digest as ``hmac.new(key, ..., sha256)``, in about
half the time of making that object per message (what a rank pays twice a second).
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
_BLOCK = 64  # SHA-256's block size (bytes): a longer key is hashed first (RFC 2104)


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
    return _Key(key).digest(frames)


class _Key:
    """A key's HMAC-SHA256 inner and outer states, ready to be copied per message."""

    __slots__ = ("inner", "outer")

    def __init__(self, key: bytes):
        if len(key) > _BLOCK:
            key = hashlib.sha256(key).digest()
        padded = key.ljust(_BLOCK, b"\0")
        self.inner = hashlib.sha256(bytes(b ^ 0x36 for b in padded))
        self.outer = hashlib.sha256(bytes(b ^ 0x5C for b in padded))

    def digest(self, frames: Sequence[Any]) -> bytes:
        """The hex signature of ``frames`` (each frame's length, then its bytes, in order)."""
        inner = self.inner.copy()
        for frame in frames:
            inner.update(len(frame).to_bytes(8, "little"))
            inner.update(frame)
        outer = self.outer.copy()
        outer.update(inner.digest())
        return outer.hexdigest().encode("ascii")


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

    __slots__ = ("key", "rejected", "_key")

    def __init__(self, key: bytes):
        if not isinstance(key, bytes) or not key:
            raise ValueError("Signer: the key must be non-empty bytes")
        #: The shared key.
        self.key = key
        #: Messages refused by :meth:`unwrap` (bad or missing signature), >= 0.
        self.rejected = 0
        self._key = _Key(key)

    def wrap(self, frames: Sequence[bytes]) -> list[bytes]:
        """``[signature, *frames]``: the message to send."""
        return [self._key.digest(frames), *frames]

    def unwrap(self, message: Sequence[bytes]) -> list[bytes] | None:
        """The frames after the signature when it checks out; None (and :attr:`rejected`
        grows by one) otherwise. Nothing of the frames is looked at beyond their bytes."""
        if (len(message) < 2 or len(message[0]) != SIGNATURE_LENGTH
                or not hmac.compare_digest(self._key.digest(message[1:]), bytes(message[0]))):
            self.rejected += 1
            return None
        return list(message[1:])
