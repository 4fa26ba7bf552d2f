"""A strict reader for the .npy arrays clients send inline (uint8, T×H×W×3), without `ast`.

`np.load` parses the header with `ast.literal_eval`, and CPython 3.11's AST constructor keeps a
recursion-depth counter that is not thread-safe: decoding episodes in several worker threads at
once occasionally failed with "SystemError: AST constructor recursion depth mismatch". The
header is a tiny dict literal; reading it with three regular expressions is exact for what
numpy writes, refuses everything else, and lets the data be viewed without a copy.
"""

from __future__ import annotations

import math
import re

import numpy as np

MAGIC = b"\x93NUMPY"
_DESCR = re.compile(r"""['"]descr['"]\s*:\s*['"]([^'"]*)['"]""")
_FORTRAN = re.compile(r"""['"]fortran_order['"]\s*:\s*(True|False)""")
_SHAPE = re.compile(r"""['"]shape['"]\s*:\s*\(([^)]*)\)""")
UINT8_DESCRS = frozenset({"|u1", "u1", "<u1", ">u1", "=u1"})


class NpyError(ValueError):
    pass


def read_header(raw: bytes) -> tuple[str, bool, tuple[int, ...], int]:
    """(descr, fortran_order, shape, data offset) of a .npy file's bytes."""
    if raw[:6] != MAGIC or len(raw) < 10:
        raise NpyError("no .npy magic")
    major = raw[6]
    if major == 1:
        length, start = int.from_bytes(raw[8:10], "little"), 10
    elif major in (2, 3):
        length, start = int.from_bytes(raw[8:12], "little"), 12
    else:
        raise NpyError(f"unknown .npy version {major}")
    header = raw[start:start + length].decode("latin-1")
    descr, fortran, shape = _DESCR.search(header), _FORTRAN.search(header), _SHAPE.search(header)
    if not (descr and fortran and shape):
        raise NpyError("malformed .npy header")
    dims = [d.strip() for d in shape.group(1).split(",") if d.strip()]
    if not all(d.isdigit() for d in dims):
        raise NpyError(f"malformed shape ({shape.group(1)})")
    return descr.group(1), fortran.group(1) == "True", tuple(int(d) for d in dims), start + length


def read_uint8(raw: bytes) -> np.ndarray:
    """The array in `raw`, which must be uint8; a read-only view of `raw`, no copy (C order)."""
    descr, fortran, shape, offset = read_header(raw)
    if descr not in UINT8_DESCRS:
        raise NpyError(f"dtype {descr!r} is not uint8")
    count = math.prod(shape)
    if len(raw) - offset < count:
        raise NpyError(f"data holds {len(raw) - offset} bytes, the shape needs {count} (truncated)")
    array = np.frombuffer(raw, dtype=np.uint8, count=count, offset=offset)
    return np.ascontiguousarray(array.reshape(shape, order="F")) if fortran else array.reshape(shape)
