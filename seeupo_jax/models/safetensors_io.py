"""Minimal streaming reader/writer of the safetensors format.

Reading memory-maps the file and returns zero-copy NumPy views per tensor (so
a loader can slice one device shard out of a tensor without reading the
rest). Writing streams tensor by tensor, so at most one tensor is on the host
at a time. bfloat16 goes through `ml_dtypes` (the `safetensors` package's
NumPy API has no bfloat16).

Format: u64 little-endian header length N, N bytes of JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
then the raw little-endian tensor bytes; offsets are relative to the data start.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Callable, Iterable, Sequence

import ml_dtypes
import numpy as np

DTYPES = {
  "F64": np.dtype(np.float64),
  "F32": np.dtype(np.float32),
  "F16": np.dtype(np.float16),
  "BF16": np.dtype(ml_dtypes.bfloat16),
  "I64": np.dtype(np.int64),
  "I32": np.dtype(np.int32),
  "I16": np.dtype(np.int16),
  "I8": np.dtype(np.int8),
  "U8": np.dtype(np.uint8),
  "BOOL": np.dtype(np.bool_),
}
NAMES = {v: k for k, v in DTYPES.items()}


class SafetensorsError(ValueError):
  """A .safetensors file that is not a valid one (truncated, a bad header); the message names
  the file and, where one is at fault, the tensor."""


_HEADER_LIMIT = 100 * 2**20  # the format's own limit on the JSON header


def _check_entry(path: str, name: str, info, data_size: int) -> None:
  """Raises SafetensorsError unless header entry `info` of tensor `name` is well-formed, its
  byte size matches dtype x shape and its bytes lie inside the file's data section."""

  def bad(message):
    raise SafetensorsError(f"{path}: tensor {name!r} {message}")

  if not isinstance(info, dict):
    bad(f"has a header entry {info!r}, not an object with dtype, shape and data_offsets")
  dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
  if dtype not in DTYPES:
    bad(f"has unsupported dtype {dtype!r}; allowed: {sorted(DTYPES)}")
  if not isinstance(shape, list) or not all(
    isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
  ):
    bad(f"has shape {shape!r}, not a list of ints >= 0")
  if not (
    isinstance(offsets, list)
    and len(offsets) == 2
    and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    and 0 <= offsets[0] <= offsets[1]
  ):
    bad(f"has data_offsets {offsets!r}, not [begin, end] with 0 <= begin <= end")
  begin, end = offsets
  nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
  if end - begin != nbytes:
    bad(
      f"is {dtype}{shape} ({nbytes} bytes) but its data_offsets [{begin}, {end}] span "
      f"{end - begin} bytes"
    )
  if end > data_size:
    bad(
      f"needs bytes [{begin}, {end}) of the data section, which holds only {data_size} bytes "
      "(the file is truncated?)"
    )


class SafetensorsReader:
  """Memory-mapped read access to one .safetensors file.

  The header is checked when the file is opened: the header length against the file's size,
  and every tensor's dtype, shape and offsets against each other and the data section, so a
  truncated or corrupt file is a `SafetensorsError` naming it (and the tensor), never a
  reshape error when a tensor is read.
  """

  def __init__(self, path: str):
    self.path = path
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      prefix = f.read(8)
      if len(prefix) < 8:
        raise SafetensorsError(f"{path}: {size} bytes, too short for a safetensors header")
      (n,) = struct.unpack("<Q", prefix)
      if n > min(_HEADER_LIMIT, size - 8):
        raise SafetensorsError(
          f"{path}: the header claims {n} bytes but the file holds {size} (truncated, or not a "
          "safetensors file?)"
        )
      try:
        header = json.loads(f.read(n))
      except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{path}: the header is not JSON ({e})") from None
    if not isinstance(header, dict):
      raise SafetensorsError(f"{path}: the header is {type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    self._data_start = 8 + n
    data_size = size - self._data_start
    for name, info in header.items():
      _check_entry(path, name, info, data_size)
    self.header = header
    self._mmap = np.memmap(path, dtype=np.uint8, mode="r")

  def keys(self) -> list[str]:
    return list(self.header)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self.header[name]["shape"])

  def tensor(self, name: str) -> np.ndarray:
    """Zero-copy read-only view of tensor `name`."""
    info = self.header[name]
    begin, end = info["data_offsets"]
    raw = self._mmap[self._data_start + begin : self._data_start + end]
    return raw.view(DTYPES[info["dtype"]]).reshape(info["shape"])


def write_file(
  path: str,
  entries: Sequence[tuple[str, tuple[int, ...], np.dtype]],
  fetch: Callable[[str], np.ndarray],
  metadata: dict | None = None,
) -> None:
  """Writes a safetensors file, fetching and writing one tensor at a time.

  Args:
    path: output file.
    entries: (name, shape, dtype) of each tensor, in file order.
    fetch: name -> np.ndarray of that shape and dtype (called once per name).
    metadata: string-to-string `__metadata__`.
  """
  header, offset = {}, 0
  for name, shape, dtype in entries:
    size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    header[name] = {
      "dtype": NAMES[np.dtype(dtype)],
      "shape": list(shape),
      "data_offsets": [offset, offset + size],
    }
    offset += size
  if metadata:
    header["__metadata__"] = dict(metadata)
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for name, shape, dtype in entries:
      array = np.ascontiguousarray(fetch(name))
      if array.shape != tuple(shape) or array.dtype != np.dtype(dtype):
        raise ValueError(
          f"tensor {name}: fetched {array.shape} {array.dtype}, "
          f"declared {tuple(shape)} {np.dtype(dtype)}"
        )
      f.write(array.reshape(-1).view(np.uint8).data if array.size else b"")


def shard_entries(
  entries: Iterable[tuple[str, tuple[int, ...], np.dtype]], max_shard_bytes: int
) -> list[list[tuple[str, tuple[int, ...], np.dtype]]]:
  """Greedy split of `entries`, in order, into groups of at most max_shard_bytes (a bigger
  tensor gets a group of its own)."""
  groups, current, size = [], [], 0
  for entry in entries:
    nbytes = int(np.prod(entry[1], dtype=np.int64)) * np.dtype(entry[2]).itemsize
    if current and size + nbytes > max_shard_bytes:
      groups.append(current)
      current, size = [], 0
    current.append(entry)
    size += nbytes
  if current:
    groups.append(current)
  return groups
