"""Compile the CUDA flavour of the TurboQuant kernels with NVRTC (or nvcc), no GPU needed.

Assembles each kernel exactly as ``mx.fast.cuda_kernel`` does (MLX's default
header, our header, the generated ``__global__`` signature, template
constants, our body) and compiles it for sm_90, printing the ptxas resource
report (registers, spills).  A CUDA syntax error then shows here, not on a
lent GPU; ``--sass`` prints a case's machine code (to compare two versions
of the sources: identical SASS, identical outputs).

NVRTC needs (environment, all from PyPI wheels):
  NVRTC_LIB          libnvrtc.so.13 (nvidia-cuda-nvrtc; its lib/ on LD_LIBRARY_PATH)
  CUDA_INCLUDE       the CUDA headers (a toolkit's include/)
  MLX_CUDA_INCLUDE   a folder holding mlx/backend/cuda/device/*.cuh (the JIT
                     headers libmlx.so of the mlx-cuda wheel embeds:
                     ``--extract-mlx-headers LIBMLX OUT`` writes them) and cccl/
Without NVRTC_LIB a local nvcc compiles instead (MLX's preamble replaced by
the CUDA half/bfloat16 headers it pulls in).

  python scripts/cuda_compile_check.py [KERNEL ...]
  python scripts/cuda_compile_check.py --sass tq_decode_tc8_fused[:INDEX] > fused.sass
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from turboquant.attention.sources import KERNELS, launch_bounds, mlx_source  # noqa: E402

_CUDA_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16",
               "uint32": "uint32_t", "int32": "int32_t"}

_MLX_DEFAULT_HEADER = """
#include "mlx/backend/cuda/device/utils.cuh"

#include <cooperative_groups.h>

#define inf cuda::std::numeric_limits<float>::infinity()

"""

_NVCC_PREAMBLE = """
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cstdint>
#include <cooperative_groups.h>
"""


def mlx_cuda_source(name: str, in_types: list[str], out_types: list[str],
                    template: list[tuple[str, object]], prelude: str = "", consts: tuple = ()) -> str:
    """The translation unit ``mx.fast.cuda_kernel`` builds (MLX 0.32 build_kernel);
    ``prelude`` is what the launcher appends to the header (launch bounds),
    ``consts`` the constants compiled into the body instead of template
    arguments (the fused decode step)."""
    header, body = mlx_source(name, "cuda", prelude, consts)
    src = KERNELS[name]
    text = _MLX_DEFAULT_HEADER + header
    text += "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    text += f"__global__ void custom_kernel_{name}(\n"
    args = [f"    const {_CUDA_TYPES[t]}* {n}" for n, t in zip(src.inputs, in_types)]
    args += [f"    {_CUDA_TYPES[t]}* {n}" for n, t in zip(src.outputs, out_types)]
    text += ",\n".join(args) + ") {\n"
    for k, v in template:
        if isinstance(v, str):
            text += f"  using {k} = {_CUDA_TYPES[v]};\n"
        else:
            text += f"  constexpr int {k} = {v};\n"
    return text + "\n" + body + "\n}\n\n} // namespace mlx::core::cu\n"


def compile_nvcc(src: str, name: str, arch: str = "sm_90", cubin: str = "") -> tuple[bool, str]:
    """Compile with a local ``nvcc``; writes the cubin to ``cubin`` if given."""
    src = src.replace(_MLX_DEFAULT_HEADER, _NVCC_PREAMBLE)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"{name}.cu"
        path.write_text(src)
        out = ["-cubin", "-o", cubin] if cubin else ["-c", "-o", str(Path(d) / f"{name}.o")]
        r = subprocess.run(
            [shutil.which("nvcc") or "nvcc", f"-arch={arch}", "-std=c++17", "-Xptxas", "-v", *out, str(path)],
            capture_output=True, text=True,
        )
    return r.returncode == 0, r.stdout + r.stderr


def compile_cuda(src: str, name: str, arch: str = "sm_90", cubin: str = "") -> tuple[bool, str]:
    """NVRTC-compile ``src``; returns (ok, log); writes the cubin to ``cubin``
    if given.  Without ``NVRTC_LIB``, uses nvcc."""
    if not os.environ.get("NVRTC_LIB"):
        return compile_nvcc(src, name, arch, cubin)
    lib = ctypes.CDLL(os.environ["NVRTC_LIB"])
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), f"{name}.cu".encode(), 0, None, None)
    assert rc == 0, rc
    mlx_inc = os.environ["MLX_CUDA_INCLUDE"]
    inc = [mlx_inc, os.path.join(mlx_inc, "cccl"), os.environ["CUDA_INCLUDE"]]
    opts = [f"--gpu-architecture={arch}", "--std=c++17", "--ptxas-options=-v"]
    opts += [f"--include-path={p}" for p in inc]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value + 1)
    lib.nvrtcGetProgramLog(prog, log)
    if rc == 0 and cubin:
        n = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
        buf = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetCUBIN(prog, buf)
        Path(cubin).write_bytes(buf.raw)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc == 0, log.value.decode(errors="replace")


# decode kernel inputs: q, kp, kn, vp, vn, key/value codebooks (SIMT) or pair tables (tensor cores), meta
_SIMT_INS = ["float32", "uint32", "float16", "uint32", "float16", "float32", "float32", "int32"]
_TC_INS = ["float32", "uint32", "float16", "uint32", "float16", "uint32", "uint32", "int32"]


def _fused_ins(dtype: str) -> list[str]:
    """tq_decode_tc8_fused inputs: queries and the window in the model dtype."""
    return [dtype] + _TC_INS[1:] + [dtype, dtype, "float32", "float32", "float32", "float32", "uint32", dtype]


# (kernel, input dtypes, output dtypes, constants; MINB: the register cap the
# launcher sets, __launch_bounds__(NW * 32, MINB)).  The shapes the table
# launches: the presets 3.5 bits (4/3), 2.5 (3/2), 4/4, and the other splits
# key_bits/value_bits still select (3/4, 2/3), head dims 64/128/256.
CASES = [
    ("tq_decode", _SIMT_INS, ["float32"] * 3,
     [("D", 128), ("BK", 3), ("BV", 4), ("GL", 4), ("DPT", 16), ("NW", 8), ("U", 4)]),
    ("tq_decode", _SIMT_INS, ["float32"] * 3,
     [("D", 256), ("BK", 2), ("BV", 3), ("GL", 8), ("DPT", 8), ("NW", 4), ("U", 4)]),
    ("tq_decode", _SIMT_INS, ["float32"] * 3,
     [("D", 64), ("BK", 4), ("BV", 4), ("GL", 1), ("DPT", 16), ("NW", 8), ("U", 4)]),
    ("tq_decode", _SIMT_INS, ["float32"] * 3,
     [("D", 128), ("BK", 4), ("BV", 3), ("GL", 4), ("DPT", 16), ("NW", 8), ("U", 4)]),
    ("tq_decode", _SIMT_INS, ["float32"] * 3,
     [("D", 64), ("BK", 3), ("BV", 2), ("GL", 4), ("DPT", 16), ("NW", 8), ("U", 4)]),
    ("tq_decode_tc", _TC_INS, ["float32"] * 3, [("D", 128), ("BK", 4), ("BV", 3), ("GL", 16), ("NW", 4)]),
    ("tq_decode_tc", _TC_INS, ["float32"] * 3, [("D", 64), ("BK", 3), ("BV", 2), ("GL", 8), ("NW", 4)]),
    ("tq_decode_tc", _TC_INS, ["float32"] * 3, [("D", 128), ("BK", 3), ("BV", 4), ("GL", 16), ("NW", 4)]),
    ("tq_decode_tc", _TC_INS, ["float32"] * 3, [("D", 128), ("BK", 2), ("BV", 3), ("GL", 8), ("NW", 4)]),
    ("tq_decode_tc", _TC_INS, ["float32"] * 3, [("D", 64), ("BK", 3), ("BV", 3), ("GL", 1), ("NW", 4)]),
    ("tq_decode_tc8", _TC_INS, ["float32"], [("D", 128), ("BK", 4), ("BV", 3), ("NW", 4)]),
    ("tq_decode_tc8", _TC_INS, ["float32"], [("D", 128), ("BK", 3), ("BV", 2), ("NW", 8), ("MINB", 2)]),
    # task rows over one document (shared_prefix): rows x group per kv head,
    # e.g. 3 tasks x 4 (8B shape) = 12, 4 x 4 = 16 rows on d=128 and d=64 (1B)
    ("tq_decode_tc", _TC_INS, ["float32"] * 3, [("D", 128), ("BK", 3), ("BV", 4), ("GL", 12), ("NW", 4)]),
    ("tq_decode_tc", _TC_INS, ["float32"] * 3, [("D", 128), ("BK", 2), ("BV", 3), ("GL", 16), ("NW", 4)]),
    ("tq_decode_tc", _TC_INS, ["float32"] * 3, [("D", 64), ("BK", 3), ("BV", 4), ("GL", 16), ("NW", 4)]),
    ("tq_decode_tc8", _TC_INS, ["float32"], [("D", 128), ("BK", 3), ("BV", 4), ("NW", 8), ("MINB", 2)]),
    ("tq_decode_tc8", _TC_INS, ["float32"], [("D", 128), ("BK", 4), ("BV", 4), ("NW", 8), ("MINB", 2)]),
    ("tq_decode_tc8", _TC_INS, ["float32"], [("D", 64), ("BK", 2), ("BV", 3), ("NW", 4)]),
    ("tq_decode_tc8_fused", _fused_ins("float16"), ["float32", "float16"],  # the default step (3.5)
     [("D", 128), ("BK", 4), ("BV", 3), ("NW", 4)]),
    ("tq_decode_tc8_fused", _fused_ins("bfloat16"), ["float32", "bfloat16"],  # 2.5
     [("D", 64), ("BK", 3), ("BV", 2), ("NW", 8), ("MINB", 2)]),
    ("tq_decode_tc8_fused", _fused_ins("float16"), ["float32", "float16"],
     [("D", 128), ("BK", 3), ("BV", 4), ("NW", 8), ("MINB", 2)]),
    ("tq_decode_tc8_fused", _fused_ins("bfloat16"), ["float32", "bfloat16"],
     [("D", 64), ("BK", 2), ("BV", 3), ("NW", 4)]),
    ("tq_decode_tc8_fused", _fused_ins("float32"), ["float32", "float32"],
     [("D", 128), ("BK", 4), ("BV", 4), ("NW", 8), ("MINB", 2)]),
    ("tq_decode_reduce", ["float32", "float32", "float32", "int32"], ["float32"] * 2, [("D", 128)]),
    ("tq_dequant", ["uint32", "float16", "float32", "float32", "int32"], ["float16"],
     [("D", 128), ("BITS", 3), ("T", "float16")]),
    ("tq_dequant", ["uint32", "float16", "float32", "float32", "int32"], ["bfloat16"],
     [("D", 128), ("BITS", 3), ("T", "bfloat16")]),
    ("tq_quantize", ["float16", "float32", "float32", "float32"], ["uint32", "float16"],
     [("D", 128), ("BITS", 3), ("T", "float16")]),
    ("tq_quantize", ["float32", "float32", "float32", "float32"], ["uint32", "float16"],
     [("D", 64), ("BITS", 2), ("T", "float32")]),
]

# launched with the launch shape compiled into the body, not as template
# arguments (attention/step_plan.py)
_CONSTS_IN_BODY = {"tq_decode_tc8_fused"}


def case_source(name: str, ins: list[str], outs: list[str], tmpl: dict) -> str:
    """A case's translation unit, with the register cap of a ``MINB`` entry."""
    tmpl = dict(tmpl)
    minb = tmpl.pop("MINB", 0)
    prelude = launch_bounds(tmpl.get("NW", 0) * 32, minb)
    if name in _CONSTS_IN_BODY:
        return mlx_cuda_source(name, ins, outs, [], prelude, tuple(tmpl.items()))
    return mlx_cuda_source(name, ins, outs, list(tmpl.items()), prelude)


def dump_sass(spec: str, arch: str = "sm_90") -> int:
    """Print the SASS of case ``NAME[:INDEX]`` (the INDEX-th case of that
    kernel); needs ``cuobjdump`` and ``nvdisasm`` on PATH (PyPI:
    nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm)."""
    name, _, index = spec.partition(":")
    name, ins, outs, tmpl = [c for c in CASES if c[0] == name][int(index or 0)]
    with tempfile.TemporaryDirectory() as d:
        cubin = str(Path(d) / f"{name}.cubin")
        ok, log = compile_cuda(case_source(name, ins, outs, dict(tmpl)), name, arch, cubin)
        print(log.strip(), file=sys.stderr)
        if not ok:
            return 1
        return subprocess.run([shutil.which("cuobjdump") or "cuobjdump", "-sass", cubin]).returncode


def extract_mlx_headers(libmlx: str, out: str) -> int:
    """Write the CUDA JIT headers embedded in ``libmlx.so`` (null-terminated
    source strings) that ``utils.cuh`` needs into ``OUT/mlx/backend/cuda/device``."""
    data = Path(libmlx).read_bytes()
    wanted = {  # file -> a line only that file holds
        "utils.cuh": b"utilities that work under both",
        "config.h": b"used by both CUDA kernel code and host-only",
        "complex.cuh": b"LIBCUDACXX_ENABLE_SIMPLIFIED_COMPLEX_OPERATIONS",
    }
    dest = Path(out) / "mlx" / "backend" / "cuda" / "device"
    dest.mkdir(parents=True, exist_ok=True)
    for fname, marker in wanted.items():
        i = data.find(marker)
        if i < 0:
            print(f"{fname}: not found in {libmlx}", file=sys.stderr)
            return 1
        start, end = data.rfind(b"\0", 0, i) + 1, data.find(b"\0", i)
        (dest / fname).write_bytes(data[start:end])
    return 0


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--sass":
        return dump_sass(sys.argv[2])
    if len(sys.argv) > 3 and sys.argv[1] == "--extract-mlx-headers":
        return extract_mlx_headers(sys.argv[2], sys.argv[3])
    only = set(sys.argv[1:])  # kernel names to compile (all if none)
    failed = 0
    for name, ins, outs, tmpl in CASES:
        if only and name not in only:
            continue
        tag = ",".join(f"{k}={v}" for k, v in tmpl)
        ok, log = compile_cuda(case_source(name, ins, outs, dict(tmpl)), name)
        usage = [ln.strip() for ln in log.splitlines() if "registers" in ln or "spill" in ln]
        print(f"{'OK  ' if ok else 'FAIL'} {name} [{tag}] {' | '.join(usage)}")
        if not ok:
            failed += 1
            print(log)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
