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


class SafetensorsReader:
  """Memory-mapped read access to one .safetensors file."""

  def __init__(self, path: str):
    self.path = path
    with open(path, "rb") as f:
      (n,) = struct.unpack("<Q", f.read(8))
      header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    self.header = header
    self._data_start = 8 + n
    self._mmap = np.memmap(path, dtype=np.uint8, mode="r")

  def keys(self) -> list[str]:
    return list(self.header)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self.header[name]["shape"])

  def tensor(self, name: str) -> np.ndarray:
    """Zero-copy read-only view of tensor `name`."""
    info = self.header[name]
    if info["dtype"] not in DTYPES:
      raise ValueError(
        f"{self.path}: tensor {name} has unsupported dtype {info['dtype']!r}; "
        f"allowed: {sorted(DTYPES)}"
      )
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
