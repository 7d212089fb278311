"""Partially overlapping in-place operations are refused as torch refuses them (issue 36,
item 21): on a GPU their result would depend on thread scheduling. The very same memory (an
input that is the output, ``a += a``) stays allowed, as in torch."""

from __future__ import annotations

import numpy as np
import pytest

import cudalab

MESSAGE = ("unsupported operation: some elements of the input tensor and the written-to "
           "tensor refer to a single memory location")


def test_partially_overlapping_inplace_operator_raises():
    c = cudalab.asarray(np.arange(6, dtype=np.float32))
    with pytest.raises(RuntimeError, match=MESSAGE):
        c[1:] += c[:-1]
    assert c.numpy().tolist() == list(range(6))  # nothing ran


def test_partially_overlapping_copy_raises():
    b = cudalab.asarray(np.arange(6, dtype=np.int64))
    with pytest.raises(RuntimeError, match=MESSAGE):
        b[1:].copy_(b[:-1])
    with pytest.raises(RuntimeError, match=MESSAGE):  # a converting copy, likewise
        b[1:].copy_(b[:-1].view(np.float64))
    two = cudalab.asarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    with pytest.raises(RuntimeError, match=MESSAGE):  # a broadcast input inside the output
        two.copy_(two[0])
    assert b.numpy().tolist() == list(range(6))


def test_full_aliasing_and_disjoint_views_stay_allowed():
    c = cudalab.asarray(np.arange(6, dtype=np.float32))
    c += c
    c[3:] += c[:3]  # disjoint halves of one allocation
    c.copy_(c)
    c[:3].copy_(c[3:])
    assert c.numpy().tolist() == [6.0, 10.0, 14.0, 6.0, 10.0, 14.0]
