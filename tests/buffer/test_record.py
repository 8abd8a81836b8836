"""The record schema: exact round trips, refusal of foreign or damaged bytes, field validation."""

from __future__ import annotations

import dataclasses
import struct
import zlib
from typing import Any

import numpy as np
import pytest

from osd.buffer.record import MAX_ID_BYTES, SCHEMA_VERSION, Record, RecordVersionError

ARRAY_FIELDS = (
    "token_ids",
    "num_drafted",
    "num_accepted",
    "draft_token_probs",
    "target_top_ids",
    "target_top_probs",
    "step_proposers",
)


def assert_records_identical(a: Record, b: Record) -> None:
    for f in dataclasses.fields(Record):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name in ARRAY_FIELDS:
            assert x.dtype == y.dtype and x.shape == y.shape, f.name
            assert x.tobytes() == y.tobytes(), f.name
        else:
            assert type(x) is type(y) and x == y, f.name


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"num_generated": 256, "m": 32, "prompt_len": 128},
        {"num_generated": 0},
        {"num_generated": 1, "m": 1, "prompt_len": 0},
        {"method": "token", "num_spec_tokens": 1},
        {"method": "spectr", "num_drafts": 4, "num_spec_tokens": 3},
        {"domain": "code", "adapter_name": "code-v", "adapter_version": 7, "request_id": "é-1"},
    ],
)
def test_pack_unpack_round_trips_bit_exactly(kwargs: dict[str, Any]) -> None:
    record = Record.make_dummy(**kwargs)
    restored = Record.unpack(record.pack())
    assert_records_identical(record, restored)
    assert restored == record


def test_round_trip_keeps_a_missing_seed_and_extreme_scalars() -> None:
    record = dataclasses.replace(
        Record.make_dummy(),
        seed=None,
        created_at=1234567890.123456789,
        temperature=0.0,
        top_p=0.3,
        top_k=-1,
        adapter_version=2**40,
    )
    restored = Record.unpack(record.pack())
    assert_records_identical(record, restored)
    assert restored.seed is None
    negative_seed = dataclasses.replace(record, seed=-(2**63))
    assert Record.unpack(negative_seed.pack()).seed == -(2**63)


def test_unpacked_arrays_have_the_schema_dtypes_and_are_read_only() -> None:
    restored = Record.unpack(Record.make_dummy().pack())
    expected = {
        "token_ids": np.int32,
        "num_drafted": np.int16,
        "num_accepted": np.int16,
        "draft_token_probs": np.float16,
        "target_top_ids": np.int32,
        "target_top_probs": np.float16,
    }
    for name, dtype in expected.items():
        arr = getattr(restored, name)
        assert arr.dtype == dtype, name
        assert not arr.flags.writeable, name


def test_record_copies_its_inputs() -> None:
    base = Record.make_dummy()
    token_ids = base.token_ids.copy()
    record = dataclasses.replace(base, token_ids=token_ids)
    token_ids[0] += 1
    assert record.token_ids[0] == base.token_ids[0]


def test_packed_size_is_header_ids_and_raw_arrays() -> None:
    record = Record.make_dummy(num_generated=256, m=32, prompt_len=128, request_id="req-0")
    g, m, t = 256, 32, 384
    d = int(record.num_drafted.sum())
    arrays = 4 * t + 4 * g * m + 2 * 2 * record.num_steps + 2 * d + 2 * g * m + record.num_steps
    ids = len("req-0") + len("general")
    assert len(record.pack()) == 84 + (ids + 3) // 4 * 4 + arrays + 4


def test_wrong_schema_version_raises_record_version_error() -> None:
    data = bytearray(Record.make_dummy().pack())
    struct.pack_into("<H", data, 4, SCHEMA_VERSION + 1)
    with pytest.raises(RecordVersionError, match=f"version {SCHEMA_VERSION + 1}") as info:
        Record.unpack(bytes(data))
    assert isinstance(info.value, ValueError)
    assert info.value.version == SCHEMA_VERSION + 1


def test_a_schema_1_record_is_still_read_as_drafted_by_the_draft_model() -> None:
    """Schema 2 added each step's proposer at the end of the body; a schema-1 record (written
    before it) reads with every step the draft model's."""
    record = Record.make_dummy(num_generated=12, m=4)
    v2 = record.pack()
    body = bytearray(v2[: -4 - record.num_steps])  # without step_proposers and the CRC
    struct.pack_into("<H", body, 4, 1)
    v1 = bytes(body) + struct.pack("<I", zlib.crc32(body))
    old = Record.unpack(v1)
    assert old.step_proposers.tolist() == [0] * record.num_steps
    assert old.model_steps.all()
    assert old.pack() == v2  # written back as schema 2


def test_bad_magic_raises_value_error() -> None:
    data = b"XXXX" + Record.make_dummy().pack()[4:]
    with pytest.raises(ValueError, match="magic"):
        Record.unpack(data)


@pytest.mark.parametrize("keep", [0, 3, 5, 6, 50, 200, -1])
def test_truncated_bytes_raise_value_error(keep: int) -> None:
    data = Record.make_dummy().pack()
    with pytest.raises(ValueError, match="truncated|CRC"):
        Record.unpack(data[:keep])


@pytest.mark.parametrize("position", [8, 40, 83, 100, 500, -3])
def test_garbled_byte_raises_value_error(position: int) -> None:
    data = bytearray(Record.make_dummy().pack())
    data[position] ^= 0x5A
    with pytest.raises(ValueError, match="CRC"):
        Record.unpack(bytes(data))


def test_extra_trailing_bytes_raise_value_error() -> None:
    with pytest.raises(ValueError):
        Record.unpack(Record.make_dummy().pack() + b"\0\0\0\0")


def _replace(**changes: Any) -> Record:
    return dataclasses.replace(Record.make_dummy(num_generated=8, m=4, prompt_len=3), **changes)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"request_id": ""}, "request_id must not be empty"),
        ({"request_id": "x" * (MAX_ID_BYTES + 1)}, "request_id must be a printable identifier"),
        ({"domain": "line one\nline two"}, "domain must be a printable identifier"),
        ({"adapter_name": 7}, "adapter_name must be a str"),
        ({"created_at": float("nan")}, "created_at must be finite"),
        ({"adapter_version": -1}, "adapter_version must be in"),
        ({"method": "greedy"}, "method must be one of"),
        ({"temperature": -0.5}, "temperature must be finite"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"top_p": 1.5}, "top_p must be finite and in"),
        ({"top_k": -2}, "top_k must be in"),
        ({"max_tokens": 0}, "max_tokens must be in"),
        ({"seed": 1.5}, "seed must be an int"),
        ({"num_spec_tokens": 0}, "num_spec_tokens must be in"),
        ({"num_drafts": True}, "num_drafts must be an int"),
        ({"prompt_len": 100}, "prompt_len 100 exceeds len"),
        ({"token_ids": np.array([[1, 2]])}, "token_ids must be 1-D"),
        ({"token_ids": np.array([1.0, 2.0])}, "token_ids must hold integers"),
        ({"token_ids": np.array([-1] * 11)}, "token_ids values must be in"),
        ({"num_accepted": np.zeros(50, np.int16)}, "num_accepted shape"),
        ({"num_drafted": np.array([70000])}, "num_drafted values must be in"),
        ({"draft_token_probs": np.zeros(3, np.float16)}, "draft_token_probs has length"),
        ({"target_top_ids": np.zeros((7, 4), np.int32)}, "target_top_ids .* must both have shape"),
        ({"target_top_probs": np.full((5, 4), 2.0)}, "target_top_probs must be probabilities"),
    ],
)
def test_invalid_field_raises_value_error_naming_it(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _replace(**changes)


def test_more_accepted_than_drafted_is_refused() -> None:
    record = Record.make_dummy()
    accepted = record.num_drafted.copy()
    accepted[0] += 1
    with pytest.raises(ValueError, match=r"num_accepted\[0\]"):
        dataclasses.replace(record, num_accepted=accepted)


def test_record_carries_no_text_fields() -> None:
    string_fields = {f.name for f in dataclasses.fields(Record) if f.type in ("str", "Method")}
    assert string_fields == {"request_id", "domain", "adapter_name", "method"}
    with pytest.raises(ValueError, match="records carry no text"):
        _replace(request_id="Please summarise the following document: " * 4)


def test_make_dummy_is_deterministic_and_consistent() -> None:
    a = Record.make_dummy(seed=3, num_generated=40, m=8, prompt_len=5)
    assert a == Record.make_dummy(seed=3, num_generated=40, m=8, prompt_len=5)
    assert a != Record.make_dummy(seed=4, num_generated=40, m=8, prompt_len=5)
    assert a.num_generated == 40 and a.top_m == 8
    assert np.array_equal(a.prompt_ids, a.token_ids[:5])
    assert np.array_equal(a.generated_ids, a.token_ids[5:])
    emitted = int(a.num_accepted.sum()) + a.num_steps
    assert emitted == a.num_generated
    assert a.cu_num_drafted[-1] == len(a.draft_token_probs)
    assert all(tok in row for tok, row in zip(a.generated_ids, a.target_top_ids, strict=True))
