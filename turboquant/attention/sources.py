"""Kernel sources: which files make each kernel, and the MLX kernel objects.

A kernel is a header (pasted by MLX before the signature it generates) and a
body.  Shared kernels (``metal/*.inc``) assemble for Metal and CUDA alike;
the tensor-core kernels (``metal/cuda/``) for CUDA only.  On CUDA a
kernel is an NVRTC cubin kept per machine (``cubins``); on Metal, and where
that toolchain is missing, MLX's JIT builds it.  None has been compiled for
Metal yet: the Metal flavour is assembled and tested as text.
"""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx

from . import cubins, device

SOURCE_DIR = Path(__file__).resolve().parent.parent.parent / "metal"
BACKENDS = ("metal", "cuda")


class KernelSource(NamedTuple):
    """The files of one kernel (relative to ``metal/``) and its argument names."""

    headers: tuple[str, ...]  # after the backend header
    bodies: tuple[str, ...]  # after the backend prologue, concatenated in order
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    defines: str = ""  # header lines that select a variant of a shared body
    cuda_only: bool = False


_TC = ("tq_common.h", "cuda/tensor_core.h")
_TC8_BODY = ("cuda/tq_decode_tc8.inc", "cuda/tq_decode_tc8_split.inc", "cuda/tq_decode_tc8_merge.inc")
_TC_INPUTS = ("q", "kp", "kn", "vp", "vn", "klut_g", "vlut_g", "meta", "kb")

KERNELS: dict[str, KernelSource] = {
    "tq_decode": KernelSource(("tq_common.h",), ("tq_decode.inc",),
                              ("q", "kp", "kn", "vp", "vn", "kcb", "vcb", "meta", "kb"), ("po", "pm", "pl")),
    "tq_decode_reduce": KernelSource(("tq_common.h",), ("tq_decode_reduce.inc",),
                                     ("po", "pm", "pl", "meta"), ("out", "lse")),
    "tq_dequant": KernelSource(("tq_common.h",), ("tq_dequant.inc",),
                               ("packed", "norms", "cb", "mean", "meta"), ("out",)),
    "tq_key_bias": KernelSource(("tq_common.h",), ("tq_key_bias.inc",),
                                ("q", "mpre", "btab", "sc", "meta"), ("kb",)),
    "tq_quantize": KernelSource(("tq_common.h",), ("tq_quantize.inc",),
                                ("x", "signs", "bounds", "cents", "alphas"), ("packed", "norms")),
    "tq_decode_tc": KernelSource(_TC, ("cuda/tq_decode_tc.inc",), _TC_INPUTS, ("po", "pm", "pl"),
                                 cuda_only=True),
    "tq_decode_tc8": KernelSource(_TC, _TC8_BODY, _TC_INPUTS, ("ws",), cuda_only=True),
    "tq_decode_tc8_fused": KernelSource(
        _TC, _TC8_BODY, _TC_INPUTS + ("wk", "wv", "signs", "vsigns", "km", "vm", "cnt", "dep", "kpairs",
                           "kmpre"),
        ("ws", "out"),
        defines="\n#define TC8_FUSED 1\n", cuda_only=True),
}
SHARED_KERNELS = tuple(k for k, s in KERNELS.items() if not s.cuda_only)


def _read(name: str) -> str:
    path = SOURCE_DIR / name
    try:
        return path.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(f"TurboQuant kernel source missing: {path}") from None


def kernel_source(name: str, be: str) -> tuple[str, str]:
    """(header, body) for kernel ``name`` on backend ``be`` ("metal"|"cuda").

    The prologue (thread indices under backend-neutral names) must sit in
    the body: MLX's Metal path adds thread-position attributes to the
    signature only for names it finds in the body text.
    """
    if be not in BACKENDS:
        raise ValueError(f"kernel_source: backend must be 'metal' or 'cuda', got {be!r}")
    src = KERNELS[name]
    if src.cuda_only and be != "cuda":
        raise ValueError(f"kernel_source: {name} is CUDA only (NVIDIA mma fragment layouts)")
    header = "\n".join([_read(f"backend_{be}.h")] + [_read(h) for h in src.headers]) + src.defines
    body = "\n".join([_read(f"backend_{be}.inc")] + [_read(b) for b in src.bodies])
    return header, body


_COMMENT = re.compile(r'("(?:\\.|[^"\\\n])*")|/\*.*?\*/|//[^\n]*', re.S)


def compact_source(src: str) -> str:
    """``src`` without comments, trailing spaces and blank lines (string
    literals kept): MLX re-assembles a custom kernel's source on every call,
    so comment bytes are host time per launch."""
    src = _COMMENT.sub(lambda m: m.group(1) or " ", src)
    return "\n".join(line.rstrip() for line in src.split("\n") if line.strip()) + "\n"


def mlx_source(name: str, be: str, prelude: str = "", consts: tuple = ()) -> tuple[str, str]:
    """(header, body) of kernel ``name`` as handed to MLX: ``prelude``
    appended to the header, ``consts`` -- (name, int) pairs -- compiled into
    the body as ``constexpr int`` (what MLX's template arguments become,
    without their conversion cost on every launch), comments stripped."""
    header, body = kernel_source(name, be)
    for k, v in consts:
        if not isinstance(v, int):
            raise TypeError(f"{name}: compiled-in constant {k}={v!r} must be an int")
    body = "".join(f"constexpr int {k} = {int(v)};\n" for k, v in consts) + body
    return compact_source(header + prelude), compact_source(body)


def mlx_kernel_name(name: str, header: str, body: str, dtypes: str = "") -> str:
    """The name a kernel goes by in MLX, which caches compiled modules by
    name (and template arguments) only: a hash of the source, so an edited
    source is never served stale, and of the dtypes, so a kernel built for
    float16 queries never runs on float32 ones."""
    return f"{name}_{hashlib.sha1((header + body).encode()).hexdigest()[:10]}{dtypes}"


def launch_bounds(threads: int, min_blocks: int) -> str:
    """CUDA ``__launch_bounds__`` for the next kernel signature (a header
    prelude): ``mx.fast.cuda_kernel`` generates the ``__global__`` signature
    and takes no register limit, so the header redefines ``__global__`` for
    this one module.  ``min_blocks`` resident threadgroups per SM cap the
    registers; 0: no cap."""
    if min_blocks <= 0:
        return ""
    return (
        "\n#ifdef __global__\n#undef __global__\n#endif\n"
        f"#define __global__ __location__(global) __launch_bounds__({threads}, {min_blocks})\n"
    )


@lru_cache(maxsize=None)
def _kernel(name: str, be: str, prelude: str = "", dtypes: tuple = (), consts: tuple = ()):
    """The kernel object for argument ``dtypes`` (inputs, then outputs): on
    CUDA a cubin kept per machine (``cubins``) where NVRTC and the headers
    are found, else MLX's JIT, which compiles in every process."""
    header, body = mlx_source(name, be, prelude, consts)
    src = KERNELS[name]

    def jit():
        make = mx.fast.metal_kernel if be == "metal" else mx.fast.cuda_kernel
        return make(
            name=mlx_kernel_name(name, header, body, _dtype_tag(dtypes)), input_names=list(src.inputs),
            output_names=list(src.outputs), source=body, header=header,
        )

    tools = cubins.toolchain() if be == "cuda" else None
    if tools is None:
        return jit()
    n = len(src.inputs)
    return cubins.CubinKernel(name, header, body, list(zip(src.inputs, dtypes[:n])),
                              list(zip(src.outputs, dtypes[n:])), tools, jit)


def _dtype_tag(dtypes: tuple) -> str:
    return "_" + hashlib.sha1("/".join(dtypes).encode()).hexdigest()[:8]


@lru_cache(maxsize=1024)
def _dtype_names(dtypes: tuple) -> tuple:
    return tuple(cubins.dtype_name(dt) for dt in dtypes)


def kernel_for(name: str, prelude: str, inputs, output_dtypes, consts: tuple = ()):
    """The kernel object for these inputs' dtypes on this process's backend."""
    be = device.backend()
    if be is None:
        raise RuntimeError(f"{name}: no GPU backend (Metal or CUDA) in this MLX build")
    dtypes = _dtype_names(tuple([a.dtype for a in inputs] + list(output_dtypes)))
    return _kernel(name, be, prelude, dtypes, consts)


def launch(name: str, prelude: str = "", **kw):
    """Launch kernel ``name`` (``kw`` as ``mx.fast.*_kernel`` takes them)."""
    return kernel_for(name, prelude, kw["inputs"], kw["output_dtypes"])(**kw)


def clear_cache() -> None:
    """Forget built kernel objects (tests that swap the backend)."""
    _kernel.cache_clear()
