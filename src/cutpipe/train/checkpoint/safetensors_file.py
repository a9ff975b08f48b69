"""The safetensors file format, written and read without the ``safetensors`` package.

The format is small (an 8-byte little-endian header length, a JSON header giving each tensor's
dtype, shape and byte range, then the raw little-endian bytes), so exporting a checkpoint needs
no extra package; ``read_safetensors`` reads a file back.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

import torch

from cutpipe.files import write_with

#: torch dtype -> safetensors dtype name
DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_TORCH_DTYPES = {name: dtype for dtype, name in DTYPES.items()}
_ALIGN = 8  # the header is padded with spaces so that the data starts 8-byte aligned


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    return flat.view(torch.uint8).numpy().tobytes()


def write_safetensors(
    tensors: dict[str, torch.Tensor],
    path: str | os.PathLike,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write ``tensors`` in the safetensors format, atomically. Tensors that share memory are
    written as separate copies."""
    if sys.byteorder != "little":
        raise RuntimeError(
            "writing safetensors needs a little-endian machine (it writes raw bytes)"
        )
    header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    blobs = []
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in DTYPES:
            raise TypeError(
                f"{name} has dtype {tensor.dtype}, which safetensors cannot hold: convert it to one "
                f"of {', '.join(str(d).removeprefix('torch.') for d in DTYPES)}, or export to .pt"
            )
        blob = _raw_bytes(tensor)
        header[name] = {
            "dtype": DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % _ALIGN)

    def write(temporary: Path) -> None:
        with open(temporary, "wb") as file:
            file.write(struct.pack("<Q", len(text)))
            file.write(text)
            for blob in blobs:
                file.write(blob)

    target = Path(path)
    write_with(target, write)
    return target


def read_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, in the order the header lists them."""
    data = Path(path).read_bytes()
    if len(data) < 8:
        raise ValueError(f"{path} is not a safetensors file: it is shorter than its 8-byte header")
    (length,) = struct.unpack("<Q", data[:8])
    if 8 + length > len(data):
        raise ValueError(f"{path} is not a safetensors file: its header runs past the file's end")
    header = json.loads(data[8 : 8 + length])
    body = memoryview(data)[8 + length :]
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _TORCH_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: {name} has the unknown dtype {entry['dtype']}")
        start, end = entry["data_offsets"]
        shape = entry["shape"]
        if not 0 <= start <= end <= len(body):
            raise ValueError(f"{path}: {name}'s bytes {start}..{end} lie outside the file")
        expected = torch.empty(shape, dtype=dtype).nbytes
        if end - start != expected:
            raise ValueError(
                f"{path}: {name} has {end - start} bytes, but {entry['dtype']} {shape} needs "
                f"{expected}"
            )
        if start == end:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        raw = torch.frombuffer(bytearray(body[start:end]), dtype=torch.uint8)
        tensors[name] = raw.view(dtype).reshape(shape)
    return tensors
