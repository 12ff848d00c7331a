"""Tensors as values: the header that carries dtype and shape, and adapters for numpy, torch and cupy.

Every tensor value (and every layer-wise block) opens with a 128-byte header
(layout in proto/fastpath.py): dtype name, the shape of one layer, the number
of layers, and a flag saying whether the value is layered. The node reads
only the geometry; the SDK reads the rest, so `get_tensor` rebuilds the
tensor with no side channel and `get_tensor_into` refuses a destination whose
dtype or shape differ (`TensorMismatch`) instead of reinterpreting bytes.

Tensors are moved as flat byte views of their own memory: a numpy array or a
CPU torch tensor is viewed in place (bfloat16 included, through a uint8 view
of the same storage); a CUDA tensor (torch or cupy) is staged through host
memory unless the GPU fast path (`gpu`) can copy it device to device. Only
C-contiguous tensors are accepted, as sources and as destinations: a strided
one would need a hidden copy.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from client.errors import KVError
from proto import fastpath as fp

# dtype names on the wire, with their numpy equivalents where numpy has one.
NUMPY_DTYPES = {name: np.dtype(name) for name in (
    "float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32",
    "uint64", "bool", "complex64", "complex128")}
BFLOAT16 = "bfloat16"


class TensorMismatch(KVError):
    """The stored tensor's dtype or shape differ from the destination's (nothing was copied)."""


@dataclass(frozen=True)
class TensorSpec:
    """What a value holds: ``n_layers`` slots, each a tensor of ``shape`` and ``dtype``."""

    dtype: str
    shape: tuple[int, ...]
    n_layers: int = 1
    layered: bool = False

    @property
    def itemsize(self) -> int:
        return 2 if self.dtype == BFLOAT16 else NUMPY_DTYPES[self.dtype].itemsize

    @property
    def layer_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.itemsize

    def layers_in(self, start: int, stop: int) -> int:
        """How many layers start..stop-1 name (stop -1: to the last)."""
        return (self.n_layers if stop == -1 else stop) - start

    def full_shape(self, layers: int | None = None) -> tuple[int, ...]:
        """The shape of ``layers`` consecutive layers (all of them by default)."""
        if not self.layered:
            return self.shape
        return (self.n_layers if layers is None else layers, *self.shape)

    def header(self) -> bytes:
        if len(self.shape) > fp.MAX_NDIM:
            raise ValueError(f"tensors of at most {fp.MAX_NDIM} dimensions, not {len(self.shape)}")
        shape = list(self.shape) + [0] * (fp.MAX_NDIM - len(self.shape))
        packed = struct.pack(fp.HEADER_FORMAT, fp.HEADER_MAGIC, self.n_layers, max(self.layer_bytes, 1),
                             self.dtype.encode(), len(self.shape), fp.FLAG_LAYERED if self.layered else 0,
                             *shape)
        return packed.ljust(fp.HEADER_SIZE, b"\0")


def parse_header(header: bytes | bytearray | memoryview) -> TensorSpec:
    """The spec a value's header declares (KVError when the value is not a tensor)."""
    if len(header) < fp.HEADER_SIZE:
        raise KVError(f"value of {len(header)} bytes is too short to be a tensor")
    magic, n_layers, _, dtype, ndim, flags, *shape = struct.unpack_from(fp.HEADER_FORMAT, header)
    if magic != fp.HEADER_MAGIC:
        raise KVError("the value was not stored as a tensor (no tensor header)")
    return TensorSpec(dtype.rstrip(b"\0").decode(), tuple(shape[:ndim]), n_layers, bool(flags & fp.FLAG_LAYERED))


# --------------------------------------------------------------- adapters

def kind_of(tensor: Any) -> str:
    """'numpy', 'torch', 'cupy' (with ':cuda' for device tensors), or TypeError."""
    module = type(tensor).__module__.split(".")[0]
    if isinstance(tensor, np.ndarray):
        return "numpy"
    if module == "torch":
        return "torch:cuda" if tensor.is_cuda else "torch"
    if module == "cupy":
        return "cupy:cuda"
    raise TypeError(f"expected a numpy array, a torch tensor or a cupy array, not {type(tensor).__name__}")


def dtype_name(tensor: Any) -> str:
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in NUMPY_DTYPES and name != BFLOAT16:
        raise TypeError(f"dtype {name} cannot be stored as a tensor")
    return name


def spec_of(tensor: Any, n_layers: int = 1, layered: bool = False) -> TensorSpec:
    _check_contiguous(tensor)
    return TensorSpec(dtype_name(tensor), tuple(int(d) for d in tensor.shape), n_layers, layered)


def check_destination(tensor: Any) -> None:
    """Refuse a destination the SDK cannot fill in place: not a tensor, or not contiguous
    (a copy through its data pointer would run past a strided view, and one through a
    reshape would fill a temporary and leave the tensor as it was)."""
    _check_contiguous(tensor, "destination tensor")


def _check_contiguous(tensor: Any, what: str = "tensor") -> None:
    contiguous = tensor.is_contiguous() if kind_of(tensor).startswith("torch") else tensor.flags.c_contiguous
    if not contiguous:
        raise TypeError(f"the {what} must be contiguous (call .contiguous() / numpy.ascontiguousarray)")


def host_view(tensor: Any) -> memoryview:
    """A flat byte view of a CPU tensor's own memory (no copy)."""
    kind = kind_of(tensor)
    _check_contiguous(tensor)
    if kind == "numpy":
        return memoryview(tensor.reshape(-1).view(np.uint8))
    if kind == "torch":
        import torch
        return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    raise TypeError("a CUDA tensor has no host view")


def is_cuda(tensor: Any) -> bool:
    return kind_of(tensor).endswith(":cuda")


def to_host(tensor: Any) -> np.ndarray:
    """The bytes of a CUDA tensor, copied to host memory (one device-to-host copy)."""
    if kind_of(tensor) == "cupy:cuda":
        return tensor.reshape(-1).view("uint8").get()
    import torch
    return tensor.reshape(-1).view(torch.uint8).cpu().numpy()


def from_host(tensor: Any, data: np.ndarray) -> None:
    """Copy host bytes into a CUDA tensor (one host-to-device copy)."""
    if kind_of(tensor) == "cupy:cuda":
        tensor.reshape(-1).view("uint8").set(data)
        return
    import torch
    tensor.reshape(-1).view(torch.uint8).copy_(torch.from_numpy(data))


def check_matches(spec: TensorSpec, tensor: Any, layers: int | None = None) -> None:
    """Raise TensorMismatch unless ``tensor`` has exactly the stored dtype and shape
    (one layer of a layered block may also go into a tensor of the layer's own shape)."""
    want = spec.full_shape(layers)
    got_dtype, got_shape = dtype_name(tensor), tuple(int(d) for d in tensor.shape)
    one_layer = spec.layered and layers == 1 and got_shape == spec.shape
    if got_dtype != spec.dtype or (got_shape != want and not one_layer):
        raise TensorMismatch(f"stored tensor is {spec.dtype}{list(want)}, the destination is "
                             f"{got_dtype}{list(got_shape)}")


def from_bytes(spec: TensorSpec, data, framework: str, layers: int | None = None) -> Any:
    """A tensor over ``data`` (a writable host buffer; no copy for numpy and torch)."""
    shape = spec.full_shape(layers)
    if framework == "torch":
        import torch
        dtype = getattr(torch, spec.dtype)
        return torch.frombuffer(data, dtype=dtype).reshape(shape) if len(data) else torch.empty(shape, dtype=dtype)
    if framework == "cupy":
        import cupy
        return cupy.asarray(_numpy(spec, data).reshape(shape))
    if framework != "numpy":
        raise ValueError(f"framework must be 'numpy', 'torch' or 'cupy', not {framework!r}")
    return _numpy(spec, data).reshape(shape)


def _numpy(spec: TensorSpec, data) -> np.ndarray:
    if spec.dtype == BFLOAT16:
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError("numpy has no bfloat16: get it with framework='torch' "
                            "(or install ml_dtypes)") from None
        return np.frombuffer(data, dtype=ml_dtypes.bfloat16)
    return np.frombuffer(data, dtype=NUMPY_DTYPES[spec.dtype])
