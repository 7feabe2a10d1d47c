"""A minimal, fast reader of GGUF files (v2 and v3, little-endian): metadata, tensor directory,
and zero-copy views of each tensor's raw (quantized) bytes from a read-only memory map.

Owns: parsing the header, every metadata key/value (scalars, strings, arrays, arrays of arrays),
the tensor infos (name, ggml type, shape as the file writes it, offset, byte size) and the
alignment of the data section; `GgufFile.tensor_bytes(name)` hands out a tensor's bytes as a
uint8 view of the map, [rows, bytes_per_row], never a copy. Does not own dequantization, the
mapping of GGUF names to a model's parameters, or anything transformers builds from the metadata
(`gguf/metadata.py` does that).

Why beside gguf-py's `GGUFReader`: speed. `GGUFReader` builds numpy objects for every element of
every metadata array: 15-22 s on the embedded Gemma 3 270M file (262,144 tokens, their scores and
types) and 11.6 s on Qwen2.5-Coder-1.5B (151,936 tokens, 151,387 merges), where `read_gguf`
takes 0.15 s and 0.18 s (measured on the shared 2-core machine this was written on), nearly all
of it the string arrays. Numeric arrays are read with one `np.frombuffer` each, string arrays with
one tight loop over the map; tensor data is never touched until a view of it is read.

Layout (all little-endian): magic "GGUF", u32 version, u64 tensor count, u64 key/value count;
the key/values (string key, u32 value type, value); the tensor infos (string name, u32 n_dims,
u64 dims[n_dims] fastest-moving first, u32 ggml type, u64 offset from the data section); padding
to `general.alignment` (default 32); the data section. A string is a u64 byte length and UTF-8
bytes; an array is a u32 element type, a u64 count and the elements.

A file that is not GGUF, is big-endian, of another version, truncated or inconsistent raises
`ModelLoadError` with the reason (never an IndexError or struct.error).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ..errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS

# metadata value types (gguf.constants.GGUFValueType)
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
VALUE_TYPE_NAMES = ("UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "FLOAT32", "BOOL", "STRING", "ARRAY",
                    "UINT64", "INT64", "FLOAT64")
_SCALAR = {  # type -> (struct, numpy dtype)
    UINT8: (struct.Struct("<B"), np.dtype("<u1")), INT8: (struct.Struct("<b"), np.dtype("<i1")),
    UINT16: (struct.Struct("<H"), np.dtype("<u2")), INT16: (struct.Struct("<h"), np.dtype("<i2")),
    UINT32: (struct.Struct("<I"), np.dtype("<u4")), INT32: (struct.Struct("<i"), np.dtype("<i4")),
    FLOAT32: (struct.Struct("<f"), np.dtype("<f4")), BOOL: (struct.Struct("<?"), np.dtype("bool")),
    UINT64: (struct.Struct("<Q"), np.dtype("<u8")), INT64: (struct.Struct("<q"), np.dtype("<i8")),
    FLOAT64: (struct.Struct("<d"), np.dtype("<f8")),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HEADER = struct.Struct("<4sIQQ")
_U32_U64 = struct.Struct("<IQ")


def _quant_sizes() -> dict[int, tuple[str, int, int]]:
    """ggml type id -> (name, elements per block, bytes per block), from gguf-py's table."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return {int(t): (GGMLQuantizationType(t).name, block, size) for t, (block, size) in GGML_QUANT_SIZES.items()}


_QUANT_SIZES = _quant_sizes()


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor directory."""

    name: str
    ggml_type: int
    type_name: str  # "Q4_K", "F32", ...
    shape: tuple[int, ...]  # as in the file: shape[0] is the contiguous row length (ggml's ne[0])
    offset: int  # absolute, from the start of the file
    offset_in_data: int  # as the file states it: from the start of the (aligned) data section
    nbytes: int
    block_size: int  # elements per quantization block (1 for plain types)
    type_size: int  # bytes per block

    @property
    def rows(self) -> int:
        """Product of the dims after the first (1 for a vector)."""
        rows = 1
        for dim in self.shape[1:]:
            rows *= dim
        return rows

    @property
    def bytes_per_row(self) -> int:
        return self.shape[0] // self.block_size * self.type_size

    @property
    def n_elements(self) -> int:
        return self.shape[0] * self.rows


class _Corrupt(Exception):
    """Internal: a structural problem, turned into a ModelLoadError with the file's name."""


class GgufFile:
    """A parsed GGUF file, memory-mapped read-only.

    metadata: {key: value} in file order. Scalars are Python int/float/bool, strings str, arrays
    of numbers 1-D numpy arrays (little-endian dtypes of the file's element type, copied out of
    the map), arrays of strings lists of str, arrays of arrays lists of those.
    value_types: {key: (type,) or (ARRAY, element type[, ...])} as the file declares them.
    tensors: {name: TensorInfo} in file order.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as handle:
                self.file_size = os.fstat(handle.fileno()).st_size
                if self.file_size < _HEADER.size:
                    raise ModelLoadError(f"{self.path} is not a GGUF file: {self.file_size} bytes, shorter "
                                         f"than a GGUF header (truncated?)")
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as error:
            raise ModelLoadError(f"cannot read GGUF file {self.path}: {error}") from error
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        try:
            self._parse()
        except ModelLoadError:
            raise
        except (_Corrupt, struct.error, IndexError, ValueError, OverflowError, MemoryError, RecursionError) as error:
            # UnicodeDecodeError is a ValueError; RecursionError: arrays nested thousands deep
            raise ModelLoadError(f"{self.path} is not a readable GGUF file (corrupt or truncated?): {error}") from None

    # -- parsing -----------------------------------------------------------------------------
    def _parse(self) -> None:
        buf, size = self._map, self.file_size
        magic, version, n_tensors, n_kv = _HEADER.unpack_from(buf, 0)
        if magic != GGUF_MAGIC:
            raise ModelLoadError(f"{self.path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
        if version not in SUPPORTED_VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if version & 0xFFFF == 0 and swapped in (1, 2, 3):
                raise ModelLoadError(f"{self.path} is a big-endian GGUF file (v{swapped}); only little-endian "
                                     f"GGUF files are supported")
            raise ModelLoadError(f"{self.path} is GGUF version {version}; only versions "
                                 f"{' and '.join(map(str, SUPPORTED_VERSIONS))} are supported")
        self.version = version
        pos = _HEADER.size
        # every key/value takes at least 8 + 4 + 1 bytes, every tensor info at least 8 + 4 + 8 + 4 + 8
        if n_kv * 13 > size - pos or n_tensors * 32 > size - pos:
            raise _Corrupt(f"header counts {n_kv} key/values and {n_tensors} tensors, more than the file can hold")
        metadata: dict[str, Any] = {}
        types: dict[str, tuple[int, ...]] = {}
        spans: dict[str, tuple[int, int]] = {}
        for _ in range(n_kv):
            start = pos
            key, pos = self._string(pos)
            (value_type,) = _U32.unpack_from(buf, pos)
            try:
                value, vtypes, pos = self._value(pos + 4, value_type)
            except (_Corrupt, struct.error, ValueError, OverflowError, MemoryError, RecursionError) as error:
                raise _Corrupt(f"metadata key {key!r}: {error}") from None
            metadata[key] = value
            types[key] = vtypes
            spans[key] = (start, pos)
        self.metadata = metadata
        self.value_types = types
        self._spans = spans

        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if (not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0
                or alignment & (alignment - 1)):
            raise _Corrupt(f"general.alignment is {alignment!r}, not a positive power of two")
        self.alignment = alignment

        infos = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            (n_dims,) = _U32.unpack_from(buf, pos)
            pos += 4
            if not 1 <= n_dims <= MAX_DIMS:
                raise _Corrupt(f"tensor {name!r} has {n_dims} dimensions (1..{MAX_DIMS} allowed)")
            shape = struct.unpack_from(f"<{n_dims}Q", buf, pos)
            pos += 8 * n_dims
            ggml_type, offset = _U32_U64.unpack_from(buf, pos)
            pos += 12
            infos.append((name, ggml_type, shape, offset))
        self.data_offset = -(-pos // alignment) * alignment  # the data section starts at the next boundary

        tensors: dict[str, TensorInfo] = {}
        for name, ggml_type, shape, offset in infos:
            if name in tensors:
                raise _Corrupt(f"tensor {name!r} is listed twice")
            if ggml_type not in _QUANT_SIZES:
                raise ModelLoadError(f"{self.path}: tensor {name!r} has ggml type {ggml_type}, unknown to gguf-py "
                                     f"{_gguf_version()}")
            type_name, block, type_size = _QUANT_SIZES[ggml_type]
            if shape[0] % block:
                raise _Corrupt(f"tensor {name!r} ({type_name}) has rows of {shape[0]} elements, not a multiple "
                               f"of its block size {block}")
            if offset % alignment:
                raise _Corrupt(f"tensor {name!r} starts at data offset {offset}, not a multiple of the "
                               f"alignment {alignment}")
            rows = 1
            for dim in shape[1:]:
                rows *= dim
            nbytes = rows * (shape[0] // block * type_size)
            info = TensorInfo(name, ggml_type, type_name, tuple(shape), self.data_offset + offset, offset, nbytes,
                              block, type_size)
            if info.offset + nbytes > size:
                raise ModelLoadError(f"{self.path} is truncated: tensor {name!r} ends at byte {info.offset + nbytes}, "
                                     f"past the end of the file ({size} bytes)")
            tensors[name] = info
        self.tensors = tensors

    def _string(self, pos: int) -> tuple[str, int]:
        (length,) = _U64.unpack_from(self._map, pos)
        end = pos + 8 + length
        if end > self.file_size:
            raise _Corrupt(f"a string of {length} bytes at byte {pos} runs past the end of the file")
        return str(self._map[pos + 8:end], "utf-8"), end

    def _value(self, pos: int, value_type: int) -> tuple[Any, tuple[int, ...], int]:
        """(value, its declared types, the position after it)."""
        scalar = _SCALAR.get(value_type)
        if scalar is not None:
            (value,) = scalar[0].unpack_from(self._map, pos)
            return value, (value_type,), pos + scalar[0].size
        if value_type == STRING:
            value, pos = self._string(pos)
            return value, (STRING,), pos
        if value_type != ARRAY:
            raise _Corrupt(f"unknown metadata value type {value_type}")
        element_type, count = _U32_U64.unpack_from(self._map, pos)
        pos += 12
        remaining = self.file_size - pos
        scalar = _SCALAR.get(element_type)
        if scalar is not None:
            nbytes = count * scalar[1].itemsize
            if nbytes > remaining:
                raise _Corrupt(f"an array of {count} {VALUE_TYPE_NAMES[element_type]} runs past the end of the file")
            array = np.frombuffer(self._map, dtype=scalar[1], count=count, offset=pos).copy()
            return array, (ARRAY, element_type), pos + nbytes
        if element_type == STRING:
            if count * 8 > remaining:
                raise _Corrupt(f"an array of {count} strings runs past the end of the file")
            values, pos = self._strings(pos, count)
            return values, (ARRAY, STRING), pos
        if element_type == ARRAY:
            if count * 12 > remaining:
                raise _Corrupt(f"an array of {count} arrays runs past the end of the file")
            values, inner = [], (ARRAY, UINT8)
            for _ in range(count):
                value, inner, pos = self._value(pos, ARRAY)
                values.append(value)
            return values, (ARRAY, *inner), pos
        raise _Corrupt(f"unknown array element type {element_type}")

    def _strings(self, pos: int, count: int) -> tuple[list[str], int]:
        """`count` strings from `pos`: the hot loop for a vocabulary (262,144 tokens in ~0.1 s)."""
        buf, unpack = self._map, _U64.unpack_from
        raw = [b""] * count
        for i in range(count):
            (length,) = unpack(buf, pos)
            pos += 8
            raw[i] = buf[pos:pos + length]  # a short slice at the end of the map is caught below
            pos += length
        if pos > self.file_size:
            raise _Corrupt(f"an array of {count} strings runs past the end of the file")
        return [str(item, "utf-8") for item in raw], pos

    # -- access --------------------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def raw_record(self, key: str) -> bytes:
        """The bytes of metadata key/value `key` as the file stores them (key, type, value)."""
        start, end = self._spans[key]
        return self._map[start:end]

    def __getitem__(self, key: str) -> Any:
        return self.metadata[key]

    def __contains__(self, key: str) -> bool:
        return key in self.metadata

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The raw bytes of tensor `name` as a read-only uint8 view of the map (no copy),
        shaped [rows, bytes_per_row] (rows: the product of the dims after the first)."""
        try:
            info = self.tensors[name]
        except KeyError:
            raise KeyError(f"{self.path.name} has no tensor {name!r}") from None
        if self._bytes is None:
            raise ValueError(f"{self.path.name} is closed")
        view = self._bytes[info.offset:info.offset + info.nbytes]
        return view.reshape(info.rows, info.bytes_per_row)

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors.values())

    def close(self) -> None:
        """Drop this object's hold on the map. Views handed out by `tensor_bytes` keep the
        mapping alive (it is released when the last of them goes)."""
        self._bytes = None
        try:
            self._map.close()
        except BufferError:  # views still exported: the map closes when they are gone
            pass

    def __enter__(self) -> "GgufFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"GgufFile({str(self.path)!r}, v{self.version}, {len(self.metadata)} keys, "
                f"{len(self.tensors)} tensors, architecture={self.architecture!r})")


def _gguf_version() -> str:
    try:
        from importlib.metadata import version

        return version("gguf")
    except Exception:  # noqa: BLE001 - only for a message
        return ""


def read_gguf(path: str | os.PathLike) -> GgufFile:
    """Parse `path` (see `GgufFile`)."""
    return GgufFile(path)
