"""Binary wire format of `osd.buffer.record.Record`: versioned, compact, checksummed, never pickled.

Pure (numpy and the standard library only). Layout of schema version 2, all little-endian::

    header  84 bytes: magic b"OSDR", uint16 version, uint16 flags, the scalar fields,
            counts (tokens, steps, m), method code and the byte lengths of the identifiers
    strings request_id, domain, adapter_name (utf-8), zero-padded to a multiple of 4 bytes
    arrays  token_ids int32 (T,) | target_top_ids int32 (G, m) | num_drafted int16 (S,) |
            num_accepted int16 (S,) | draft_token_probs float16 (D,) |
            target_top_probs float16 (G, m) | step_proposers uint8 (S,)
    trailer uint32 CRC-32 of everything before it

Schema 1 is the same without ``step_proposers`` (each step's proposer as its index in
``osd.decode.methods.PROPOSERS``); it is still read, as every step the draft model's.

with T tokens, G = T - prompt_len generated positions, S steps and D = sum(num_drafted). The
padding keeps every array naturally aligned for `np.frombuffer`.

The magic and version are read first, so a record from a newer writer fails with
`RecordVersionError` (a `ValueError`) before anything else is interpreted; the CRC then catches
truncated or garbled bytes. zlib is not used: on dummy 256-token, m = 32 records level 1 saves
22-36% (more for small vocabularies: mostly the zero high bytes of int32 ids) but costs ~1 ms of
CPU per record against ~20 us to pack, and the stream is bounded by entry count, not bytes;
bench/bench_log_buffer.py prints both.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

# The method's index in METHODS is on the wire (append only: osd.decode.methods).
from osd.decode.methods import METHODS, PROPOSERS, Method

__all__ = [
    "MAGIC",
    "METHODS",
    "PROPOSERS",
    "Method",
    "SCHEMA_VERSION",
    "RecordVersionError",
    "pack_fields",
    "unpack_fields",
]

MAGIC = b"OSDR"
SCHEMA_VERSION = 2
# Versions this reader reads: 1 has no per-step proposers (every step was the draft model's).
READABLE_VERSIONS = (1, 2)

_PREFIX = struct.Struct("<4sH")
_HEADER = struct.Struct("<4sHHdqddqiiiiiIII4B")
_TRAILER = struct.Struct("<I")
_FLAG_HAS_SEED = 1


class RecordVersionError(ValueError):
    """The bytes are a record of a schema version this code cannot read (e.g. a newer writer's).

    Attributes:
        version: the schema version found in the header.
    """

    def __init__(self, version: int) -> None:
        super().__init__(
            f"record schema version {version} is not supported (this reader knows {SCHEMA_VERSION})"
        )
        self.version = version


class _Header(NamedTuple):
    """Fields of _HEADER, in order."""

    magic: bytes
    version: int
    flags: int
    created_at: float
    adapter_version: int
    temperature: float
    top_p: float
    seed: int
    top_k: int
    max_tokens: int
    num_spec_tokens: int
    num_drafts: int
    prompt_len: int
    num_tokens: int
    num_steps: int
    m: int
    method_code: int
    request_id_len: int
    domain_len: int
    adapter_name_len: int


class _Reader:
    """Walks the body of a packed record (between header and trailer), refusing to overrun it."""

    def __init__(self, data: bytes, offset: int) -> None:
        self.data = data
        self.start = offset
        self.offset = offset
        self.end = len(data) - _TRAILER.size

    def _advance(self, num_bytes: int) -> int:
        begin, self.offset = self.offset, self.offset + num_bytes
        if self.offset > self.end:
            raise ValueError(f"record truncated: needs {self.offset} body bytes, has {self.end}")
        return begin

    def take_bytes(self, num_bytes: int) -> bytes:
        begin = self._advance(num_bytes)
        return self.data[begin : self.offset]

    def align4(self) -> None:
        self._advance(-(self.offset - self.start) % 4)

    def take(self, dtype: type[np.generic], count: int) -> npt.NDArray[Any]:
        begin = self._advance(count * np.dtype(dtype).itemsize)
        return np.frombuffer(self.data, dtype=dtype, count=count, offset=begin)

    def expect_end(self) -> None:
        if self.offset != self.end:
            raise ValueError(f"record has {self.end - self.offset} unexpected trailing bytes")


def _pad4(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % 4)


def pack_fields(record: Mapping[str, Any]) -> bytes:
    """Packs a validated record's fields (name -> value, as `unpack_fields` returns them) into
    schema version 2 bytes. Fields, not the `Record` itself: the record imports this module."""
    strings = [
        s.encode("utf-8") for s in (record["request_id"], record["domain"], record["adapter_name"])
    ]
    header = _HEADER.pack(
        MAGIC,
        SCHEMA_VERSION,
        _FLAG_HAS_SEED if record["seed"] is not None else 0,
        float(record["created_at"]),
        int(record["adapter_version"]),
        float(record["temperature"]),
        float(record["top_p"]),
        0 if record["seed"] is None else int(record["seed"]),
        int(record["top_k"]),
        int(record["max_tokens"]),
        int(record["num_spec_tokens"]),
        int(record["num_drafts"]),
        int(record["prompt_len"]),
        len(record["token_ids"]),
        len(record["num_drafted"]),
        record["target_top_ids"].shape[1],
        METHODS.index(record["method"]),
        *(len(s) for s in strings),
    )
    body = b"".join(
        [
            header,
            _pad4(b"".join(strings)),
            record["token_ids"].tobytes(),
            record["target_top_ids"].tobytes(),
            record["num_drafted"].tobytes(),
            record["num_accepted"].tobytes(),
            record["draft_token_probs"].tobytes(),
            record["target_top_probs"].tobytes(),
            record["step_proposers"].tobytes(),
        ]
    )
    return body + _TRAILER.pack(zlib.crc32(body))


def unpack_fields(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Decodes bytes made by `pack_fields` into `Record` constructor arguments.

    Arrays are read-only views into `data` (the Record constructor copies them).

    Raises:
        RecordVersionError: the magic is right but the schema version is not this one.
        ValueError: anything else: bad magic, truncated, garbled (CRC mismatch), bad counts.
    """
    data = bytes(data)
    if len(data) < _PREFIX.size:
        raise ValueError(f"record truncated: {len(data)} bytes is shorter than any header")
    magic, version = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise ValueError(f"not a record: magic {magic!r}, expected {MAGIC!r}")
    if version not in READABLE_VERSIONS:
        raise RecordVersionError(version)
    if len(data) < _HEADER.size + _TRAILER.size:
        raise ValueError(f"record truncated: {len(data)} bytes is shorter than the header")
    (crc,) = _TRAILER.unpack_from(data, len(data) - _TRAILER.size)
    if zlib.crc32(memoryview(data)[: -_TRAILER.size]) != crc:
        raise ValueError(f"record garbled or truncated: CRC mismatch over {len(data)} bytes")
    return _decode_body(data)


def _decode_body(data: bytes) -> dict[str, Any]:
    h = _Header._make(_HEADER.unpack_from(data))
    if h.method_code >= len(METHODS):
        raise ValueError(f"record has unknown method code {h.method_code}")
    num_generated = h.num_tokens - h.prompt_len
    if num_generated < 0:
        raise ValueError(f"record has prompt_len {h.prompt_len} > num_tokens {h.num_tokens}")
    reader = _Reader(data, _HEADER.size)
    request_id, domain, adapter_name = (
        reader.take_bytes(n).decode("utf-8")
        for n in (h.request_id_len, h.domain_len, h.adapter_name_len)
    )
    reader.align4()
    token_ids = reader.take(np.int32, h.num_tokens)
    top_ids = reader.take(np.int32, num_generated * h.m).reshape(num_generated, h.m)
    num_drafted = reader.take(np.int16, h.num_steps)
    num_accepted = reader.take(np.int16, h.num_steps)
    if np.any(num_drafted < 0):
        raise ValueError("record has negative num_drafted")
    draft_token_probs = reader.take(np.float16, int(num_drafted.sum(dtype=np.int64)))
    top_probs = reader.take(np.float16, num_generated * h.m).reshape(num_generated, h.m)
    if h.version >= 2:
        step_proposers = reader.take(np.uint8, h.num_steps)
        if np.any(step_proposers >= len(PROPOSERS)):
            raise ValueError("record has an unknown proposer code")
    else:  # schema 1: the draft model drafted every step
        step_proposers = np.zeros(h.num_steps, dtype=np.uint8)
    reader.expect_end()
    return {
        "request_id": request_id,
        "created_at": h.created_at,
        "domain": domain,
        "adapter_name": adapter_name,
        "adapter_version": h.adapter_version,
        "method": METHODS[h.method_code],
        "temperature": h.temperature,
        "top_p": h.top_p,
        "top_k": h.top_k,
        "max_tokens": h.max_tokens,
        "seed": h.seed if h.flags & _FLAG_HAS_SEED else None,
        "num_spec_tokens": h.num_spec_tokens,
        "num_drafts": h.num_drafts,
        "prompt_len": h.prompt_len,
        "token_ids": token_ids,
        "num_drafted": num_drafted,
        "num_accepted": num_accepted,
        "draft_token_probs": draft_token_probs,
        "target_top_ids": top_ids,
        "target_top_probs": top_probs,
        "step_proposers": step_proposers,
    }
