"""DeviceArray.cpu / tolist / item / to / fill_ / zero_ and full's sizes (issue 20)."""

from __future__ import annotations

import numpy as np
import pytest

import cudalab
from cudalab._dtypes import SUPPORTED_DTYPES
from tests.array.helpers import strided


# --------------------------------------------------------------------------- host copies
def test_cpu_returns_a_numpy_copy():
    host = np.arange(12, dtype=np.int16).reshape(3, 4)
    a = cudalab.asarray(host)
    out = a.cpu()
    assert type(out) is np.ndarray and out.dtype == np.int16
    np.testing.assert_array_equal(out, host)
    out[0, 0] = 99  # a copy: the device keeps its values
    assert a.cpu()[0, 0] == 0


def test_cpu_of_strided_arrays():
    host = np.arange(60, dtype=np.float64).reshape(3, 4, 5)
    for view in (host.transpose(2, 0, 1), host[::-1, 1:3, ::-2], host[:, :0]):
        got = strided(view).cpu()
        assert got.flags.c_contiguous
        np.testing.assert_array_equal(got, view)


def test_tolist_and_item_give_python_scalars():
    a = cudalab.asarray(np.array([[1, 2], [3, 4]], np.int32))
    assert a.tolist() == [[1, 2], [3, 4]] and type(a.tolist()[0][0]) is int
    assert cudalab.full((1, 1), 2.5, dtype="float32").item() == 2.5
    assert type(cudalab.ones(1, dtype="bool").item()) is bool
    assert cudalab.zeros((), dtype="complex64").tolist() == 0j
    assert a[1][0].item() == 3


def test_item_needs_exactly_one_element():
    with pytest.raises(RuntimeError, match="a Tensor with 4 elements cannot be converted to Scalar"):
        cudalab.ones((2, 2)).item()
    with pytest.raises(RuntimeError, match="with 0 elements"):
        cudalab.empty(0).item()


def test_bfloat16_items_are_floats():
    pytest.importorskip("ml_dtypes")
    a = cudalab.full(3, 1.5, dtype="bfloat16")
    assert a.tolist() == [1.5, 1.5, 1.5] and type(a.tolist()[0]) is float
    assert type(a[0].item()) is float


# --------------------------------------------------------------------------- to()
def test_to_cpu_returns_numpy():
    a = cudalab.asarray(np.arange(4, dtype=np.int32))
    out = a.to("cpu")
    assert type(out) is np.ndarray and out.tolist() == [0, 1, 2, 3]
    assert a.to(device="cpu", dtype="float64").dtype == np.float64


def test_to_the_same_device_is_the_array_itself_unless_copy():
    a = cudalab.ones(4)
    assert a.to(0) is a and a.to("cuda:0") is a and a.to(dtype=np.float32) is a
    assert a.to(a) is a
    c = a.to("cuda:0", copy=True)
    assert c is not a and c.data_ptr() != a.data_ptr() and c.tolist() == [1.0] * 4


def test_to_another_device(two_devices):
    a = cudalab.asarray(np.arange(1000, dtype=np.float32))
    for target in (1, "cuda:1", cudalab.Device("cuda:1")):
        b = a.to(target)
        assert b.device_index == 1 and b.dtype == a.dtype
        np.testing.assert_array_equal(b.cpu(), np.arange(1000, dtype=np.float32))
    back = a.to(1).to(device=0)
    assert back.device_index == 0 and back.tolist() == a.tolist()
    other = cudalab.zeros(1, device=1)
    assert a.to(other).device_index == 1


def test_to_rejects_what_is_neither_a_device_nor_a_dtype():
    a = cudalab.ones(2)
    with pytest.raises(TypeError, match="neither a device nor a dtype"):
        a.to(True)
    with pytest.raises(TypeError, match="device twice"):
        a.to("cuda:0", device="cuda:0")
    with pytest.raises(TypeError, match="dtype twice"):
        a.to(np.float32, dtype=np.float32)
    with pytest.raises(TypeError, match="unexpected keyword"):
        a.to(devic="cuda:0")
    with pytest.raises(TypeError, match="unsupported dtype"):
        a.to("cuda:0", "no-such-dtype")


# --------------------------------------------------------------------------- fill_ / zero_
def _dtypes() -> list:
    dts = list(SUPPORTED_DTYPES)
    try:
        import ml_dtypes

        dts.append(np.dtype(ml_dtypes.bfloat16))
    except ImportError:
        pass
    return dts


@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
def test_fill_and_zero_every_dtype(dtype):
    value = {"b": True, "c": 3 - 2j, "u": 200 if dtype.itemsize > 1 else 7}.get(dtype.kind, -3)
    if dtype.kind == "f" or dtype.name == "bfloat16":
        value = -1.25
    a = cudalab.empty(1001, dtype=dtype)
    assert a.fill_(value) is a
    np.testing.assert_array_equal(a.cpu(), np.full(1001, value, dtype=dtype))
    assert a.zero_() is a
    np.testing.assert_array_equal(a.cpu(), np.zeros(1001, dtype=dtype))


def test_fill_runs_on_the_current_stream():
    a = cudalab.zeros(1 << 16, dtype="int16")
    s = cudalab.Stream()
    s.wait_stream(cudalab.current_stream())
    with cudalab.stream(s):
        a.fill_(0x1234)  # neither byte-uniform nor 4 bytes: the u16 fill kernel
        a[:10].zero_()
    s.synchronize()
    host = a.cpu()
    assert (host[:10] == 0).all() and (host[10:] == 0x1234).all()


def test_fill_from_a_zero_dim_array_and_bad_values():
    a = cudalab.zeros(3, dtype="int32")
    a.fill_(cudalab.full((), 5, dtype="int64"))
    assert a.tolist() == [5, 5, 5]
    with pytest.raises(ValueError, match="only supports 0-dimension value tensor"):
        a.fill_(cudalab.ones(2))
    with pytest.raises(ValueError, match="cannot be stored as int8"):
        cudalab.zeros(2, dtype="int8").fill_(1000)


# --------------------------------------------------------------------------- sizes
@pytest.mark.parametrize("size", [(2, 3), [2, 3], (np.int64(2), np.int32(3))])
def test_full_takes_torch_sizes(size):
    a = cudalab.full(size, 7, dtype="int16")
    assert a.shape == (2, 3) and a.tolist() == [[7, 7, 7], [7, 7, 7]]
    b = cudalab.full(size=size, fill_value=2.5)
    assert b.shape == (2, 3) and b.cpu().tolist() == [[2.5] * 3] * 2
    assert cudalab.full(5, 1).shape == (5,) and cudalab.full((), 1).shape == ()


def test_full_errors_name_what_is_wrong():
    with pytest.raises(TypeError, match=r"size as one tuple, then the value: full\(\(2, 3\), 7\)"):
        cudalab.full(2, 3, 7)
    with pytest.raises(TypeError, match="fill_value must be a scalar"):
        cudalab.full((2, 3), [1, 2, 3])
    with pytest.raises(TypeError, match="fill_value must be a scalar"):
        cudalab.full((2, 3), cudalab.ones(1))
    with pytest.raises(TypeError):
        cudalab.full((2, 3))  # no fill value
    with pytest.raises(TypeError, match="shape must be"):
        cudalab.full(2.5, 1)


@pytest.mark.parametrize("make", [cudalab.zeros, cudalab.empty, cudalab.ones])
def test_creation_sizes_as_ints(make):
    assert make(2, 3).shape == (2, 3) and make((2, 3)).shape == (2, 3)
