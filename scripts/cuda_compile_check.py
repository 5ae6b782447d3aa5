"""Compile the CUDA flavour of the TurboQuant kernels with NVRTC (or nvcc), no GPU needed.

Builds each kernel's translation unit exactly as the CUDA backend does
(``turboquant/attention/cubins.py``: our header, the ``__global__``
signature, template constants, our body) and compiles it for sm_90,
printing the ptxas resource report (registers, spills).  A CUDA syntax
error then shows here, not on a lent GPU; ``--sass`` prints a case's
machine code (to compare two versions of the sources: identical SASS,
identical outputs).

NVRTC needs (environment, all from PyPI wheels):
  NVRTC_LIB      libnvrtc.so.13 (nvidia-cuda-nvrtc; its lib/ on LD_LIBRARY_PATH)
  CUDA_INCLUDE   a folder with cuda_fp16.h (nvidia-cuda-runtime's nvidia/cu13/include,
                 or a toolkit's include/); found as the backend finds it if unset
Without NVRTC_LIB a local nvcc compiles instead.

  python scripts/cuda_compile_check.py [KERNEL ...]
  python scripts/cuda_compile_check.py --sass tq_decode_tc8_fused[:INDEX] > fused.sass
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from turboquant.attention.cubins import Nvrtc, cuda_include_dirs, named_unit  # noqa: E402
from turboquant.attention.sources import KERNELS, launch_bounds, mlx_source  # noqa: E402


def cuda_source(name: str, in_types: list[str], out_types: list[str],
                template: list[tuple[str, object]], prelude: str = "", consts: tuple = ()) -> str:
    """The translation unit the CUDA backend compiles; ``prelude`` is what
    the launcher appends to the header (launch bounds), ``consts`` the
    constants compiled into the body instead of template arguments (the
    fused decode step)."""
    header, body = mlx_source(name, "cuda", prelude, consts)
    src = KERNELS[name]
    return named_unit(name, header, body, list(zip(src.inputs, in_types)),
                      list(zip(src.outputs, out_types)), template)[1]


def compile_nvcc(src: str, name: str, arch: str = "sm_90", cubin: str = "") -> tuple[bool, str]:
    """Compile with a local ``nvcc``; writes the cubin to ``cubin`` if given."""
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
    nvrtc = Nvrtc.load(os.environ["NVRTC_LIB"])
    includes = [os.environ["CUDA_INCLUDE"]] if os.environ.get("CUDA_INCLUDE") else cuda_include_dirs()
    binary, log = nvrtc.compile(src, name, arch, includes, extra=["--ptxas-options=-v"])
    if binary is not None and cubin:
        Path(cubin).write_bytes(binary)
    return binary is not None, log


# decode kernel inputs: q, kp, kn, vp, vn, key/value codebooks (SIMT) or pair
# tables (tensor cores), meta, the key bias of a block-mean cache (KB = 1)
_SIMT_INS = ["float32", "uint32", "float16", "uint32", "float16", "float32", "float32", "int32", "float32"]
_TC_INS = ["float32", "uint32", "float16", "uint32", "float16", "uint32", "uint32", "int32", "float32"]


def _fused_ins(dtype: str) -> list[str]:
    """tq_decode_tc8_fused inputs: queries and the window in the model dtype."""
    return [dtype] + _TC_INS[1:] + [dtype, dtype, "float32", "float32", "float32", "float32", "uint32", dtype,
                                    "int32", "float32"]


# (kernel, input dtypes, output dtypes, constants; MINB: the register cap the
# launcher sets, __launch_bounds__(NW * 32, MINB)).  The shapes the table
# launches: the presets 3.5 bits (4/3), 2.5 (3/2), 4/4, and the other splits
# key_bits/value_bits still select (3/4, 2/3), head dims 64/128/256.
CASES = [
    ("tq_decode", _SIMT_INS, ["float32"] * 3,
     [("D", 128), ("BK", 3), ("BV", 4), ("GL", 4), ("DPT", 16), ("NW", 8), ("U", 4), ("KB", 0)]),
    ("tq_decode", _SIMT_INS, ["float32"] * 3,
     [("D", 256), ("BK", 2), ("BV", 3), ("GL", 8), ("DPT", 8), ("NW", 4), ("U", 4), ("KB", 0)]),
    ("tq_decode", _SIMT_INS, ["float32"] * 3,
     [("D", 64), ("BK", 4), ("BV", 4), ("GL", 1), ("DPT", 16), ("NW", 8), ("U", 4), ("KB", 0)]),
    ("tq_decode", _SIMT_INS, ["float32"] * 3,
     [("D", 128), ("BK", 4), ("BV", 3), ("GL", 4), ("DPT", 16), ("NW", 8), ("U", 4), ("KB", 0)]),
    ("tq_decode", _SIMT_INS, ["float32"] * 3,
     [("D", 64), ("BK", 3), ("BV", 2), ("GL", 4), ("DPT", 16), ("NW", 8), ("U", 4), ("KB", 0)]),
    ("tq_decode_tc", _TC_INS, ["float32"] * 3, [("D", 128), ("BK", 4), ("BV", 3), ("GL", 16), ("NW", 4), ("KB", 0)]),
    ("tq_decode_tc", _TC_INS, ["float32"] * 3, [("D", 64), ("BK", 3), ("BV", 2), ("GL", 8), ("NW", 4), ("KB", 0)]),
    ("tq_decode_tc", _TC_INS, ["float32"] * 3, [("D", 128), ("BK", 3), ("BV", 4), ("GL", 16), ("NW", 4), ("KB", 0)]),
    ("tq_decode_tc", _TC_INS, ["float32"] * 3, [("D", 128), ("BK", 2), ("BV", 3), ("GL", 8), ("NW", 4), ("KB", 0)]),
    ("tq_decode_tc", _TC_INS, ["float32"] * 3, [("D", 64), ("BK", 3), ("BV", 3), ("GL", 1), ("NW", 4), ("KB", 0)]),
    ("tq_decode_tc8", _TC_INS, ["float32"], [("D", 128), ("BK", 4), ("BV", 3), ("NW", 8), ("KB", 0), ("MINB", 2)]),
    ("tq_decode_tc8", _TC_INS, ["float32"], [("D", 128), ("BK", 3), ("BV", 2), ("NW", 8), ("KB", 0), ("MINB", 2)]),
    # task rows over one document (shared_prefix): rows x group per kv head,
    # e.g. 3 tasks x 4 (8B shape) = 12, 4 x 4 = 16 rows on d=128 and d=64 (1B)
    ("tq_decode_tc", _TC_INS, ["float32"] * 3, [("D", 128), ("BK", 3), ("BV", 4), ("GL", 12), ("NW", 4), ("KB", 0)]),
    ("tq_decode_tc", _TC_INS, ["float32"] * 3, [("D", 128), ("BK", 2), ("BV", 3), ("GL", 16), ("NW", 4), ("KB", 0)]),
    ("tq_decode_tc", _TC_INS, ["float32"] * 3, [("D", 64), ("BK", 3), ("BV", 4), ("GL", 16), ("NW", 4), ("KB", 0)]),
    ("tq_decode_tc8", _TC_INS, ["float32"], [("D", 128), ("BK", 3), ("BV", 4), ("NW", 8), ("KB", 0), ("MINB", 2)]),
    ("tq_decode_tc8", _TC_INS, ["float32"], [("D", 128), ("BK", 4), ("BV", 4), ("NW", 8), ("KB", 0), ("MINB", 2)]),
    ("tq_decode_tc8", _TC_INS, ["float32"], [("D", 64), ("BK", 2), ("BV", 3), ("NW", 8), ("KB", 0), ("MINB", 2)]),
    ("tq_decode_tc8_fused", _fused_ins("float16"), ["float32", "float16"],  # the default step (3.5)
     [("D", 128), ("BK", 4), ("BV", 3), ("NW", 8), ("KB", 0), ("TRAD", 0), ("KP", 16), ("QSC", 0), ("MINB", 2)]),
    ("tq_decode_tc8_fused", _fused_ins("bfloat16"), ["float32", "bfloat16"],  # 2.5
     [("D", 64), ("BK", 3), ("BV", 2), ("NW", 8), ("KB", 0), ("TRAD", 0), ("KP", 16), ("QSC", 0), ("MINB", 2)]),
    ("tq_decode_tc8_fused", _fused_ins("float16"), ["float32", "float16"],
     [("D", 128), ("BK", 3), ("BV", 4), ("NW", 8), ("KB", 0), ("TRAD", 0), ("KP", 16), ("QSC", 0), ("MINB", 2)]),
    ("tq_decode_tc8_fused", _fused_ins("bfloat16"), ["float32", "bfloat16"],
     [("D", 64), ("BK", 2), ("BV", 3), ("NW", 8), ("KB", 0), ("TRAD", 0), ("KP", 16), ("QSC", 0), ("MINB", 2)]),
    ("tq_decode_tc8_fused", _fused_ins("float32"), ["float32", "float32"],
     [("D", 128), ("BK", 4), ("BV", 4), ("NW", 8), ("KB", 0), ("TRAD", 0), ("KP", 16), ("QSC", 0), ("MINB", 2)]),
    ("tq_decode_reduce", ["float32", "float32", "float32", "int32"], ["float32"] * 2, [("D", 128)]),
    ("tq_dequant", ["uint32", "float16", "float32", "float32", "int32"], ["float16"],
     [("D", 128), ("BITS", 3), ("T", "float16")]),
    ("tq_dequant", ["uint32", "float16", "float32", "float32", "int32"], ["bfloat16"],
     [("D", 128), ("BITS", 3), ("T", "bfloat16")]),
    ("tq_key_bias", ["bfloat16", "float32", "float32", "float32", "int32"], ["float32"],
     [("D", 128), ("DIMS", 128), ("TRAD", 0)]),
    ("tq_key_bias", ["float32", "float32", "float32", "float32", "int32"], ["float32"],
     [("D", 64), ("DIMS", 32), ("TRAD", 1)]),
    ("tq_quantize", ["float16", "float32", "float32", "float32", "float32"], ["uint32", "float16"],
     [("D", 128), ("BITS", 3), ("NA", 9), ("UNBIASED", 1), ("T", "float16")]),
    ("tq_quantize", ["float32", "float32", "float32", "float32", "float32"], ["uint32", "float16"],
     [("D", 64), ("BITS", 2), ("NA", 9), ("UNBIASED", 0), ("T", "float32")]),
    # caches centred on a block mean (the key bias, KB = 1): what GPU caches
    # of a model with a known RoPE launch, at the shapes above
    ("tq_decode", _SIMT_INS, ["float32"] * 3,
     [("D", 128), ("BK", 4), ("BV", 3), ("GL", 4), ("DPT", 16), ("NW", 8), ("U", 4), ("KB", 1)]),
    ("tq_decode_tc", _TC_INS, ["float32"] * 3,
     [("D", 128), ("BK", 4), ("BV", 3), ("GL", 16), ("NW", 4), ("KB", 1)]),
    ("tq_decode_tc", _TC_INS, ["float32"] * 3, [("D", 64), ("BK", 3), ("BV", 2), ("GL", 8), ("NW", 4), ("KB", 1)]),
    ("tq_decode_tc8", _TC_INS, ["float32"], [("D", 128), ("BK", 4), ("BV", 3), ("NW", 8), ("KB", 1), ("MINB", 2)]),
    ("tq_decode_tc8_fused", _fused_ins("float16"), ["float32", "float16"],
     [("D", 128), ("BK", 4), ("BV", 3), ("NW", 8), ("KB", 1), ("TRAD", 0), ("KP", 16), ("QSC", 0), ("MINB", 2)]),
    ("tq_decode_tc8_fused", _fused_ins("bfloat16"), ["float32", "bfloat16"],
     [("D", 128), ("BK", 4), ("BV", 3), ("NW", 8), ("KB", 1), ("TRAD", 0), ("KP", 16), ("QSC", 0), ("MINB", 2)]),
    ("tq_decode_tc8_fused", _fused_ins("bfloat16"), ["float32", "bfloat16"],
     [("D", 64), ("BK", 3), ("BV", 2), ("NW", 8), ("KB", 1), ("TRAD", 0), ("KP", 16), ("QSC", 0), ("MINB", 2)]),
    ("tq_decode_tc8_fused", _fused_ins("float16"), ["float32", "float16"],
     [("D", 128), ("BK", 4), ("BV", 4), ("NW", 8), ("KB", 1), ("TRAD", 1), ("KP", 16), ("QSC", 0), ("MINB", 2)]),
    ("tq_decode_tc8_fused", _fused_ins("bfloat16"), ["float32", "bfloat16"],  # a key-scaled cache: signs per head
     [("D", 128), ("BK", 4), ("BV", 3), ("NW", 8), ("KB", 1), ("TRAD", 0), ("KP", 16), ("QSC", 1), ("MINB", 2)])]

# launched with the launch shape compiled into the body, not as template
# arguments (attention/step_plan.py)
_CONSTS_IN_BODY = {"tq_decode_tc8_fused", "tq_key_bias"}


def case_source(name: str, ins: list[str], outs: list[str], tmpl: dict) -> str:
    """A case's translation unit, with the register cap of a ``MINB`` entry."""
    tmpl = dict(tmpl)
    minb = tmpl.pop("MINB", 0)
    prelude = launch_bounds(tmpl.get("NW", 0) * 32, minb)
    if name in _CONSTS_IN_BODY:
        return cuda_source(name, ins, outs, [], prelude, tuple(tmpl.items()))
    return cuda_source(name, ins, outs, list(tmpl.items()), prelude)


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


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--sass":
        return dump_sass(sys.argv[2])
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
