"""CUDA kernels compiled once per machine and kept on disk as cubins.

``mx.fast.cuda_kernel`` compiles its source with NVRTC in every process, and
MLX keeps only its own kernels on disk.  Ours (the split-K decode kernels,
the fused step, reduce, quantize) then cost 4-5 s of NVRTC at their first
use in each process: in a process that only loads a document cache from the
store, that is nearly all of the first task's time to first token.  So on
CUDA each (kernel, dtypes, template arguments) is compiled once per machine
into a cubin, kept in a store folder under a name that hashes the
translation unit, and launched with ``mx.fast.precompiled_cuda_kernel``.

The translation unit is the one ``mx.fast.cuda_kernel`` builds (our header,
a ``__global__`` signature from the argument dtypes, template arguments as
``constexpr``, our body) with two differences: the CUDA half/bfloat16
headers stand where MLX's JIT preamble would (our kernels use nothing else
of it), and the symbol is ``extern "C"``, the name MLX looks a precompiled
kernel up by.

Where NVRTC, the CUDA headers or the GPU's architecture cannot be found, or
a unit fails to compile, that kernel is built by ``mx.fast.cuda_kernel``
instead, with a warning: slower to start, the same results.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Optional, Sequence

import mlx.core as mx

log = logging.getLogger(__name__)

# MLX's dtype_to_cuda_type for the dtypes our kernels take
CUDA_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16",
              "uint32": "uint32_t", "int32": "int32_t", "uint8": "uint8_t", "bool_": "bool"}

PREAMBLE = """#include <cuda_fp16.h>
#include <cuda_bf16.h>
typedef unsigned char uint8_t;
typedef int int32_t;
typedef unsigned int uint32_t;
"""

DIGEST = 32  # a stored cubin is sha256(cubin) followed by the cubin
_SYMBOL = "@SYMBOL@"


def dtype_name(dt) -> str:
    """``mx.float16`` -> ``"float16"`` (also for a name given as a string)."""
    return str(dt).rsplit(".", 1)[-1]


def translation_unit(symbol: str, header: str, body: str, inputs: Sequence[tuple[str, object]],
                     outputs: Sequence[tuple[str, object]], template: Sequence[tuple[str, object]] = ()) -> str:
    """The CUDA source of one kernel variant: ``inputs``/``outputs`` are
    (name, dtype) pairs in argument order, ``template`` (name, int | bool |
    dtype) pairs as MLX's template arguments become.  MLX's implicit
    ``<input>_shape``/``_strides``/``_ndim`` arguments have no place here: a
    body that names one is refused."""
    for n, _ in inputs:
        if re.search(rf"\b{n}_(shape|strides|ndim)\b", body):
            raise ValueError(f"kernel body uses {n}_shape/_strides/_ndim, which precompiled kernels do not pass")
    args = [f"    const {CUDA_TYPES[dtype_name(t)]}* {n}" for n, t in inputs]
    args += [f"    {CUDA_TYPES[dtype_name(t)]}* {n}" for n, t in outputs]
    consts = []
    for k, v in template:
        if isinstance(v, bool):
            consts.append(f"  constexpr bool {k} = {'true' if v else 'false'};")
        elif isinstance(v, int):
            consts.append(f"  constexpr int {k} = {v};")
        else:
            consts.append(f"  using {k} = {CUDA_TYPES[dtype_name(v)]};")
    return (PREAMBLE + header + f'\nextern "C" __global__ void {symbol}(\n' + ",\n".join(args) + ") {\n"
            + "".join(c + "\n" for c in consts) + "\n" + body + "\n}\n")


def named_unit(name: str, *unit_args, **unit_kw) -> tuple[str, str]:
    """(symbol, source): the symbol is ``name`` and a hash of the unit, so a
    changed source, dtype or template argument is never served an old cubin
    (MLX also keys its loaded modules by this name)."""
    text = translation_unit(_SYMBOL, *unit_args, **unit_kw)
    symbol = f"{name}_{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    return symbol, text.replace(_SYMBOL, symbol)


class Nvrtc:
    """NVRTC through ctypes: the library MLX's CUDA build links, no new dependency."""

    NAMES = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so")

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        vp, cp = ctypes.c_void_p, ctypes.c_char_p
        lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(vp), cp, cp, ctypes.c_int, vp, vp]
        lib.nvrtcCompileProgram.argtypes = [vp, ctypes.c_int, ctypes.POINTER(cp)]
        for f in ("nvrtcGetProgramLogSize", "nvrtcGetCUBINSize"):
            getattr(lib, f).argtypes = [vp, ctypes.POINTER(ctypes.c_size_t)]
        for f in ("nvrtcGetProgramLog", "nvrtcGetCUBIN"):
            getattr(lib, f).argtypes = [vp, ctypes.c_char_p]
        lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(vp)]

    @classmethod
    def load(cls, path: Optional[str] = None) -> Optional["Nvrtc"]:
        """The library at ``path``, else the one MLX loaded (found by soname); None if absent."""
        for name in [path] if path else cls.NAMES:
            try:
                return cls(ctypes.CDLL(name))
            except OSError:
                continue
        return None

    def version(self) -> str:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        return f"{major.value}.{minor.value}"

    def compile(self, source: str, name: str, arch: str, include_dirs: Sequence[str],
                extra: Sequence[str] = ()) -> tuple[Optional[bytes], str]:
        """(cubin or None, compiler log) of ``source`` for ``arch`` (``sm_90``)."""
        lib, prog = self.lib, ctypes.c_void_p()
        rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None)
        if rc != 0:
            return None, f"nvrtcCreateProgram failed ({rc})"
        try:
            opts = [f"--gpu-architecture={arch}", "--std=c++17", *extra]
            opts += [f"--include-path={d}" for d in include_dirs]
            arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
            rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            text = ctypes.create_string_buffer(size.value + 1)
            lib.nvrtcGetProgramLog(prog, text)
            report = text.value.decode(errors="replace")
            if rc != 0:
                return None, report
            lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
            cubin = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetCUBIN(prog, cubin)
            return cubin.raw, report
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _loaded_library_dir(soname_part: str) -> Optional[Path]:
    """The folder of a loaded shared library (Linux: /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if soname_part in Path(path).name:
                    return Path(path).parent
    except OSError:
        pass
    return None


def cuda_include_dirs() -> list[str]:
    """A folder with ``cuda_fp16.h``: beside the NVRTC in use (the
    nvidia-cuda-runtime wheel MLX depends on installs both under
    ``nvidia/cu13``), in the installed nvidia wheels, or in a toolkit
    (``CUDA_HOME``, ``CUDA_PATH``, ``/usr/local/cuda``, as MLX looks)."""
    candidates = []
    lib_dir = _loaded_library_dir("libnvrtc.so")
    if lib_dir is not None:
        candidates.append(lib_dir.parent / "include")
    for entry in sys.path:
        for sub in ("nvidia/cu13/include", "nvidia/cu12/include", "nvidia/cuda_runtime/include"):
            candidates.append(Path(entry) / sub)
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    for d in candidates:
        if (d / "cuda_fp16.h").is_file():
            return [str(d)]
    return []


def gpu_arch() -> Optional[str]:
    """``sm_90`` and the like for MLX's GPU, None without a CUDA device."""
    dev = mx.default_device()
    info = mx.device_info(dev if dev.type == mx.gpu else mx.gpu)
    arch = str(info.get("architecture", ""))
    return arch if arch.startswith("sm_") else None


def default_store() -> Path:
    """A per-user folder under the temp dir (as MLX keeps its own kernels);
    ``tqpipe`` points :func:`use_store` at ``$TQPIPE_HOME/kernels``."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"tqpipe-{uid}" / "cubins"


_store: Optional[Path] = None


def use_store(path: os.PathLike | str) -> None:
    """Keep compiled kernels in ``path`` from now on."""
    global _store
    _store = Path(path)


def store_dir() -> Path:
    return _store or default_store()


def read_cubin(path: Path) -> Optional[bytes]:
    """The cubin stored at ``path``; None if absent, truncated or altered."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    cubin = data[DIGEST:]
    if len(data) <= DIGEST or hashlib.sha256(cubin).digest() != data[:DIGEST]:
        return None
    return cubin


def write_cubin(path: Path, cubin: bytes) -> None:
    """Store ``cubin`` at ``path`` atomically: a reader sees the old file,
    none, or the whole new one; two writers of one key write the same bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(hashlib.sha256(cubin).digest() + cubin)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class Toolchain:
    """What compiling for this process's GPU takes; the store folder is
    per architecture and NVRTC version (a cubin runs on its own architecture)."""

    nvrtc: Nvrtc
    include_dirs: tuple[str, ...]
    arch: str

    def folder(self) -> Path:
        return store_dir() / f"{self.arch}-nvrtc{self.nvrtc.version()}"


@lru_cache(maxsize=1)
def toolchain() -> Optional[Toolchain]:
    """The process's toolchain, or None (then MLX's JIT builds every kernel).

    ``mx.fast.precompiled_cuda_kernel`` is marked experimental in MLX, so a
    toolchain is used only after a probe kernel built with it returns the
    right numbers in this process."""
    arch = gpu_arch()
    if arch is None:
        return None
    nvrtc = Nvrtc.load()
    includes = cuda_include_dirs()
    if nvrtc is None or not includes:
        log.warning("TurboQuant kernels: %s not found; MLX compiles them in every process instead "
                    "(a few seconds at first use)", "NVRTC" if nvrtc is None else "the CUDA headers (cuda_fp16.h)")
        return None
    tools = Toolchain(nvrtc, tuple(includes), arch)
    return tools if probe(tools) else None


def probe(tools: Toolchain) -> bool:
    """Whether a kernel compiled and launched through ``tools`` computes
    ``2 x + 1`` over 64 floats (a cubin from the store after the first time)."""
    kernel = CubinKernel("tq_probe", "", "int i = blockIdx.x * blockDim.x + threadIdx.x;\nout[i] = 2.0f * x[i] + 1.0f;",
                         [("x", mx.float32)], [("out", mx.float32)], tools, lambda: None)
    x = mx.arange(64, dtype=mx.float32)
    try:
        if kernel.build() is None:
            return False
        (out,) = kernel(inputs=[x], output_shapes=[(64,)], output_dtypes=[mx.float32],
                        grid=(64, 1, 1), threadgroup=(32, 1, 1))
        if mx.array_equal(out, 2 * x + 1).item():
            return True
        reason = "wrong results"
    except Exception as e:  # an MLX without the API, a driver refusing the cubin
        reason = f"{type(e).__name__}: {e}"
    log.warning("TurboQuant kernels: a precompiled CUDA kernel failed its check (%s); "
                "MLX compiles them in every process instead", reason)
    return False


class CubinKernel:
    """Called as the object ``mx.fast.cuda_kernel`` returns is; builds (or
    reads from the store) one cubin per template and launches it."""

    def __init__(self, name: str, header: str, body: str, inputs: Sequence[tuple[str, object]],
                 outputs: Sequence[tuple[str, object]], tools: Toolchain, fallback: Callable[[], object]):
        self.name, self.header, self.body = name, header, body
        self.inputs, self.outputs, self.tools = tuple(inputs), tuple(outputs), tools
        self._fallback, self._fallback_kernel = fallback, None
        self._built: dict[tuple, Optional[tuple[str, bytes]]] = {}

    def build(self, template: Sequence[tuple[str, object]] = ()) -> Optional[tuple[str, bytes]]:
        """(symbol, cubin) for ``template``, from the store or compiled into
        it; None if it does not compile."""
        key = tuple(template)
        if key in self._built:
            return self._built[key]
        symbol, source = named_unit(self.name, self.header, self.body, self.inputs, self.outputs, key)
        path = self.tools.folder() / f"{symbol}.cubin"
        cubin = read_cubin(path)
        if cubin is None:
            t0 = time.perf_counter()
            cubin, report = self.tools.nvrtc.compile(source, symbol, self.tools.arch, self.tools.include_dirs)
            if cubin is None:
                log.warning("TurboQuant kernel %s did not compile with NVRTC; MLX builds it instead:\n%s",
                            symbol, report[-2000:])
            else:
                log.info("compiled %s for %s in %.1f s; kept in %s", symbol, self.tools.arch,
                         time.perf_counter() - t0, path.parent)
                try:
                    write_cubin(path, cubin)
                except OSError as e:
                    log.warning("TurboQuant kernels: cannot keep %s (%s); it compiles again next process", path, e)
        built = self._built[key] = None if cubin is None else (symbol, cubin)
        return built

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template=(),
                 init_value=None, stream=None):
        built = self._built.get(tuple(template), False)
        if built is False:
            built = self.build(template)
        if built is None:
            if self._fallback_kernel is None:
                self._fallback_kernel = self._fallback()
            return self._fallback_kernel(inputs=inputs, output_shapes=output_shapes, output_dtypes=output_dtypes,
                                         grid=grid, threadgroup=threadgroup, template=list(template),
                                         init_value=init_value, stream=stream)
        symbol, cubin = built
        return mx.fast.precompiled_cuda_kernel(
            name=symbol, compiled_source=cubin, inputs=inputs, output_shapes=output_shapes,
            output_dtypes=output_dtypes, scalars=[], grid=grid, threadgroup=threadgroup,
            init_value=init_value, ensure_row_contiguous=True, stream=stream,
        )
