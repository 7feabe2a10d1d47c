"""Matrix products on a GGUF file's own quantized blocks: y = x W^T with W read as the file stores it.

Owns the ctypes wrapper of `kernels/qmatmul.c` (compiled into the same per-instruction-set library
as the other kernels, by `blockmm`: same variants, same `VERISPEC_KERNEL_ISA` override): a weight is
a `QMatrix`, a zero-copy uint8 view of a tensor's bytes (a slice of the memory-mapped file) with its
ggml type (F32, F16, BF16, Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K) and shape [N outputs, K inputs]; the
kernels multiply by those blocks directly (4.5-6.6 bits per weight for the K-quants instead of the
~10 bits of the int8 block form in `gguf.blocks`), and `get_rows` dequantizes rows of one (an
embedding lookup) exactly as gguf-py's `dequantize` does.

Why hand-written instead of ggml's kernels: the numerics must be batch-invariant and exact. Every
row of activations is quantized from that row alone: per block of 32 for the 32-block types
(blockmm_int8.c's int8 numerics), per super-block of 256 for the K-quants (as ggml's Q8_K); the
integer sums are exact (for the K-quants scaled by the sub-block scales in the integer domain), and
one fixed sequence of float32 operations per (row, output) turns them into the result (see
qmatmul.c's header), so a token's output does not depend on how many rows share the call, on the
thread count or on the instruction set; for Q8_0 and Q5_0 it equals bit for bit what the int8 block
form (`blockmm`, numerics "int8") computes. ggml's own kernels sum in another float order and
split sums across threads, so they could not give these bits.

Wide forwards (M >= `QKernel.tile_rows`, 32) take the AMX tile path in AMX builds (the "amx"
variant where the CPU and the kernel allow it, the "amx-emulated" test build anywhere): the same
bits by another route (kernels/qmatmul_amx.c).

Decoder layers that feed one input to several matrices (q, k, v; gate, up) quantize it once
(`QKernel.quantize` -> `Activations`) and call `QKernel.matmul(activations, w, out=...)` per matrix,
`out` possibly a column range of one [M, q + k + v] buffer (any row stride). `QKernel.functions`
gives the raw ctypes functions (with argtypes set) and `QMatrix.address` / `Activations.pointers`
the pointers, for code that calls the C entry points itself.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from . import blockmm

# ggml's type numbers -> (inputs per block, bytes per block)
TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "BF16": 30}
TYPE_NAMES = {number: name for name, number in TYPES.items()}
BLOCKS = {0: (1, 4), 1: (1, 2), 30: (1, 2), 2: (32, 18), 6: (32, 22), 8: (32, 34), 12: (256, 144), 13: (256, 176),
          14: (256, 210)}
FLOAT_TYPES = (0, 1, 30)  # x is used in float32, not quantized
K_QUANT_TYPES = (12, 13, 14)  # read activations in the super-block form (one scale per 256 inputs)


def type_number(type_: int | str) -> int:
    """ggml's number of a type given by number or name ("Q4_K"); ValueError for an unsupported one."""
    number = TYPES.get(type_.upper()) if isinstance(type_, str) else int(type_)
    if number not in BLOCKS:
        raise ValueError(f"unsupported GGUF weight type {type_!r} (supported: {', '.join(TYPES)})")
    return number


def row_bytes(type_: int | str, cols: int) -> int:
    """Bytes per row of a weight with `cols` inputs; ValueError where `cols` is not allowed (quantized
    types: a multiple of the block, 32 or 256; float types: a multiple of 8)."""
    number = type_number(type_)
    block, size = BLOCKS[number]
    multiple = 8 if number in FLOAT_TYPES else block
    if cols < 1 or cols % multiple:
        raise ValueError(f"{TYPE_NAMES[number]} weights need a number of inputs that is a multiple of {multiple} (got {cols})")
    return cols // block * size


@dataclass(frozen=True)
class QMatrix:
    """A weight [rows = N outputs, cols = K inputs] as the GGUF file stores it: `data` the raw bytes
    (uint8 numpy array or torch tensor, contiguous, N * row_bytes of them: a view of the memory map
    or of the resident copy, `runtime.resident`), `type` ggml's type number."""

    data: np.ndarray | torch.Tensor
    type: int
    rows: int
    cols: int

    def __post_init__(self):
        object.__setattr__(self, "type", type_number(self.type))
        size = row_bytes(self.type, self.cols)
        if self.rows < 1:
            raise ValueError(f"a weight needs at least one row (got {self.rows})")
        data = self.data
        if isinstance(data, torch.Tensor):
            ok = data.dtype == torch.uint8 and data.is_contiguous() and data.device.type == "cpu"
            count = data.numel()
        else:
            ok = isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.flags.c_contiguous
            count = data.size
        if not ok:
            raise ValueError("QMatrix.data must be a contiguous uint8 numpy array or CPU tensor of the raw bytes")
        if count != self.rows * size:
            raise ValueError(f"{TYPE_NAMES[self.type]} [{self.rows}, {self.cols}] takes {self.rows * size} bytes, got {count}")
        object.__setattr__(self, "_address", data.data_ptr() if isinstance(data, torch.Tensor) else data.ctypes.data)

    @property
    def type_name(self) -> str:
        return TYPE_NAMES[self.type]

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def nbytes(self) -> int:
        return self.rows * row_bytes(self.type, self.cols)

    @property
    def address(self) -> int:
        """The address of the first byte (valid while `data` lives)."""
        return self._address

    @staticmethod
    def from_gguf(tensor) -> "QMatrix":
        """The weight of a `gguf.GGUFReader` tensor (its memory-mapped bytes, not copied). A GGUF
        shape lists [K, N] (inputs first); a 1-D tensor is one row."""
        cols = int(tensor.shape[0])
        rows = int(np.prod([int(d) for d in tensor.shape[1:]])) if len(tensor.shape) > 1 else 1
        data = np.asarray(tensor.data)
        raw = data.view(np.uint8).reshape(-1)
        return QMatrix(raw, int(tensor.tensor_type), rows, cols)

    def dequantize(self, kernel: "QKernel | None" = None) -> torch.Tensor:
        """All rows as float32 [N, K] (as gguf-py's dequantize computes them)."""
        return get_rows(self, torch.arange(self.rows), kernel=kernel)


class Activations:
    """Rows x [M, K] float32, quantized for several products in the form each weight type reads, each
    form once, on first use (qmatmul.c's header): the block form (per 32 inputs, for the 32-block
    types; `qmm_quantize`) or the super-block form (per 256, for the K-quants; `qmm_quantize_super`).
    Each is one uint8 buffer: xq [M, K] int8, then xs and xo [M, K / 32] float32, then xsum
    [M, K / 16] int32. `x` itself is what float-typed weights read."""

    def __init__(self, quantize_functions, x: torch.Tensor, threads: int):
        self.x = x
        self._functions = quantize_functions  # {"block": qmm_quantize, "super": qmm_quantize_super}
        self._threads = threads
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def rows(self) -> int:
        return self.x.shape[0]

    @property
    def cols(self) -> int:
        return self.x.shape[1]

    def pointers(self, type_: int) -> tuple[int, int, int, int, int]:
        """(x, xq, xs, xo, xsum) addresses for a weight of ggml type `type_`, the first arguments of
        `qmm_matmul`."""
        m, k = self.rows, self.cols
        form = "super" if type_ in K_QUANT_TYPES else "block"  # K-quant weights have K a multiple of 256
        if form not in self._buffers:
            buffer = torch.empty(m * k + m * k // 32 * 8 + m * k // 16 * 4, dtype=torch.uint8)
            base = buffer.data_ptr()
            if self._functions[form](self.x.data_ptr(), m, k, *self._addresses(base), self._threads) != 0:
                raise RuntimeError(f"quantizing activations refused its arguments (M={m}, K={k}, {form} form)")
            self._buffers[form] = buffer
        return (self.x.data_ptr(), *self._addresses(self._buffers[form].data_ptr()))

    def _addresses(self, base: int) -> tuple[int, int, int, int]:
        m, k = self.rows, self.cols
        return base, base + m * k, base + m * k + m * k // 32 * 4, base + m * k + m * k // 32 * 8  # xq, xs, xo, xsum


class QKernel:
    """qmatmul.c's functions in one loaded kernel library (`blockmm.Kernel`)."""

    def __init__(self, kernel: blockmm.Kernel):
        self.kernel = kernel
        self.isa = kernel.isa
        library = kernel.library
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        functions = {
            # type, K -> bytes per row or -1
            "qmm_row_bytes": (size, [ctypes.c_int, size]),
            # x, M, K, xq, xs, xo, xsum, threads
            "qmm_quantize": (ctypes.c_int, [pointer, size, size, pointer, pointer, pointer, pointer, ctypes.c_int]),
            "qmm_quantize_super": (ctypes.c_int, [pointer, size, size, pointer, pointer, pointer, pointer, ctypes.c_int]),
            # x, xq, xs, xo, xsum, M, K, w, type, N, y, ldy, threads
            "qmm_matmul": (ctypes.c_int, [pointer, pointer, pointer, pointer, pointer, size, size, pointer, ctypes.c_int,
                                          size, pointer, size, ctypes.c_int]),
            # x, M, K, w, type, N, y, ldy, threads
            "qmm_matmul_f32": (ctypes.c_int, [pointer, size, size, pointer, ctypes.c_int, size, pointer, size, ctypes.c_int]),
            # w, type, N, K, ids, count, out
            "qmm_get_rows": (ctypes.c_int, [pointer, ctypes.c_int, size, size, pointer, size, pointer]),
            "qmm_isa": (ctypes.c_char_p, []),
        }
        self.functions = {}
        for name, (restype, argtypes) in functions.items():
            function = getattr(library, name)
            function.restype, function.argtypes = restype, argtypes
            self.functions[name] = function
        self.compiled_isa = self.functions["qmm_isa"]().decode()
        # the M from which quantized products take the AMX tile path (real or emulated), 0 without it
        self.tile_rows = 0
        if hasattr(library, "qmm_tile_rows"):
            library.qmm_tile_rows.restype = ctypes.c_int
            self.tile_rows = library.qmm_tile_rows()

    @staticmethod
    def _threads(threads: int | None) -> int:
        return torch.get_num_threads() if threads is None else max(1, int(threads))

    @staticmethod
    def _rows(x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 2 or x.device.type != "cpu":
            raise ValueError("x must be a CPU float32 tensor [M, K]")
        if x.shape[0] < 1:
            raise ValueError("x needs at least one row")
        return x.contiguous()

    def quantize(self, x: torch.Tensor, threads: int | None = None) -> Activations:
        """x [M, K] float32 (K a multiple of 32) for several `matmul` calls, quantized on first use in
        each form the weights read (each form once)."""
        x = self._rows(x)
        k = x.shape[1]
        if k % 32:
            raise ValueError(f"activations are quantized per block of 32: K = {k} is not a multiple of 32")
        functions = {"block": self.functions["qmm_quantize"], "super": self.functions["qmm_quantize_super"]}
        return Activations(functions, x, self._threads(threads))

    def matmul(self, x: torch.Tensor | Activations, w: QMatrix, out: torch.Tensor | None = None,
               threads: int | None = None) -> torch.Tensor:
        """x [M, K] (float32, or already quantized `Activations`) times `w` [N, K] -> [M, N] float32,
        written into `out` if given (a float32 [M, N] view with unit column stride and any row stride,
        e.g. a column range of a wider buffer)."""
        if not isinstance(w, QMatrix):
            raise ValueError("w must be a QMatrix")
        quantized = isinstance(x, Activations)
        rows = x.x if quantized else self._rows(x)
        m, k = rows.shape
        if k != w.cols:
            raise ValueError(f"x has {k} inputs per row but the weight [{w.rows}, {w.cols}] takes {w.cols}")
        if out is None:
            out = torch.empty(m, w.rows, dtype=torch.float32)
        elif (out.dtype != torch.float32 or out.dim() != 2 or tuple(out.shape) != (m, w.rows) or out.stride(1) != 1
              or out.stride(0) < w.rows or out.device.type != "cpu"):
            raise ValueError(f"out must be a CPU float32 [{m}, {w.rows}] view with unit column stride")
        threads = self._threads(threads)
        if quantized and w.type not in FLOAT_TYPES:
            status = self.functions["qmm_matmul"](*x.pointers(w.type), m, k, w.address, w.type, w.rows, out.data_ptr(),
                                                  out.stride(0), threads)
        else:  # float weights (x as is), or float x quantized inside the call
            status = self.functions["qmm_matmul_f32"](rows.data_ptr(), m, k, w.address, w.type, w.rows, out.data_ptr(),
                                                      out.stride(0), threads)
        if status != 0:
            raise RuntimeError(f"qmm_matmul refused its arguments (M={m}, K={k}, N={w.rows}, type {w.type_name})")
        return out

    def get_rows(self, w: QMatrix, ids) -> torch.Tensor:
        """Rows `ids` of `w` dequantized to float32 [len(ids), K], exactly as gguf-py's dequantize."""
        index = torch.as_tensor(ids, dtype=torch.int64).reshape(-1).contiguous()
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= w.rows):
            raise IndexError(f"row ids must lie in [0, {w.rows})")
        out = torch.empty(index.numel(), w.cols, dtype=torch.float32)
        status = self.functions["qmm_get_rows"](w.address, w.type, w.rows, w.cols, index.data_ptr(), index.numel(),
                                                out.data_ptr())
        if status != 0:
            raise RuntimeError(f"qmm_get_rows refused its arguments ({w.type_name} [{w.rows}, {w.cols}])")
        return out


_kernels: dict[int, QKernel] = {}


def wrap(kernel: blockmm.Kernel) -> QKernel:
    """The QKernel of a loaded `blockmm.Kernel` (cached per library)."""
    key = id(kernel)
    if key not in _kernels:
        _kernels[key] = QKernel(kernel)
    return _kernels[key]


def kernel() -> tuple[QKernel | None, str | None]:
    """(the kernels of the library `blockmm.kernel()` loads, None), or (None, why not)."""
    found, why = blockmm.kernel()
    return (None, why) if found is None else (wrap(found), None)


def load_variant(variant: str) -> tuple[QKernel | None, str | None]:
    """The kernels of one instruction-set build (`blockmm.load_variant`), e.g. for tests."""
    found, why = blockmm.load_variant(variant)
    return (None, why) if found is None else (wrap(found), None)


def _kernel(given: QKernel | None) -> QKernel:
    if given is not None:
        return given
    found, why = kernel()
    if found is None:
        raise RuntimeError(f"the qmatmul kernel is unavailable: {why}")
    return found


def quantize(x: torch.Tensor, kernel: QKernel | None = None, threads: int | None = None) -> Activations:
    return _kernel(kernel).quantize(x, threads)


def matmul(x: torch.Tensor | Activations, w: QMatrix, out: torch.Tensor | None = None, threads: int | None = None,
           kernel: QKernel | None = None) -> torch.Tensor:
    """x [M, K] float32 (or `Activations`) times the file's weight `w` [N, K] -> [M, N] float32."""
    return _kernel(kernel).matmul(x, w, out, threads)


def get_rows(w: QMatrix, ids, kernel: QKernel | None = None) -> torch.Tensor:
    """Rows `ids` of `w` as float32 [len(ids), K], exactly as gguf-py's dequantize computes them."""
    return _kernel(kernel).get_rows(w, ids)
