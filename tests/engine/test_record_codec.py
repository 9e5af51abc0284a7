"""fedsim.record_codec: the fast codec must match Flower's np.save encoding exactly."""

import io
import pickle

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedsim.record_codec import (
    array_to_fill,
    array_to_numpy,
    content_nbytes,
    numpy_to_array,
    records_of,
    to_numpy,
    to_record,
)

ARRAYS = [
    np.arange(24, dtype=np.float32).reshape(2, 3, 4),
    np.array([1.5, -2.0], dtype=np.float64),
    np.arange(6, dtype=np.int64).reshape(3, 2),
    np.array([True, False, True]),
    np.zeros((0, 5), dtype=np.float16),
    np.array(3.25, dtype=np.float32),
]


@pytest.mark.parametrize("value", ARRAYS, ids=lambda a: f"{a.dtype}{a.shape}")
def test_bytes_equal_numpy_save(value):
    buffer = io.BytesIO()
    np.save(buffer, value, allow_pickle=False)
    ours = numpy_to_array(value)
    assert ours.data == buffer.getvalue()
    assert ours.dtype == str(value.dtype) and ours.shape == value.shape
    assert ours.data == Array(value).data


@pytest.mark.parametrize("value", ARRAYS, ids=lambda a: f"{a.dtype}{a.shape}")
def test_round_trip_through_flower(value):
    # Flower reads what we write, we read what Flower writes.
    assert np.array_equal(numpy_to_array(value).numpy(), value)
    decoded = array_to_numpy(Array(value))
    assert decoded.dtype == value.dtype and np.array_equal(decoded, value)


@pytest.mark.parametrize("value", ARRAYS, ids=lambda a: f"{a.dtype}{a.shape}")
def test_an_array_filled_in_place_is_the_array_np_save_writes(value):
    """array_to_fill: what is written into its view is the Array (no copy): its payload is
    np.save's bytes, Flower and to_numpy read it (read-only, though the buffer is mutable),
    and it survives pickling as any Array does."""
    array, view = array_to_fill(value.dtype, value.shape)
    assert view.flags.writeable and view.flags.c_contiguous and view.shape == value.shape
    view[...] = value
    buffer = io.BytesIO()
    np.save(buffer, value, allow_pickle=False)
    assert bytes(array.data) == buffer.getvalue() == numpy_to_array(value).data
    assert array.dtype == str(value.dtype) and array.shape == value.shape
    assert np.array_equal(array.numpy(), value)
    decoded = array_to_numpy(array)
    assert np.array_equal(decoded, value) and not decoded.flags.writeable
    if value.size:
        view.reshape(-1)[0] = not value.reshape(-1)[0] if value.dtype == bool else 7
        assert array_to_numpy(array).reshape(-1)[0] == view.reshape(-1)[0]  # the same memory
    again = pickle.loads(pickle.dumps(array))
    assert np.array_equal(array_to_numpy(again), view) and len(again.data) == len(array.data)
    with pytest.raises(TypeError, match="object arrays"):
        array_to_fill(object, (2,))


def test_fortran_order_and_non_contiguous_input():
    fortran = np.asfortranarray(np.arange(12.0).reshape(3, 4))
    assert np.array_equal(array_to_numpy(Array(fortran)), fortran)
    strided = np.arange(20.0)[::2]
    assert np.array_equal(array_to_numpy(numpy_to_array(strided)), strided)


def test_decoded_arrays_are_read_only_views():
    record = to_record({"w": np.ones(4, dtype=np.float32)})
    view = to_numpy(record)["w"]
    assert not view.flags.writeable
    with pytest.raises(ValueError):
        view[0] = 2.0


def test_record_keys_and_values_survive():
    arrays = {"a": np.ones((2, 2)), "b": np.arange(3)}
    record = to_record(arrays)
    assert isinstance(record, ArrayRecord)
    back = to_numpy(record)
    assert list(back) == ["a", "b"]
    assert all(np.array_equal(back[k], arrays[k]) for k in arrays)


def test_object_arrays_are_refused():
    with pytest.raises(TypeError):
        numpy_to_array(np.array([object()]))


def test_non_npy_payload_is_rejected():
    bad = Array(dtype="float32", shape=(1,), stype="numpy.ndarray", data=b"garbage!")
    with pytest.raises(ValueError, match="npy"):
        array_to_numpy(bad)


def test_records_of_and_payload_size():
    content = RecordDict(
        {
            "arrays": to_record({"w": np.zeros(10, dtype=np.float32)}),
            "metrics": MetricRecord({"num-examples": 3, "loss": 0.5, "hist": [1.0, 2.0]}),
            "config": ConfigRecord({"name": "abc"}),
        }
    )
    assert [k for k, _ in records_of(content, ArrayRecord)] == ["arrays"]
    assert [k for k, _ in records_of(content, MetricRecord)] == ["metrics"]
    array_bytes = len(content["arrays"]["w"].data)
    assert content_nbytes(content) == array_bytes + 8 + 8 + 16 + 3
    # lists of bytes (e.g. sealed shares) count their lengths, not 8 per item
    sealed = RecordDict({"c": ConfigRecord({"ciphertexts": [b"ab", b"cde"], "ids": [1, 2]})})
    assert content_nbytes(sealed) == 2 + 3 + 8 + 8


def test_fast_arrays_are_indistinguishable_from_flower_arrays():
    # numpy_to_array skips Flower's constructor; the object must be the same in
    # every respect Flower relies on: fields, equality, and (de)serialisation.
    value = np.arange(12, dtype=np.float32).reshape(3, 4)
    ours, theirs = numpy_to_array(value), Array(value)
    assert ours == theirs and ours.is_dirty and ours.object_id == theirs.object_id
    assert ours.deflate() == theirs.deflate()
    record = to_record({"w": value})
    assert record.object_id == ArrayRecord({"w": Array(value)}).object_id
    rebuilt = Array.inflate(ours.deflate(), children=dict(ours.children))
    assert np.array_equal(rebuilt.numpy(), value)
