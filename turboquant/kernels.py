"""GPU kernels for the packed TurboQuant cache (sources in ``metal/``).

One kernel body per operation (``metal/tq_*.inc``) is compiled for Apple GPUs
through ``mx.fast.metal_kernel`` and for NVIDIA GPUs through
``mx.fast.cuda_kernel``; the few places where the languages differ (thread
indices, warp shuffles, shared-memory qualifiers, type names) live in
``metal/backend_{metal,cuda}.{h,inc}``.  So the code timed on an H200 is the
code a Mac compiles.

Kernels:

* ``decode``: split-K (flash-decoding) attention of a few query rows over the
  packed history, all query heads of a kv head in one threadgroup (GQA without
  repeating K/V), plus a small reduction kernel (fused into the CUDA decode
  kernel ``tq_decode_tc8``; tensor-core kernels on CUDA, the shared SIMT body
  elsewhere).  Returns the normalised
  rotated-domain output and its log-sum-exp, which merge with the exact
  window exactly like the reference path's online-softmax state.
* ``decode_step`` (CUDA): the whole decode attention step in one launch
  (``tq_decode_tc8_fused``: the tc8 body with ``TQ_FUSED``): query rotation,
  packed history, exact window, merge, centring terms and inverse rotation
  inside the kernel instead of ~20 MLX ops around it.
* ``dequant``: packed history -> rotated-domain keys/values in the model dtype,
  for chunked prefill, which then runs MLX's fused SDPA (matrix units) over
  ``[history; window]`` in one call.
* ``quantize``: rotation (in-threadgroup FWHT) + codebook search + bit packing
  + corrected norm, one launch per append.

Dispatch: ``TQ_KERNELS=auto`` (default) uses the kernels when the default
device is a GPU with a Metal or CUDA backend and the reference path
(``turboquant.attention``) otherwise; ``gpu`` forces the kernels (error if
there is no GPU); ``reference`` forces the pure-MLX path.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import struct
import weakref
from functools import lru_cache
from pathlib import Path
from typing import Optional

import mlx.core as mx

from .masks import apply_mask, as_5d, split_mask

SOURCE_DIR = Path(__file__).resolve().parent.parent / "metal"
MODES = ("auto", "gpu", "reference")

# name -> (input names, output names)
_SIGNATURES = {
    "tq_decode": (["q", "kp", "kn", "vp", "vn", "kcb", "vcb", "meta"], ["po", "pm", "pl"]),
    "tq_decode_tc": (["q", "kp", "kn", "vp", "vn", "klut_g", "vlut_g", "meta"], ["po", "pm", "pl"]),
    "tq_decode_tc8": (["q", "kp", "kn", "vp", "vn", "klut_g", "vlut_g", "meta"], ["ws"]),
    "tq_decode_tc8_fused": (["q", "kp", "kn", "vp", "vn", "klut_g", "vlut_g", "meta",
                             "wk", "wv", "signs", "vsigns", "km", "vm", "cnt", "dep"], ["ws", "out"]),
    "tq_decode_reduce": (["po", "pm", "pl", "meta"], ["out", "lse"]),
    "tq_dequant": (["packed", "norms", "cb", "mean", "meta"], ["out"]),
    "tq_quantize": (["x", "signs", "bounds", "cents"], ["packed", "norms"]),
}

# kernels compiled from another kernel's body with switches defined:
# name -> (body, header lines)
_VARIANTS = {
    "tq_decode_tc8_fused": ("tq_decode_tc8", "\n#define TQ_FUSED 1\n"),
}


# --------------------------------------------------------------------------
# dispatch

_ENV_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None


@lru_cache(maxsize=None)
def _env_key(name: str) -> bytes:
    return name.encode()


def getenv(name: str, default=None):
    """``os.environ.get`` for the settings read on every decode step (~14 of
    them): ``os.environ.get`` re-encodes key and value each call, ~1 us apiece
    on a slow host, i.e. half the Python cost of a fused decode step.  Reads
    the same mapping (``os.environ._data`` on POSIX), so ``os.environ`` and
    ``monkeypatch.setenv`` changes show at once."""
    if _ENV_DATA is None:
        return os.environ.get(name, default)
    v = _ENV_DATA.get(_env_key(name))
    return default if v is None else v.decode()


def mode() -> str:
    """The ``TQ_KERNELS`` setting (auto|gpu|reference)."""
    m = getenv("TQ_KERNELS", "auto").strip().lower() or "auto"
    if m not in MODES:
        raise ValueError(f"TQ_KERNELS={m!r}: choose one of {', '.join(MODES)}")
    return m


@lru_cache(maxsize=1)
def backend() -> Optional[str]:
    """``"metal"``, ``"cuda"`` or None: which kernel language this MLX build
    runs (fixed for the process: asked once, not on every decode step)."""
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return None


def use_kernels() -> bool:
    """Whether attention on the packed cache should run the GPU kernels."""
    m = mode()
    if m == "reference":
        return False
    be = backend()
    if m == "gpu":
        if be is None:
            raise RuntimeError(
                "TQ_KERNELS=gpu, but this MLX build has neither Metal nor CUDA "
                "(install mlx[cuda13] on NVIDIA, or unset TQ_KERNELS)"
            )
        return True
    return be is not None and mx.default_device() == mx.gpu


# --------------------------------------------------------------------------
# source assembly and kernel cache


def _read(name: str) -> str:
    path = SOURCE_DIR / name
    try:
        return path.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(f"TurboQuant kernel source missing: {path}") from None


def kernel_source(name: str, be: str) -> tuple[str, str]:
    """(header, body) for kernel ``name`` on backend ``be`` ("metal"|"cuda").

    The header is the backend header plus ``tq_common.h`` (MLX pastes it
    before the generated signature); the body is the backend prologue plus
    the shared ``<name>.inc``.  The prologue must sit in the body: MLX's
    Metal path adds thread-position attributes to the signature only for
    names it finds in the body text.
    """
    if be not in ("metal", "cuda"):
        raise ValueError(f"kernel_source: backend must be 'metal' or 'cuda', got {be!r}")
    body_name, defines = _VARIANTS.get(name, (name, ""))
    header = _read(f"backend_{be}.h") + "\n" + _read("tq_common.h") + defines
    body = _read(f"backend_{be}.inc") + "\n" + _read(f"{body_name}.inc")
    return header, body


_COMMENT = re.compile(r'("(?:\\.|[^"\\\n])*")|/\*.*?\*/|//[^\n]*', re.S)


def compact_source(src: str) -> str:
    """``src`` without comments, trailing spaces and blank lines (string
    literals kept).  MLX re-assembles a custom kernel's whole source on every
    call, so the ~30% of the sources that is comments is host time per
    launch."""
    src = _COMMENT.sub(lambda m: m.group(1) or " ", src)
    return "\n".join(line.rstrip() for line in src.split("\n") if line.strip()) + "\n"


def mlx_source(name: str, be: str, prelude: str = "", consts: tuple = ()) -> tuple[str, str]:
    """(header, body) of kernel ``name`` as handed to MLX: ``prelude``
    appended to the header, ``consts`` -- (name, int) pairs -- compiled into
    the body as ``constexpr int``, comments stripped.

    ``consts`` are what MLX's template arguments become (the same
    declarations at the same place), for a kernel launched every decode
    step: MLX converts and formats a launch's template arguments on every
    call (2.2-2.3 us for the decode step's eight on the H200's host,
    ``benchmarks/kernel_call_cost.py``, docs/benchmarks.md session 24);
    constants in the source cost nothing per call."""
    header, body = kernel_source(name, be)
    for k, v in consts:
        if not isinstance(v, int):
            raise TypeError(f"{name}: compiled-in constant {k}={v!r} must be an int")
    body = "".join(f"constexpr int {k} = {int(v)};\n" for k, v in consts) + body
    return compact_source(header + prelude), compact_source(body)


def mlx_kernel_name(name: str, header: str, body: str, dtypes: str = "") -> str:
    """The name a kernel built from ``header`` + ``body`` goes by in MLX.

    MLX caches compiled modules (in memory, and on disk for CUDA) by kernel
    name + template arguments only, not by the generated signature's
    types: the name carries a hash of the source, so an edited source is
    never served from a stale cache, and the arrays' dtypes, so a kernel
    built for float16 queries never runs on float32 ones."""
    return f"{name}_{hashlib.sha1((header + body).encode()).hexdigest()[:10]}{dtypes}"


@lru_cache(maxsize=None)
def _kernel(name: str, be: str, prelude: str = "", dtypes: str = "", consts: tuple = ()):
    header, body = mlx_source(name, be, prelude, consts)
    inputs, outputs = _SIGNATURES[name]
    make = mx.fast.metal_kernel if be == "metal" else mx.fast.cuda_kernel
    return make(
        name=mlx_kernel_name(name, header, body, dtypes), input_names=inputs, output_names=outputs,
        source=body, header=header,
    )


def dtype_tag(inputs, output_dtypes) -> str:
    """A short name suffix for the dtypes of a launch's inputs and outputs
    (``_kernel``: MLX keys its compiled-kernel caches by name)."""
    return _dtype_tag(tuple([a.dtype for a in inputs] + list(output_dtypes)))


@lru_cache(maxsize=1024)
def _dtype_tag(dtypes: tuple) -> str:
    sig = "/".join(str(dt).rsplit(".", 1)[-1] for dt in dtypes)
    return "_" + hashlib.sha1(sig.encode()).hexdigest()[:8]


def _kernel_for(name: str, prelude: str, inputs, output_dtypes, consts: tuple = ()):
    be = backend()
    if be is None:
        raise RuntimeError(f"{name}: no GPU backend (Metal or CUDA) in this MLX build")
    return _kernel(name, be, prelude, dtype_tag(inputs, output_dtypes), consts)


def _launch(name: str, prelude: str = "", **kw):
    return _kernel_for(name, prelude, kw["inputs"], kw["output_dtypes"])(**kw)


def _launch_bounds(threads: int, min_blocks: int) -> str:
    """CUDA ``__launch_bounds__`` for the next kernel signature.

    ``mx.fast.cuda_kernel`` generates the ``__global__`` signature itself and
    takes no register limit, so the header (pasted just before it) redefines
    ``__global__`` for this one NVRTC module.  ``min_blocks`` resident
    threadgroups per SM cap the registers (4 x 128 threads -> 128 registers).
    """
    if min_blocks <= 0:
        return ""
    return (
        "\n#ifdef __global__\n#undef __global__\n#endif\n"
        f"#define __global__ __location__(global) __launch_bounds__({threads}, {min_blocks})\n"
    )


# --------------------------------------------------------------------------
# decode


def decode_config(d: int, rows: int, b_hkv: int, n: int) -> Optional[dict]:
    """Launch shape of the split-K decode kernel, or None if unsupported.

    ``DPT`` dims per lane keeps ``rows * DPT`` (queries + accumulators in
    registers) near 64; ``D / DPT`` lanes share a token and must divide the
    32-lane warp.  Splits target a few waves of threadgroups over the GPU
    (``TQ_DECODE_BLOCKS``, default 264 = 2 x 132 H200 SMs; measured best of
    264/528/1056 at 512k tokens, with DPT=16, U=4, NW=8 -- docs/benchmarks.md, GPU section).
    """
    dpt = int(getenv("TQ_DECODE_DPT", 0)) or (16 if rows <= 4 else 8 if rows <= 8 else 4)
    dpt = max(dpt, d // 32)
    u = int(getenv("TQ_DECODE_U", 0)) or 4
    pair = int(getenv("TQ_DECODE_PAIR", 0))
    if d % dpt or (d // dpt) & (d // dpt - 1) or rows * dpt > 128 or d > 256:
        return None
    gpw = 32 // (d // dpt)
    nw = int(getenv("TQ_DECODE_NW", 0)) or 8
    while nw > 1 and nw * rows * d * 4 > 40960:  # threadgroup memory budget
        nw //= 2
    step = u * nw * gpw  # tokens one threadgroup covers per loop step
    target = int(getenv("TQ_DECODE_BLOCKS", 264))
    splits = max(1, -(-target // max(1, b_hkv)))
    toks = max(step, -(-n // splits))
    toks = -(-toks // step) * step
    return {"DPT": dpt, "NW": nw, "U": u, "PAIR": pair, "TOKS": toks, "S": -(-n // toks)}


@lru_cache(maxsize=256)
def _meta(*values: int) -> mx.array:
    """Small int32 parameter arrays, cached: building one from Python is a
    host-to-device copy.  (In real decode ``n`` grows every step, so each step
    still uploads one; custom kernels take no scalar arguments, and a
    template argument would recompile per step.)"""
    return mx.array(values, dtype=mx.int32)


@lru_cache(maxsize=None)
def _codebook_arrays(bits: int, dim: int) -> tuple[mx.array, mx.array]:
    """(boundaries, centroids) float32 on the device, made once per width."""
    from .codebooks import codebook

    cb = codebook(bits, dim)
    return cb.boundaries_mx(), cb.centroids_mx()


def _f32(x: mx.array) -> mx.array:
    return x if x.dtype == mx.float32 else x.astype(mx.float32)


def decode_impl(d: int, rows: int = 1) -> str:
    """Which decode kernel runs for head dim ``d`` and ``rows`` query rows per
    kv head: ``"tc8"`` (tensor cores, cache as the A operand, split reduction
    fused; CUDA, d 64/128, rows <= 8: decode), ``"tc"`` (tensor cores, rows
    in tiles of 16: prefill chunks) or ``"simt"`` (the shared-body kernel,
    every backend).  ``TQ_DECODE_IMPL`` = auto|tc8|tc|simt; auto picks the
    tensor-core kernels wherever they apply (tc8 only takes <= 8 rows: more
    rows go to tc even when tc8 is asked for)."""
    want = getenv("TQ_DECODE_IMPL", "auto").strip().lower() or "auto"
    if want not in ("auto", "tc8", "tc", "simt"):
        raise ValueError(f"TQ_DECODE_IMPL={want!r}: choose auto, tc8, tc or simt")
    tc_ok = backend() == "cuda" and d in (64, 128)
    if want in ("tc", "tc8") and not tc_ok:
        raise ValueError(f"TQ_DECODE_IMPL={want} needs CUDA and head dim 64 or 128 (got d={d})")
    if want == "simt" or not tc_ok:
        return "simt"
    if want == "tc" or rows > 8 or (want == "auto" and not TC8_BY_DEFAULT):
        return "tc"
    return "tc8"


# Whether tc8 tiles put their tokens in the order that makes each value
# load read consecutive rows (``TQ_VPERM`` in tq_decode_tc8.inc: half the
# L1 wavefronts per value load); ``TQ_TC8_VPERM`` overrides.
TC8_VPERM = 1
_VPERM_DEFINE = "\n#define TQ_VPERM 1\n"


def _tc8_prelude(nw: int, min_blocks: int, vperm: int) -> str:
    """The header lines a tc8 launch adds (its register cap, its token
    order): one place for the dispatcher and cuda_compile_check.py."""
    return _launch_bounds(nw * 32, min_blocks) + (_VPERM_DEFINE if vperm else "")

# Whether the tc8 kernel loads codes with the L2::256B prefetch hint
# (``TQ_TC8_L2PF`` overrides; measured in the launch-shape sweep).
TC8_L2PF = 0

# Whether auto picks tc8 for decode (validated on the H200: GPU tests and the
# benchmark in docs/benchmarks.md); False falls back to the 16-row-tile kernel.
TC8_BY_DEFAULT = True


def decode_kernel(d: int, capacity: int, rows: int = 1) -> str:
    """The kernel ``decode`` runs for this head dim, cache capacity and row
    count: ``decode_impl``'s choice, except that the tensor-core kernels load
    float16 norms in pairs and so need an even capacity (the cache's is a
    multiple of 256)."""
    return decode_impl(d, rows) if capacity % 2 == 0 else "simt"


def uses_tc(d: int, capacity: int, rows: int = 1) -> bool:
    """Whether ``decode`` runs a tensor-core kernel (tc8 or tc) here."""
    return decode_kernel(d, capacity, rows) != "simt"


TC_LONG_TOKENS = 1 << 18  # from here on a full wave of 3 threadgroups per SM (tc_config)


def tc_config(d: int, rows: int, b_hkv: int, n: int) -> dict:
    """Launch shape of the tensor-core kernel.

    A threadgroup serves one tile of up to 16 query rows (``GL``) of one kv
    head with ``NW`` warps; tokens are split so that about
    ``TQ_TC_BLOCKS`` threadgroups cover the GPU.  Default, from the
    launch-shape sweeps on the H200 (132 SMs; docs/benchmarks.md): 396 (one
    full wave of 3 per SM -- ~150 registers x 128 threads allow 3) from 256k
    tokens on (best of 264-1188 at 512k), 198 below (best of 66-396 at 32k
    and 128k, 17-18% faster than 396 there: every threadgroup first copies
    the 24 KB of pair tables into shared memory, which short splits do not
    amortize).  Prefill chunks bring many row tiles and need no token split.
    """
    gl = min(rows, 16)
    rt = -(-rows // 16)
    nw = int(getenv("TQ_TC_NW", 0)) or 4
    if gl > 8:
        nw = min(nw, 4)  # shared-memory budget of the 16-row reduction
    step = 16 * nw
    target = int(getenv("TQ_TC_BLOCKS", 0)) or (396 if n >= TC_LONG_TOKENS else 198)
    splits = max(1, -(-target // max(1, b_hkv * rt)))
    toks = max(4 * step, -(-n // splits))  # >= 4 tiles per warp: the table copy amortizes
    toks = -(-toks // step) * step
    minb = max(0, int(getenv("TQ_TC_MINBLOCKS", 0)))  # 0: no register cap
    return {"GL": gl, "RT": rt, "NW": nw, "TOKS": toks, "S": -(-n // toks), "MINB": minb}


TC8_BLOCKS = 264  # threadgroups (2 per SM on 132 SMs): best of 264/528/1056 at 32k and 512k
# Warps per threadgroup.  8 (16 warps per SM) against 4: decode attention
# calls in a model run one after another, and there the kernel is latency
# bound -- chained steps took 0.284 against 0.401 ms at 512k tokens and
# 0.100 against 0.164 at 128k (H200 run 20, docs/benchmarks.md).  Timed as
# independent calls, which MLX may run side by side, the two were equal.
TC8_WARPS = 8
# Warps draw 32-token chunks from a counter (``DYN`` in tq_decode_tc8.inc)
# instead of taking equal static splits, which finished 100-167 us apart
# at 512k tokens (benchmarks/tg_timeline.py, H200).  ``TQ_TC8_DYN=0``: static.
TC8_DYN = 1
# Counter words per (batch, kv head): one 128-byte line (split counter, chunk
# counter), so the heads' chunk counters do not share an L2 slice.  Must
# match CNT_WORDS in tq_decode_tc8.inc.
TC8_COUNTER_WORDS = 32
# Counter sets per decode-step plan, used in turn: a step's counters are a
# slot of one array the plan keeps (the kernel leaves them at zero) instead
# of a zero-filled array per step, whose fill node cost up to ~10 us per step
# in dependent chains (H200, gpu_attention.py --chain-check; it varies
# between runs) and put a second node between two launches.  A launch takes
# the output of the launch TC8_COUNTER_RING before it as an (unread) input,
# so MLX orders two launches that share a set: up to TC8_COUNTER_RING
# independent steps of one plan may still run side by side.
TC8_COUNTER_RING = 8


def _tc8_env() -> tuple:
    """The tc8 launch overrides, read once per call (the config is cached on them)."""
    g = getenv
    return (g("TQ_TC8_NW", ""), g("TQ_TC8_BLOCKS", ""), g("TQ_TC8_PF", ""),
            g("TQ_TC8_VC32", ""), g("TQ_TC8_MINBLOCKS", ""), g("TQ_TC8_L2PF", ""), g("TQ_TC8_DYN", ""),
            g("TQ_TC8_VPERM", ""))


def tc8_config(d: int, rows: int, b_hkv: int, n: int, key_bits: int = 3, value_bits: int = 4,
               window: bool = False) -> dict:
    """Launch shape of the tc8 decode kernel and its workspace layout.

    Defaults from the H200 sweeps (docs/benchmarks.md): 8 warps, one tile
    prefetched (``PF``), ~264 threadgroups, and for 3-bit-or-narrower keys
    with 4-bit values the 32-copy value table (``VC32``: no bank conflicts,
    40 KB of tables in shared memory).  128 registers (``MINB`` = 2 resident
    threadgroups of 8 warps caps them) except for 3-bit values, which need
    ~168, run uncapped and keep 4 warps (8 would leave one threadgroup per
    SM).  With ``DYN`` (the default where ``PF`` = 1) the split count only
    sizes the grid: warps draw 32-token chunks of their head from a counter.
    Every split writes a partial state and the last one of its (batch, kv
    head) merges them, so the workspace holds: counters (a 128-byte line per
    (batch, kv head)), the final output and log-sum-exp, and the partials.
    ``window``: the fused decode step (``tq_decode_tc8_fused``), whose extra
    threadgroup per (batch, kv head) attends over the window and writes
    partial slot ``S`` (``SLOTS = S + 1``); it writes its output to its own
    array, so there is no output region.  ``TQ_TC8_*`` override.
    """
    return _tc8_config(d, rows, b_hkv, n, key_bits, value_bits, bool(window), _tc8_env())


@lru_cache(maxsize=4096)
def _tc8_config(d, rows, b_hkv, n, key_bits, value_bits, window, env) -> dict:
    e_nw, e_blocks, e_pf, e_vc32, e_minb, e_l2pf, e_dyn, e_vperm = env
    vperm = int(bool(int(e_vperm) if e_vperm else TC8_VPERM))
    l2pf = int(e_l2pf) if e_l2pf else TC8_L2PF
    nw = int(e_nw or 0) or (4 if value_bits == 3 else TC8_WARPS)
    step = 16 * nw
    target = int(e_blocks or 0) or TC8_BLOCKS
    if window:  # the window's threadgroups count against the target, so the
        # grid is one wave: at 8 warps (2 resident per SM) 264 packed + 8
        # window threadgroups left 8 for a second wave at 512k+ (ncu on the
        # H200: 199.4 us with 272, 200.2 with 264 -- no measurable cost then)
        target -= b_hkv
    splits = max(1, target // max(1, b_hkv))  # rounded down: one wave, no straggler
    toks = max(2 * step, -(-n // splits))  # >= 2 tiles per warp: the table copy amortizes
    toks = -(-toks // step) * step
    S = -(-n // toks)
    slots = S + int(window)
    off_out = TC8_COUNTER_WORDS * b_hkv  # a line of counters per (batch, kv head)
    off_lse = off_out + (0 if window else b_hkv * rows * d)
    off_po = -(-(off_lse + (0 if window else b_hkv * rows)) // 4) * 4
    off_pm = off_po + b_hkv * slots * rows * d
    off_pl = off_pm + b_hkv * slots * rows
    pf = int(e_pf or 0) or 1
    dyn = int(bool(int(e_dyn) if e_dyn else TC8_DYN)) if pf == 1 else 0
    vc32 = int(e_vc32) if e_vc32 else 1
    vc32 = int(bool(vc32) and key_bits <= 3 and value_bits == 4)  # 48 KB of tables at most
    minb = int(e_minb) if e_minb else -1
    if minb < 0:
        minb = 0 if value_bits == 3 or pf > 1 else max(1, 16 // nw)
    return {"NW": nw, "PF": pf, "VC32": vc32, "TOKS": toks, "S": S, "SLOTS": slots, "MINB": minb,
            "OFF_OUT": off_out, "OFF_LSE": off_lse, "OFF_PO": off_po, "OFF_PM": off_pm,
            "OFF_PL": off_pl, "WS": off_pl + b_hkv * slots * rows,
            # the launch arguments that follow from the above (built once, not per step)
            "TEMPLATE": [("D", d), ("BK", key_bits), ("BV", value_bits), ("NW", nw), ("PF", pf),
                         ("VC32", vc32), ("L2PF", int(bool(l2pf))), ("DYN", dyn)],
            "PRELUDE": _tc8_prelude(nw, minb, vperm),
            "VPERM": vperm, "GRID_X": slots * nw * 32}


_PAIR_TABLES: dict = {}


def _tc8_tables(key_centroids: mx.array, key_bits: int, value_centroids: mx.array,
                value_bits: int, cfg: dict) -> list:
    """The two pair tables a tc8 launch reads (32-copy value table where
    ``cfg`` picked it)."""
    return [_pair_table(key_centroids, key_bits),
            _pair_table(value_centroids, value_bits, 32 if cfg["VC32"] else 0)]


def _pair_table(centroids: mx.array, bits: int, copies: int = 0) -> mx.array:
    """The tensor-core kernel's codebook pair table, replicated for its
    shared memory: entry ``e = i0 | i1 << bits`` holds half2(c[i0], c[i1])
    (raw uint32 bits), stored ``copies`` times side by side (32, or 16 for
    256 entries) so each lane reads its own bank.  Built once per codebook
    array on the host; every threadgroup copies it with 16-byte loads."""
    copies = copies or (16 if bits >= 4 else 32)
    key = (id(centroids), bits, copies)
    hit = _PAIR_TABLES.get(key)
    if hit is not None and hit[0] is centroids:
        return hit[1]
    import numpy as np

    c = np.asarray(centroids.astype(mx.float32)).astype(np.float16).view(np.uint16).astype(np.uint32)
    e = np.arange(1 << (2 * bits))
    pairs = c[e & ((1 << bits) - 1)] | (c[e >> bits] << 16)
    table = mx.array(np.repeat(pairs, copies).astype(np.uint32))
    if len(_PAIR_TABLES) > 4096:  # ~24 KB each; one per codec in practice
        _PAIR_TABLES.clear()
    _PAIR_TABLES[key] = (centroids, table)  # holds the array: its id stays unique
    return table


def decode(
    q_rot: mx.array, keys_packed: mx.array, keys_norms: mx.array,
    values_packed: mx.array, values_norms: mx.array,
    key_centroids: mx.array, value_centroids: mx.array,
    n: int, key_bits: int, value_bits: int,
) -> tuple[mx.array, mx.array]:
    """Attention of ``q_rot`` [B, H_kv, R, D] over packed tokens ``[0, n)``.

    ``q_rot`` is rotated and already multiplied by ``scale`` (the kernel
    folds in log2(e) itself).  The packed arrays are the cache's full
    ``[B, H_kv, capacity, words]`` storage (not sliced: a slice would be
    copied to make it contiguous).  Returns ``(out, lse)``: the normalised
    rotated-domain output [B, H_kv, R, Dv] float32 and the natural-log
    log-sum-exp [B, H_kv, R] float32 of the scores.

    On CUDA (head dim 64/128) a tensor-core kernel runs (fp16 operands,
    fp32 accumulation, like fp16 SDPA: ~1e-3 relative error): ``tc8`` for up
    to 8 rows (one launch, the split reduction fused; out and lse are views
    into its workspace), ``tc`` for more; elsewhere the SIMT kernel (fp32
    throughout) and a reduction launch.  ``TQ_DECODE_IMPL`` overrides.
    """
    B, H, R, D = q_rot.shape
    Dv = D  # keys and values share the head dim in the kernel
    if values_packed.shape[-1] != (Dv * value_bits + 31) // 32:
        raise ValueError("decode kernel: values must have the keys' head dim")
    cap = keys_packed.shape[2]
    q = _f32(q_rot)
    inputs = [q, keys_packed, keys_norms, values_packed, values_norms,
              _f32(key_centroids), _f32(value_centroids)]
    impl = decode_kernel(D, cap, R)
    if impl == "tc8":
        cfg = tc8_config(D, R, B * H, n, key_bits, value_bits)
        NW = cfg["NW"]
        meta = _meta(n, cap, cfg["TOKS"], H, cfg["S"], R, cfg["OFF_OUT"], cfg["OFF_LSE"],
                     cfg["OFF_PO"], cfg["OFF_PM"], cfg["OFF_PL"])
        tables = _tc8_tables(key_centroids, key_bits, value_centroids, value_bits, cfg)
        (ws,) = _launch(
            "tq_decode_tc8", prelude=cfg["PRELUDE"], inputs=inputs[:5] + tables + [meta],
            template=cfg["TEMPLATE"], grid=(cfg["GRID_X"], H, B), threadgroup=(NW * 32, 1, 1),
            output_shapes=[(cfg["WS"],)], output_dtypes=[mx.float32],
            init_value=0.0,  # the split counters start at zero
        )
        o0, l0 = cfg["OFF_OUT"], cfg["OFF_LSE"]
        return ws[o0:o0 + B * H * R * D].reshape(B, H, R, D), ws[l0:l0 + B * H * R].reshape(B, H, R)
    if impl == "tc":
        cfg = tc_config(D, R, B * H, n)
        S, NW = cfg["S"], cfg["NW"]
        meta = _meta(n, cap, cfg["TOKS"], H, S, R, cfg["RT"])
        tables = [_pair_table(key_centroids, key_bits), _pair_table(value_centroids, value_bits)]
        po, pm, pl = _launch(
            "tq_decode_tc", prelude=_launch_bounds(NW * 32, cfg["MINB"]), inputs=inputs[:5] + tables + [meta],
            template=[("D", D), ("BK", key_bits), ("BV", value_bits), ("GL", cfg["GL"]), ("NW", NW)],
            grid=(S * NW * 32, H * cfg["RT"], B), threadgroup=(NW * 32, 1, 1),
            output_shapes=[(B, H, S, R, D), (B, H, S, R), (B, H, S, R)],
            output_dtypes=[mx.float32] * 3,
        )
    else:
        cfg = decode_config(D, R, B * H, n)
        if cfg is None:
            raise ValueError(f"decode kernel: unsupported head dim {D} with {R} query rows")
        S, NW = cfg["S"], cfg["NW"]
        meta = _meta(n, cap, cfg["TOKS"], H, S)
        po, pm, pl = _launch(
            "tq_decode", inputs=inputs + [meta],
            template=[("D", D), ("BK", key_bits), ("BV", value_bits), ("GL", R),
                      ("DPT", cfg["DPT"]), ("NW", NW), ("U", cfg["U"]), ("PAIR", cfg["PAIR"])],
            grid=(S * NW * 32, H, B), threadgroup=(NW * 32, 1, 1),
            output_shapes=[(B, H, S, R, D), (B, H, S, R), (B, H, S, R)],
            output_dtypes=[mx.float32] * 3,
        )
    out, lse = _launch(
        "tq_decode_reduce",
        inputs=[po, pm, pl, meta],
        template=[("D", D), ("GL", R)],
        grid=(D, R, B * H), threadgroup=(D, 1, 1),
        output_shapes=[(B, H, R, D), (B, H, R)],
        output_dtypes=[mx.float32] * 2,
    )
    return out, lse


# --------------------------------------------------------------------------
# dequantize (prefill) and quantize-on-append


def dequantize(
    packed: mx.array, norms: mx.array, centroids: mx.array, n: int, bits: int,
    dim: int, dtype: mx.Dtype = mx.float16, mean_rot: Optional[mx.array] = None,
) -> mx.array:
    """Rotated-domain vectors [B, H, n, dim] of packed tokens ``[0, n)``.

    ``norm * centroids[idx] (+ mean_rot)``, written in ``dtype``;
    ``mean_rot`` [B, H, dim] (a rotated per-head mean) is added if given.
    """
    B, H = packed.shape[:2]
    if mean_rot is None:
        mean_rot = mx.zeros((B, H, dim), mx.float32)
    meta = _meta(n, packed.shape[2])
    (out,) = _launch(
        "tq_dequant",
        inputs=[packed, norms, _f32(centroids), _f32(mean_rot).reshape(B, H, dim), meta],
        template=[("D", dim), ("BITS", bits), ("T", dtype)],
        grid=(n * dim, H, B), threadgroup=(256, 1, 1),
        output_shapes=[(B, H, n, dim)], output_dtypes=[dtype],
    )
    return out


def quantize(x: mx.array, codec) -> tuple[mx.array, mx.array]:
    """``codec.quantize(x)`` in one kernel: (packed uint32 [..., words], norms float16 [...]).

    Needs a power-of-two head dim 32..1024 with a Hadamard rotation; the
    result matches the reference codec except where float rounding of the
    rotation moves a coordinate across a codebook boundary (see tests).
    """
    d = codec.dim
    rot = codec.rotation
    if not supports_quantize(codec):
        raise ValueError(
            f"quantize kernel: needs a power-of-two Hadamard dim 32..1024 and norm mode "
            f"preserve|lsq; got {rot!r}, norm_mode={getattr(codec, 'norm_mode', None)!r}"
        )
    lead = x.shape[:-1]
    m = math.prod(lead)
    bounds, cents = _codebook_arrays(codec.bits, d)
    packed, norms = _launch(
        "tq_quantize",
        inputs=[x.reshape(m, d), _f32(rot.signs), bounds, cents],
        template=[("D", d), ("BITS", codec.bits), ("T", x.dtype),
                  ("LSQ", int(getattr(codec, "norm_mode", "preserve") == "lsq"))],
        grid=(m * d, 1, 1), threadgroup=(d, 1, 1),
        output_shapes=[(m, codec.words), (m,)], output_dtypes=[mx.uint32, mx.float16],
    )
    return packed.reshape(*lead, codec.words), norms.reshape(lead)


def quantize_any(x: mx.array, codec) -> tuple[mx.array, mx.array]:
    """The cache's hook: the kernel when dispatch allows it, else ``codec.quantize``."""
    if use_kernels() and supports_quantize(codec):
        return quantize(x, codec)
    return tuple(codec.quantize(x))


def supports_quantize(codec) -> bool:
    """The quantize kernel handles power-of-two dims (32..1024) with a Hadamard
    rotation, in either of the codec's norm modes."""
    d = codec.dim
    return (
        getattr(codec, "norm_mode", "preserve") in ("preserve", "lsq")
        and not getattr(codec, "gain_search", False)  # the kernel has no gain search
        and getattr(codec, "quantizer", "scalar") == "scalar"  # no TCQ (trellis) kernels
        and codec.rotation.uses_hadamard and 32 <= d <= 1024 and (d & (d - 1)) == 0
    )


# --------------------------------------------------------------------------
# attention on the cache


def _centroids(codec) -> mx.array:
    # the codec's own array (not a fresh astype copy): the tensor-core
    # kernel's pair tables are cached per codebook array
    return _f32(codec.centroids)


def _full_mask(mask, n_packed: int, n_window: int, L: int):
    """The mask for one SDPA over ``[history; window]``: None, "causal" or an array."""
    if mask is None or isinstance(mask, str):
        if isinstance(mask, str) and mask != "causal":
            raise ValueError(f"turboquant_attention: unknown mask mode {mask!r}")
        return mask if L > 1 else None  # "causal" is bottom-right aligned in MLX
    cols = mask.shape[-1]
    if cols == n_packed + n_window:
        return mask
    if cols != n_window:
        raise ValueError(
            f"turboquant_attention: mask has {cols} key columns; expected the window "
            f"({n_window}) or packed + window ({n_packed + n_window})"
        )
    pad_shape = (*mask.shape[:-1], n_packed)  # the history precedes every query
    pad = mx.ones(pad_shape, mx.bool_) if mask.dtype == mx.bool_ else mx.zeros(pad_shape, mask.dtype)
    return mx.concatenate([pad, mask], axis=-1)


def _mean(cache, name: str, B: int, H: int) -> Optional[mx.array]:
    """The cache's per-(batch, head) mean [B, H, D] float32, or None."""
    m = getattr(cache, name, None)
    return None if m is None else m.astype(mx.float32).reshape(B, H, -1)


def _value_rotation(cache):
    return getattr(cache, "value_rotation", None) or cache.rotation


_GLUE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _glue(rotation, value_rotation, scale: float, G: int, L: int):
    """Compiled (pre, post) for decode: the ~20 small ops around the kernel
    (rotate q, window attention, log-sum-exp merge, inverse rotation, means)
    fused by ``mx.compile``; cached per rotation object (weakly)."""
    per_rot = _GLUE.setdefault(rotation, {})
    key = (id(value_rotation), float(scale), G, L)
    if key in per_rot:
        return per_rot[key]

    def pre(queries):
        B, H_q, _, D = queries.shape
        q = (queries.astype(mx.float32) * scale).reshape(B, H_q // G, G * L, D)
        return q, rotation.forward(q)

    def post(q, out_p, lse_p, window_keys, window_values, key_mean, value_mean):
        B, H_kv, R, _ = q.shape
        # centred keys lost q·mean_k (a constant per row); normalised packed
        # weights sum to 1, so the value mean comes back once
        lse_p = lse_p[..., None] + q @ key_mean[..., None]
        packed_out = value_rotation.inverse(out_p) + value_mean[:, :, None, :]
        scores = q @ window_keys.astype(mx.float32).swapaxes(-1, -2)
        lse_w = mx.logsumexp(scores, axis=-1, keepdims=True)
        out_w = mx.exp(scores - lse_w) @ window_values.astype(mx.float32)
        m = mx.maximum(lse_p, lse_w)
        a, b = mx.exp(lse_p - m), mx.exp(lse_w - m)
        return ((a * packed_out + b * out_w) / (a + b)).reshape(B, H_kv * G, L, -1)

    per_rot[key] = (mx.compile(pre), mx.compile(post))
    return per_rot[key]


# Whether decode steps run tq_decode_tc8_fused (one launch) where it
# applies; ``TQ_DECODE_FUSED=1|0`` overrides.  Validated on the H200
# (docs/benchmarks.md, session 13).
FUSED_STEP_BY_DEFAULT = True


def _env_switch(name: str, default: bool) -> bool:
    """An on/off setting: unset or empty -> ``default``; 0/off/false -> off."""
    v = getenv(name, "").strip().lower()
    if not v:
        return default
    return v not in ("0", "off", "false")


def fused_step_enabled() -> bool:
    """``TQ_DECODE_FUSED`` (default: ``FUSED_STEP_BY_DEFAULT``): run a whole
    decode step in one launch where :func:`fused_step_supported` allows it."""
    return _env_switch("TQ_DECODE_FUSED", FUSED_STEP_BY_DEFAULT)


def _fused_max_window(queries: mx.array, window_values: mx.array, cache) -> int:
    """The longest window the one-launch step takes for these queries and
    this cache, or 0 where it does not apply at all (switched off, not the
    tc8 kernel, rotations that are not Walsh-Hadamard butterflies, a value
    head dim unlike the key's).  The window's scores share the kernel's
    reduction area: ``R * (D + W) + 24 <= NW * 8 * (D + 2)`` words."""
    if not fused_step_enabled():
        return 0
    B, H_q, L, D = queries.shape
    H_kv = window_values.shape[1]
    R = (H_q // H_kv) * L
    if window_values.shape[-1] != D or decode_kernel(D, cache.keys_norms.shape[2], R) != "tc8":
        return 0
    rot, vrot = cache.rotation, _value_rotation(cache)
    if not (getattr(rot, "is_walsh_hadamard", False) and getattr(vrot, "is_walsh_hadamard", False)):
        return 0
    nw = tc8_config(D, R, B * H_kv, 1, cache.key_codec.bits, cache.value_codec.bits, window=True)["NW"]
    return max(0, (nw * 8 * (D + 2) - 24) // R - D)


def fused_step_config(queries: mx.array, window_keys: mx.array, window_values: mx.array,
                      cache, window_mask) -> Optional[dict]:
    """The launch configuration of ``tq_decode_tc8_fused`` for this decode
    step, or None where it does not apply.  It covers: the tc8 kernel (CUDA,
    head dim 64/128, <= 8 query rows per kv head), no mask over the window,
    Walsh-Hadamard rotations (power-of-two head dim), a non-empty window
    whose scores fit the kernel's shared memory (:func:`_fused_max_window`)."""
    if window_mask is not None:
        return None
    if not 1 <= window_keys.shape[2] <= _fused_max_window(queries, window_values, cache):
        return None
    B, H_q, L, D = queries.shape
    H_kv = window_keys.shape[1]
    return tc8_config(D, (H_q // H_kv) * L, B * H_kv, cache.packed_len, cache.key_codec.bits,
                      cache.value_codec.bits, window=True)


def fused_step_supported(queries: mx.array, window_keys: mx.array, window_values: mx.array,
                         cache, window_mask) -> bool:
    """Whether :func:`decode_step` covers this step (:func:`fused_step_config`)."""
    return fused_step_config(queries, window_keys, window_values, cache, window_mask) is not None


_NO_MEAN = None


def _mean_or_zero(m: Optional[mx.array]):
    """(array, present): a cache mean as float32, or a 1-element dummy."""
    global _NO_MEAN
    if m is not None:
        return _f32(m), 1
    if _NO_MEAN is None:
        _NO_MEAN = mx.zeros((1,), mx.float32)
    return _NO_MEAN, 0


def _float_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", float(x)))[0]


class _StepPlan:
    """What a one-launch decode step is launched with that stays fixed while
    a cache decodes -- the kernel object (its dtype-tagged name, the launch
    shape's constants compiled in), the pair tables, the rotation signs,
    the launch width, the longest
    window it takes, the ring of split-counter sets -- so that a step only
    redoes what moves: the split layout of the packed length and the meta
    array.

    Why: the decisions behind a step (settings, kernel choice, rotation
    type, tables, launch shape) cost ~20 us of Python per call on a slow
    host, against ~30 us for the whole step on the GPU at 32k tokens; the
    plan is built once by the same checks (:func:`fused_step_config`) and
    found again by a key of everything those checks read except the packed
    length and the window length, which are checked per step.

    ``TQ_DECODE_COMPILE=1`` launches through ``mx.compile`` instead (one
    compiled launcher per split layout and window length).  Off by default,
    as measured on the H200 (docs/benchmarks.md, session 14): a replayed
    launch cost 6.6 us of host time against 7.1 us for MLX's direct
    ``cuda_kernel`` call (which converts every argument and re-assembles the
    kernel source each time), 13.1 against 15.1 us for a whole step, but
    each new window length is traced once per layer (~0.3 ms), i.e. ~64
    traces per layer before the saving starts to count -- a loss for
    generations of a few hundred tokens.
    """

    __slots__ = ("kernel", "tables", "signs", "vsigns", "env", "dims", "max_w", "bh", "grid_yz",
                 "tg", "out_shape", "out_dtype", "scale_bits", "means", "per_n", "launchers", "keep",
                 "counters", "slot", "last")

    def __init__(self, queries, window_keys, window_values, cache, scale, max_w: int):
        B, H_q, L, D = queries.shape
        H_kv = window_keys.shape[1]
        R = (H_q // H_kv) * L
        kc, vc = cache.key_codec, cache.value_codec
        self.env = _tc8_env()
        self.dims = (D, R, B * H_kv, kc.bits, vc.bits)
        cfg = _tc8_config(D, R, B * H_kv, 1, kc.bits, vc.bits, True, self.env)
        vrot = _value_rotation(cache)
        self.tables = _tc8_tables(_centroids(kc), kc.bits, _centroids(vc), vc.bits, cfg)
        self.signs, self.vsigns = cache.rotation.signs, vrot.signs
        self.max_w, self.bh = max_w, B * H_kv
        self.grid_yz, self.tg = (H_kv, B), (cfg["NW"] * 32, 1, 1)
        self.out_shape, self.out_dtype = (B, H_q, L, D), queries.dtype
        self.scale_bits = _float_bits(scale)
        self.means = {}  # mean array (by identity) -> (float32 array, present)
        self.per_n = {}  # packed length -> (meta head, (slots, grid x, workspace words))
        self.launchers = {}  # (split slots, window length) -> launcher
        self.keep = (kc, vc, vrot)  # their ids are part of the plan's key
        # The split counters: TC8_COUNTER_RING sets, zeroed once (each launch
        # leaves its set at zero); last[i]: the output of the latest launch
        # on set i, the next one's ordering input (a one-element stand-in of
        # the output dtype before the first).
        self.counters = mx.zeros((TC8_COUNTER_RING * TC8_COUNTER_WORDS * self.bh,), mx.uint32)
        mx.eval(self.counters)
        self.slot = 0
        self.last = [mx.zeros((1,), queries.dtype)] * TC8_COUNTER_RING
        m0 = mx.zeros((1,), mx.float32)  # stand-ins: only the dtypes name the kernel
        probe = [queries, cache.keys_packed, cache.keys_norms, cache.values_packed, cache.values_norms,
                 *self.tables, _meta(0), window_keys, window_values, self.signs, self.vsigns, m0, m0,
                 self.counters, self.last[0]]
        # the launch shape's constants compiled in: no template arguments per call
        self.kernel = _kernel_for("tq_decode_tc8_fused", cfg["PRELUDE"], probe,
                                  [mx.float32, queries.dtype], tuple(cfg["TEMPLATE"]))

    def _mean(self, m):
        hit = self.means.get(id(m))
        if hit is None or hit[0] is not m:
            if len(self.means) > 8:
                self.means.clear()
            hit = self.means[id(m)] = (m, *_mean_or_zero(m))
        return hit[1], hit[2]

    def _launcher(self, slots: int, grid_x: int, ws: int, w: int):
        """f(q, kp, kn, vp, vn, meta, wk, wv, km, vm, cnt, dep) -> out for one split
        layout (grid and workspace size follow the slot count; the rest of
        the layout travels in meta) and window length: one compiled function
        per window length, so each finds its one recorded launch at once
        instead of scanning MLX's list of traced shapes."""
        fn = self.launchers.get((slots, w))
        if fn is not None:
            return fn
        if len(self.launchers) > 1024:
            self.launchers.clear()
        kernel = self.kernel
        ktab, vtab = self.tables
        signs, vsigns = self.signs, self.vsigns
        grid, tg = (grid_x, *self.grid_yz), self.tg
        shapes, dtypes = [(ws,), self.out_shape], [mx.float32, self.out_dtype]

        def launch(q, kp, kn, vp, vn, meta, wk, wv, km, vm, cnt, dep):
            return kernel(
                inputs=[q, kp, kn, vp, vn, ktab, vtab, meta, wk, wv, signs, vsigns, km, vm, cnt, dep],
                grid=grid, threadgroup=tg, output_shapes=shapes, output_dtypes=dtypes,
            )[1]  # no init_value: the kernel writes every element before reading it

        fn = self.launchers[(slots, w)] = mx.compile(launch) if compile_enabled() else launch
        return fn

    def launch(self, queries, window_keys, window_values, cache, n: int) -> mx.array:
        per = self.per_n.get(n)
        if per is None:
            D, R, BH, kb, vb = self.dims
            cfg = _tc8_config(D, R, BH, n, kb, vb, True, self.env)
            if len(self.per_n) > 64:
                self.per_n.clear()
            head = (n, cache.keys_packed.shape[2], cfg["TOKS"], self.grid_yz[0], cfg["SLOTS"], R, 0, 0,
                    cfg["OFF_PO"], cfg["OFF_PM"], cfg["OFF_PL"])
            per = self.per_n[n] = (head, (cfg["SLOTS"], cfg["GRID_X"], cfg["WS"]))
        head, layout = per
        w = window_keys.shape[2]
        fn = self.launchers.get((layout[0], w)) or self._launcher(*layout, w)
        km, has_km = self._mean(getattr(cache, "key_mean", None))
        vm, has_vm = self._mean(getattr(cache, "value_mean", None))
        slot = self.slot
        self.slot = (slot + 1) % TC8_COUNTER_RING
        meta = _meta(*head, w, self.scale_bits, has_km, has_vm, slot * TC8_COUNTER_WORDS * self.bh)
        out = fn(queries, cache.keys_packed, cache.keys_norms, cache.values_packed, cache.values_norms,
                 meta, window_keys, window_values, km, vm, self.counters, self.last[slot])
        self.last[slot] = out
        return out


# Whether the one-launch step goes through mx.compile (``TQ_DECODE_COMPILE``
# overrides); see :class:`_StepPlan` for why it is off.
COMPILE_BY_DEFAULT = False


def compile_enabled() -> bool:
    """``TQ_DECODE_COMPILE`` (default ``COMPILE_BY_DEFAULT``): launch the
    one-launch decode step through ``mx.compile`` (see :class:`_StepPlan`)."""
    return _env_switch("TQ_DECODE_COMPILE", COMPILE_BY_DEFAULT)


# Settings read by the decode dispatch; a plan is only found again under the
# same values (and the module switches below).
_PLAN_ENV = ("TQ_KERNELS", "TQ_DECODE_IMPL", "TQ_DECODE_FUSED", "TQ_DECODE_COMPILE", "TQ_TC8_NW",
             "TQ_TC8_BLOCKS", "TQ_TC8_PF", "TQ_TC8_VC32", "TQ_TC8_MINBLOCKS", "TQ_TC8_L2PF", "TQ_TC8_DYN",
             "TQ_TC8_VPERM")
_PLAN_ENV_KEYS = tuple(n.encode() for n in _PLAN_ENV)
_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # rotation -> {key: plan | None}


def _plan_key(queries, window_keys, window_values, cache, scale) -> tuple:
    env = (tuple(map(_ENV_DATA.get, _PLAN_ENV_KEYS)) if _ENV_DATA is not None
           else tuple(os.environ.get(n) for n in _PLAN_ENV))
    wk, wv = window_keys.shape, window_values.shape
    return (queries.shape, queries.dtype, wk[0], wk[1], wk[3], window_keys.dtype, wv[3],
            window_values.dtype, cache.keys_packed.shape, cache.values_packed.shape,
            cache.keys_norms.dtype, cache.values_norms.dtype, id(cache.key_codec),
            id(cache.value_codec), id(_value_rotation(cache)), scale, mx.default_device() == mx.gpu, env,
            FUSED_STEP_BY_DEFAULT, TC8_BY_DEFAULT, TC8_L2PF, COMPILE_BY_DEFAULT)


def _build_plan(queries, window_keys, window_values, cache, scale) -> Optional[_StepPlan]:
    """The plan for this step's shapes, or None where the one-launch step
    does not apply for reasons that do not change from step to step (the
    checks of :func:`turboquant_attention` and :func:`fused_step_config`
    other than the packed length and the window length)."""
    if not (use_kernels() and _kernel_shape_supported(queries, window_keys, cache)):
        return None
    max_w = _fused_max_window(queries, window_values, cache)
    return _StepPlan(queries, window_keys, window_values, cache, scale, max_w) if max_w >= 1 else None


_NO_PLAN = object()  # not looked up yet (None: looked up, no one-launch step)


def _step_plan(queries, window_keys, window_values, cache, scale) -> Optional[_StepPlan]:
    """The cached plan for this step (built on first use), or None."""
    key = _plan_key(queries, window_keys, window_values, cache, scale)
    try:
        plans = _PLANS.get(cache.rotation)
        if plans is None:
            plans = _PLANS[cache.rotation] = {}
    except TypeError:  # a rotation without weak references: no caching
        return _build_plan(queries, window_keys, window_values, cache, scale)
    plan = plans.get(key, _NO_PLAN)  # one hash of the long key, not two
    if plan is not _NO_PLAN:
        return plan
    if len(plans) > 32:
        plans.clear()
    plan = plans[key] = _build_plan(queries, window_keys, window_values, cache, scale)
    return plan


def _planned_step(queries, window_keys, window_values, cache, scale) -> Optional[mx.array]:
    """A decode step through its cached plan, or None where the one-launch
    step does not cover it (then the general dispatch runs, and decides the
    same way: the plan encodes its decision)."""
    plan = _step_plan(queries, window_keys, window_values, cache, scale)
    n = cache.packed_len
    if plan is None or n <= 0 or not 1 <= window_keys.shape[2] <= plan.max_w:
        return None
    return plan.launch(queries, window_keys, window_values, cache, n)


def decode_step(queries: mx.array, window_keys: mx.array, window_values: mx.array, cache,
                scale: float) -> mx.array:
    """The whole decode attention step in one launch (``tq_decode_tc8_fused``).

    Same result as :func:`_decode_attention` without a mask (rotate q, packed
    history, exact window, log-sum-exp merge, key-mean shift, value mean,
    inverse rotation), but the rotations, the window and the merge run inside
    the split-K kernel: one launch and one graph node per layer instead of
    ~20, which at 8k-128k tokens cost more than the attention itself.
    Callers check :func:`fused_step_supported` first; the launch comes from
    the step's cached :class:`_StepPlan`.
    """
    out = _planned_step(queries, window_keys, window_values, cache, scale)
    if out is None:
        raise ValueError("decode_step: the one-launch step does not cover this call "
                         "(check fused_step_supported first)")
    return out


def _decode_attention(queries, window_keys, window_values, cache, scale, window_mask):
    """Few query rows: the fused split-K kernel for the packed history, merged
    by log-sum-exp with exact attention over the window (as the reference
    path merges its online-softmax state).  Where the one-launch kernel
    covers the step (CUDA), it runs instead of the ops below."""
    if fused_step_supported(queries, window_keys, window_values, cache, window_mask):
        return decode_step(queries, window_keys, window_values, cache, scale)
    B, H_q, L, D = queries.shape
    H_kv = window_keys.shape[1]
    G = H_q // H_kv
    vrot = _value_rotation(cache)
    pre, post = _glue(cache.rotation, vrot, scale, G, L)
    q, q_rot = pre(queries)
    out_p, lse_p = decode(
        q_rot, cache.keys_packed, cache.keys_norms, cache.values_packed, cache.values_norms,
        _centroids(cache.key_codec), _centroids(cache.value_codec),
        cache.packed_len, cache.key_codec.bits, cache.value_codec.bits,
    )
    km = _mean(cache, "key_mean", B, H_kv)
    vm = _mean(cache, "value_mean", B, H_kv)
    km = mx.zeros((B, H_kv, D), mx.float32) if km is None else km
    vm = mx.zeros((B, H_kv, window_values.shape[-1]), mx.float32) if vm is None else vm
    if window_mask is None:
        out = post(q, out_p, lse_p, window_keys, window_values, km, vm)
        return out.astype(queries.dtype)
    # masked window: prefill chunks (tiled kernel) or a masked decode step
    lse_p = lse_p[..., None] + q @ km[..., None]
    packed_out = vrot.inverse(out_p) + vm[:, :, None, :]
    lse_w, out_w = _window_attention(q, window_keys, window_values, window_mask, G, L)
    m = mx.maximum(lse_p, lse_w)
    a, b = mx.exp(lse_p - m), mx.exp(lse_w - m)
    out = (a * packed_out + b * out_w) / (a + b)
    return out.reshape(B, H_q, L, -1).astype(queries.dtype)


WINDOW_SCORES_BYTES = 32 << 20  # float32 scores of one block of window queries


def _window_attention(q, window_keys, window_values, window_mask, G: int, L: int):
    """Exact attention of ``q`` [B, H_kv, G*L, D] (rows g*L + l) over the
    window with its mask, as (log-sum-exp, output) per row, walked over
    blocks of query positions so the float32 scores of a prefill chunk
    (2048 queries x 2k window x 32 heads = 0.5 GB) never exist at once:
    at most ``WINDOW_SCORES_BYTES`` per block."""
    B, H_kv, R, D = q.shape
    W = window_keys.shape[2]
    kT = window_keys.astype(mx.float32).swapaxes(-1, -2)[:, :, None]
    vw = window_values.astype(mx.float32)[:, :, None]
    q5 = q.reshape(B, H_kv, G, L, D)
    step = max(1, WINDOW_SCORES_BYTES // max(1, 4 * B * H_kv * G * W))
    lses, outs = [], []
    for l0 in range(0, L, step):
        l1 = min(L, l0 + step)
        scores = q5[:, :, :, l0:l1] @ kT
        mask = window_mask
        if mask is not None and mask.ndim >= 2 and mask.shape[-2] == L:
            mask = mask[..., l0:l1, :]
        scores = apply_mask(scores, mask)
        lse = mx.logsumexp(scores, axis=-1, keepdims=True)
        lses.append(lse)
        outs.append(mx.exp(scores - lse) @ vw)
        if l1 < L:
            # MLX would otherwise run the independent blocks side by side
            # and hold every block's scores at once (measured: 1.2 GB for a
            # 2048-token chunk); evaluating keeps one block alive.
            mx.eval(lses[-1], outs[-1])
    lse_w = lses[0] if len(lses) == 1 else mx.concatenate(lses, axis=3)
    out_w = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)
    return lse_w.reshape(B, H_kv, R, 1), out_w.reshape(B, H_kv, R, -1)


def _prefill_attention(queries, window_keys, window_values, cache, scale, mask):
    """Many query rows: dequantize the history once (one kernel per tensor,
    means folded in), then a single fused SDPA over ``[history; window]`` in
    the rotated domain -- the matrix units do the tiled attention.  Holds the
    dequantized history (model dtype) for the duration of the call."""
    B, H_q, L, D = queries.shape
    H_kv, W = window_keys.shape[1], window_keys.shape[2]
    P = cache.packed_len
    dtype = queries.dtype
    vrot = _value_rotation(cache)
    km = _mean(cache, "key_mean", B, H_kv)
    vm = _mean(cache, "value_mean", B, H_kv)
    Dv = window_values.shape[-1]
    k_hist = dequantize(
        cache.keys_packed, cache.keys_norms, _centroids(cache.key_codec), P,
        cache.key_codec.bits, D, dtype, None if km is None else cache.rotation.forward(km),
    )
    v_hist = dequantize(
        cache.values_packed, cache.values_norms, _centroids(cache.value_codec), P,
        cache.value_codec.bits, Dv, dtype, None if vm is None else vrot.forward(vm),
    )
    keys = mx.concatenate([k_hist, cache.rotation.forward(window_keys).astype(dtype)], axis=2)
    values = mx.concatenate([v_hist, vrot.forward(window_values).astype(dtype)], axis=2)
    q_rot = cache.rotation.forward(queries).astype(dtype)
    out = mx.fast.scaled_dot_product_attention(
        q_rot, keys, values, scale=scale, mask=_full_mask(mask, P, W, L)
    )
    return vrot.inverse(out).astype(dtype)


def _kernel_shape_supported(queries: mx.array, window_keys: mx.array, cache) -> bool:
    """:func:`kernel_supported` without the packed length (which changes per step)."""
    D = queries.shape[-1]
    return (
        window_keys.shape[-1] == D
        and D in (64, 128, 256)
        and getattr(cache.key_codec, "dim", D) == D
        and getattr(cache.key_codec, "quantizer", "scalar") == "scalar"  # kernels decode
        and getattr(cache.value_codec, "quantizer", "scalar") == "scalar"  # scalar codes only
    )


def kernel_supported(queries: mx.array, window_keys: mx.array, cache) -> bool:
    """Whether the kernels cover this call (else the reference path runs)."""
    return cache.packed_len > 0 and _kernel_shape_supported(queries, window_keys, cache)


def prefill_rows() -> int:
    """Query rows per kv head above which the dequantize + SDPA path runs."""
    return int(getenv("TQ_PREFILL_ROWS", 16))


def prefill_dequant_limit() -> int:
    """Largest temporary (bytes) the dequantize + SDPA prefill path may hold.

    That path materialises one layer's history in the model dtype (keys and
    values, then once more joined with the window).  Up to this size it is
    the fast path (1.05x fp16 prefill at 128k tokens on the H200); past it the
    blockwise reference path runs instead, whose extra memory is one block,
    so no call ever holds a whole-cache temporary.  ``TQ_PREFILL_DEQUANT_MB``
    sets it (default 256 MiB: 32k tokens x 8 kv heads x d=128 in fp16, keys
    and values, counting the concatenated copy).
    """
    return int(float(getenv("TQ_PREFILL_DEQUANT_MB", 256)) * 2**20)


def prefill_dequant_bytes(queries: mx.array, window_keys: mx.array, cache) -> int:
    """Bytes of the dequantized [history; window] keys + values, twice (concat)."""
    B, H_kv, W, D = window_keys.shape
    itemsize = queries.dtype.size
    return 2 * 2 * B * H_kv * (cache.packed_len + W) * D * itemsize


def turboquant_attention(
    queries: mx.array, window_keys: mx.array, window_values: mx.array, cache,
    scale: float, mask=None, sinks: Optional[mx.array] = None,
) -> mx.array:
    """Drop-in for ``turboquant.attention.turboquant_attention`` using the kernels.

    On CUDA the tensor-core kernels serve decode (tc8) and prefill chunks
    (tc: query rows in tiles of 16), read straight from the packed codes.
    Elsewhere few query rows per kv head (decode) run the split-K SIMT
    kernel; many rows (prefill chunks) or a mask that reaches into the packed
    history run dequantize + SDPA while its temporary fits ``prefill_dequant_limit()``,
    and the blockwise reference path beyond that.  Falls back to the reference path when the kernels are
    off (``TQ_KERNELS``), there is no packed history, or the shape is not
    covered.
    """
    if mask is None and sinks is None and backend() == "cuda":
        out = _planned_step(queries, window_keys, window_values, cache, scale)
        if out is not None:  # the one-launch decode step (CUDA)
            return out
    from . import attention

    if sinks is not None or not use_kernels() or not kernel_supported(queries, window_keys, cache):
        return attention.turboquant_attention(
            queries, window_keys, window_values, cache, scale, mask, sinks
        )
    B, H_q, L, D = queries.shape
    H_kv, W = window_keys.shape[1], window_keys.shape[2]
    packed_mask, window_mask = split_mask(mask, L, cache.packed_len, W)
    rows = (H_q // H_kv) * L
    # The tensor-core kernel tiles any number of query rows (prefill chunks
    # too) straight from the packed codes: no dequantized history at all.
    tiled = packed_mask is None and uses_tc(D, cache.keys_norms.shape[2], rows)
    if not tiled and (
        packed_mask is not None or rows > prefill_rows() or decode_config(D, rows, B * H_kv, 1) is None
    ):
        if prefill_dequant_bytes(queries, window_keys, cache) > prefill_dequant_limit():
            return attention.turboquant_attention(
                queries, window_keys, window_values, cache, scale, mask, sinks
            )
        return _prefill_attention(queries, window_keys, window_values, cache, scale, mask)
    if window_mask is not None:
        window_mask = as_5d(window_mask, B, H_kv, H_q // H_kv)
    return _decode_attention(queries, window_keys, window_values, cache, scale, window_mask)
