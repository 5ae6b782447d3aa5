"""Compile the CUDA flavour of the TurboQuant kernels with NVRTC, no GPU needed.

Device time is scarce, and a CUDA syntax error would otherwise surface only
on the lent GPU.  This script assembles each kernel exactly as
``mx.fast.cuda_kernel`` does (MLX's default header, our header, the generated
``__global__`` signature, template constants, our body) and compiles it for
sm_90 with NVRTC, printing the ptxas resource report (registers, spills).

Needs (paths via environment, all from PyPI wheels / the mlx-cuda wheel):
  TQ_NVRTC_LIB        libnvrtc.so.13         (nvidia-cuda-nvrtc)
  TQ_CUDA_INCLUDE     CUDA headers           (nvidia-cuda-runtime, -crt)
  TQ_MLX_INCLUDE      dir holding mlx/backend/cuda/device/*.cuh (the JIT
                      headers MLX embeds in libmlx.so) and cccl/

  python benchmarks/cuda_compile_check.py [KERNEL ...]
  python benchmarks/cuda_compile_check.py --sass tq_decode_tc8_fused NW=8 MINB=2 > fused.sass
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from turboquant.kernels import _SIGNATURES, _tc8_prelude, mlx_source  # noqa: E402

_CUDA_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16",
               "uint32": "uint32_t", "int32": "int32_t"}

_MLX_DEFAULT_HEADER = """
#include "mlx/backend/cuda/device/utils.cuh"

#include <cooperative_groups.h>

#define inf cuda::std::numeric_limits<float>::infinity()

"""


def mlx_cuda_source(name: str, in_types: list[str], out_types: list[str],
                    template: list[tuple[str, object]], prelude: str = "", consts: tuple = ()) -> str:
    """The translation unit ``mx.fast.cuda_kernel`` builds (MLX 0.32 build_kernel);
    ``prelude`` is what the dispatcher appends to the header (launch bounds),
    ``consts`` the constants it compiles into the body instead of template
    arguments (the decode step's plan)."""
    header, body = mlx_source(name, "cuda", prelude, consts)  # as _kernel passes them
    inputs, outputs = _SIGNATURES[name]
    src = _MLX_DEFAULT_HEADER + header
    src += "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    src += f"__global__ void custom_kernel_{name}(\n"
    args = [f"    const {_CUDA_TYPES[t]}* {n}" for n, t in zip(inputs, in_types)]
    args += [f"    {_CUDA_TYPES[t]}* {n}" for n, t in zip(outputs, out_types)]
    src += ",\n".join(args) + ") {\n"
    for k, v in template:
        if isinstance(v, str):
            src += f"  using {k} = {_CUDA_TYPES[v]};\n"
        else:
            src += f"  constexpr int {k} = {v};\n"
    src += "\n" + body + "\n}\n\n} // namespace mlx::core::cu\n"
    return src


_NVCC_PREAMBLE = """
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cstdint>
#include <cooperative_groups.h>
"""


def compile_nvcc(src: str, name: str, arch: str = "sm_90", cubin: str = "") -> tuple[bool, str]:
    """Compile with a local ``nvcc`` instead of NVRTC (no MLX headers needed:
    MLX's JIT preamble is replaced by the CUDA half/bfloat headers it pulls in).
    Same ptxas report; what a developer machine without the MLX CUDA wheel has.
    Writes the cubin to ``cubin`` if given."""
    import shutil
    import subprocess
    import tempfile

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
    """NVRTC-compile ``src``; returns (ok, log).  Writes the cubin to ``cubin`` if given
    (``cuobjdump --dump-sass`` reads it).  Without ``TQ_NVRTC_LIB``, uses nvcc."""
    if not os.environ.get("TQ_NVRTC_LIB"):
        return compile_nvcc(src, name, arch, cubin)
    lib = ctypes.CDLL(os.environ["TQ_NVRTC_LIB"])
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), f"{name}.cu".encode(),
                                0, None, None)
    assert rc == 0, rc
    inc = [os.environ["TQ_MLX_INCLUDE"], os.path.join(os.environ["TQ_MLX_INCLUDE"], "cccl"),
           os.environ["TQ_CUDA_INCLUDE"]]
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


CASES = [
    ("tq_decode", _SIMT_INS,
     ["float32"] * 3,
     [("D", 128), ("BK", 3), ("BV", 4), ("GL", 4), ("DPT", 16), ("NW", 8), ("U", 4), ("PAIR", 1)]),
    ("tq_decode", _SIMT_INS,
     ["float32"] * 3,
     [("D", 256), ("BK", 2), ("BV", 3), ("GL", 8), ("DPT", 8), ("NW", 4), ("U", 2), ("PAIR", 0)]),
    ("tq_decode", _SIMT_INS,
     ["float32"] * 3,
     [("D", 64), ("BK", 4), ("BV", 4), ("GL", 1), ("DPT", 16), ("NW", 8), ("U", 4), ("PAIR", 1)]),
    ("tq_decode_tc", _TC_INS,
     ["float32"] * 3, [("D", 128), ("BK", 3), ("BV", 4), ("GL", 4), ("NW", 4)]),
    ("tq_decode_tc", _TC_INS,
     ["float32"] * 3, [("D", 128), ("BK", 2), ("BV", 3), ("GL", 8), ("NW", 4)]),
    ("tq_decode_tc", _TC_INS,
     ["float32"] * 3, [("D", 64), ("BK", 3), ("BV", 3), ("GL", 1), ("NW", 4)]),
    ("tq_decode_tc", _TC_INS,
     ["float32"] * 3, [("D", 128), ("BK", 4), ("BV", 4), ("GL", 4), ("NW", 8)]),
    ("tq_decode_tc", _TC_INS,
     ["float32"] * 3, [("D", 128), ("BK", 3), ("BV", 4), ("GL", 16), ("NW", 4)]),
    ("tq_decode_tc8", _TC_INS, ["float32"], [("D", 128), ("BK", 3), ("BV", 4), ("NW", 4), ("PF", 1), ("VC32", 0), ("L2PF", 0), ("DYN", 1)]),
    ("tq_decode_tc8", _TC_INS, ["float32"], [("D", 128), ("BK", 3), ("BV", 4), ("NW", 4), ("PF", 1), ("VC32", 1), ("L2PF", 1), ("DYN", 1)]),
    ("tq_decode_tc8", _TC_INS, ["float32"], [("D", 128), ("BK", 2), ("BV", 3), ("NW", 4), ("PF", 2), ("VC32", 0), ("L2PF", 0), ("DYN", 0)]),
    ("tq_decode_tc8", _TC_INS, ["float32"], [("D", 64), ("BK", 3), ("BV", 3), ("NW", 4), ("PF", 1), ("VC32", 0), ("L2PF", 0), ("DYN", 1)]),
    ("tq_decode_tc8", _TC_INS, ["float32"], [("D", 128), ("BK", 4), ("BV", 4), ("NW", 8), ("PF", 1), ("VC32", 0), ("L2PF", 0), ("DYN", 1)]),
    ("tq_decode_tc8", _TC_INS, ["float32"], [("D", 64), ("BK", 2), ("BV", 2), ("NW", 4), ("PF", 2), ("VC32", 0), ("L2PF", 0), ("DYN", 0)]),
    ("tq_decode_tc8", _TC_INS, ["float32"], [("D", 64), ("BK", 2), ("BV", 3), ("NW", 4), ("PF", 2), ("VC32", 0), ("L2PF", 0), ("DYN", 0), ("VPERM", 1)]),
    ("tq_decode_tc8_fused", _fused_ins("float16"), ["float32", "float16"],
     [("D", 128), ("BK", 3), ("BV", 4), ("NW", 4), ("PF", 1), ("VC32", 1), ("L2PF", 1), ("DYN", 1)]),
    ("tq_decode_tc8_fused", _fused_ins("float16"), ["float32", "float16"],  # the default step
     [("D", 128), ("BK", 3), ("BV", 4), ("NW", 8), ("PF", 1), ("VC32", 1), ("L2PF", 0), ("DYN", 1), ("MINB", 2)]),
    ("tq_decode_tc8_fused", _fused_ins("float16"), ["float32", "float16"],  # the default step, VPERM
     [("D", 128), ("BK", 3), ("BV", 4), ("NW", 8), ("PF", 1), ("VC32", 1), ("L2PF", 0), ("DYN", 1), ("MINB", 2), ("VPERM", 1)]),
    ("tq_decode_tc8_fused", _fused_ins("float16"), ["float32", "float16"],  # static splits (TQ_TC8_DYN=0)
     [("D", 128), ("BK", 3), ("BV", 4), ("NW", 8), ("PF", 1), ("VC32", 1), ("L2PF", 0), ("DYN", 0), ("MINB", 2)]),
    ("tq_decode_tc8_fused", _fused_ins("bfloat16"), ["float32", "bfloat16"],
     [("D", 64), ("BK", 2), ("BV", 3), ("NW", 4), ("PF", 1), ("VC32", 0), ("L2PF", 0), ("DYN", 1)]),
    ("tq_decode_tc8_fused", _fused_ins("float32"), ["float32", "float32"],
     [("D", 128), ("BK", 4), ("BV", 4), ("NW", 4), ("PF", 1), ("VC32", 0), ("L2PF", 0), ("DYN", 1)]),
    ("tq_decode_reduce", ["float32", "float32", "float32", "int32"], ["float32"] * 2,
     [("D", 128), ("GL", 4)]),
    ("tq_dequant", ["uint32", "float16", "float32", "float32", "int32"], ["float16"],
     [("D", 128), ("BITS", 3), ("T", "float16")]),
    ("tq_dequant", ["uint32", "float16", "float32", "float32", "int32"], ["bfloat16"],
     [("D", 128), ("BITS", 3), ("T", "bfloat16")]),
    ("tq_quantize", ["float16", "float32", "float32", "float32"], ["uint32", "float16"],
     [("D", 128), ("BITS", 3), ("T", "float16"), ("LSQ", 0)]),
    ("tq_quantize", ["float32", "float32", "float32", "float32"], ["uint32", "float16"],
     [("D", 64), ("BITS", 2), ("T", "float32"), ("LSQ", 1)]),
]


# launched with the launch shape compiled into the body, not as template
# arguments (kernels._StepPlan: no per-call template conversion)
_CONSTS_IN_BODY = {"tq_decode_tc8_fused"}


def case_source(name: str, ins: list[str], outs: list[str], tmpl: dict) -> str:
    """A case's translation unit; a ``MINB`` entry (popped from ``tmpl``) adds
    the register cap the dispatcher sets (``__launch_bounds__(NW * 32, MINB)``)."""
    minb = tmpl.pop("MINB", 0)  # only the decode cases (which have NW) carry one
    vperm = tmpl.pop("VPERM", 0)  # tc8's token order within a tile (a #define)
    prelude = _tc8_prelude(tmpl.get("NW", 0), minb, vperm)  # (no MINB: no cap; only tc8 cases set VPERM)
    if name in _CONSTS_IN_BODY:
        return mlx_cuda_source(name, ins, outs, [], prelude, tuple(tmpl.items()))
    return mlx_cuda_source(name, ins, outs, list(tmpl.items()), prelude)


def dump_sass(spec: str, overrides: list[str], arch: str = "sm_90") -> int:
    """Print the SASS of one case: ``NAME[:INDEX]`` (the INDEX-th case of that
    kernel in CASES), template overrides ``K=V``; ``MINB=n`` adds the launch
    bounds the dispatcher would (``__launch_bounds__(NW * 32, n)``).  Compiles
    as :func:`compile_cuda` does (NVRTC if configured, else ``nvcc``); needs
    ``cuobjdump`` + ``nvdisasm`` on PATH (PyPI: nvidia-cuda-cuobjdump,
    nvidia-cuda-nvdisasm).  Reading it is how a load that undid the prefetch
    was found (a conversion right after the load: docs/benchmarks.md,
    session 15), and the scoreboard wait that did the same (session 17)."""
    import shutil
    import subprocess
    import tempfile

    name, _, index = spec.partition(":")
    name, ins, outs, tmpl = [c for c in CASES if c[0] == name][int(index or 0)]
    tmpl = dict(tmpl)
    for kv in overrides:
        k, v = kv.split("=")
        tmpl[k] = int(v)
    src = case_source(name, ins, outs, tmpl)
    with tempfile.TemporaryDirectory() as d:
        cubin = str(Path(d) / f"{name}.cubin")
        ok, log = compile_cuda(src, name, arch, cubin)
        print(log.strip(), file=sys.stderr)
        if not ok:
            return 1
        return subprocess.run([shutil.which("cuobjdump") or "cuobjdump", "-sass", cubin]).returncode


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--sass":
        return dump_sass(sys.argv[2], sys.argv[3:])
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
