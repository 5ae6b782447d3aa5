"""Kernel sources (turboquant/attention/sources.py, metal/): assembly per backend, the shared-body rule."""

from __future__ import annotations

import os
import re

import mlx.core as mx
import pytest

from turboquant.attention import sources, table
from turboquant.attention.sources import KERNELS, SHARED_KERNELS, SOURCE_DIR

CUDA_ONLY = [k for k in KERNELS if KERNELS[k].cuda_only]


@pytest.mark.parametrize("be", ["metal", "cuda"])
@pytest.mark.parametrize("name", SHARED_KERNELS)
def test_shared_kernels_assemble_for_both_backends(be, name):
    header, body = sources.kernel_source(name, be)
    assert "TQ_BARRIER" in header and "tq_window" in header and "struct tq_split_params" in header
    own = (SOURCE_DIR / f"{name}.inc").read_text()
    assert body.endswith(own) and body.index("const int tq_tid") < body.index(own)
    if be == "metal":
        # MLX adds Metal thread attributes only for names found in the body.
        assert "thread_position_in_threadgroup" in body and "#include <metal_stdlib>" in header
        assert "mma.sync" not in header  # no tensor-core helpers in what Apple GPUs compile
    else:
        assert "threadIdx.x" in body and "__shfl_xor_sync" in header
        assert not re.search(r"\buint\b", header + body)  # CUDA has no 'uint'


@pytest.mark.parametrize("name", SHARED_KERNELS)
def test_metal_flavour_builds_its_source_strings(name):
    """No Metal compiler here: the strings MLX would hand to metal_kernel must
    still assemble (comments stripped, constants in place)."""
    header, body = sources.mlx_source(name, "metal", consts=(("D", 128),))
    assert body.startswith("constexpr int D = 128;\n") and "//" not in header + body


@pytest.mark.parametrize("name", SHARED_KERNELS)
def test_bodies_are_backend_neutral(name):
    """What Apple GPUs would compile is the text NVIDIA GPUs run: no backend tokens."""
    body = (SOURCE_DIR / f"{name}.inc").read_text()
    common = (SOURCE_DIR / "tq_common.h").read_text()
    for text in (body, common):
        for token in ("__syncthreads", "threadIdx", "blockIdx", "__shfl", "threadgroup_barrier",
                      "simd_", "thread_position", "__half", "device float", "metal::", "uint "):
            assert token not in text, f"{token!r} in shared source of {name}"


@pytest.mark.parametrize("name", CUDA_ONLY)
def test_tensor_core_kernels_are_cuda_only_and_live_in_metal_cuda(name):
    assert all(b.startswith("cuda/") for b in KERNELS[name].bodies)
    header, _ = sources.kernel_source(name, "cuda")
    assert "mma.sync" in header and "struct tq_tc8_params" in header
    with pytest.raises(ValueError, match="CUDA only"):
        sources.kernel_source(name, "metal")


def test_unknown_backend_and_missing_source(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="'metal' or 'cuda'"):
        sources.kernel_source("tq_decode", "rocm")
    monkeypatch.setattr(sources, "SOURCE_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="kernel source missing: .*backend_cuda.h"):
        sources.kernel_source("tq_decode", "cuda")


def test_fused_step_is_the_tc8_body_with_the_switch_on():
    header, body = sources.kernel_source("tq_decode_tc8_fused", "cuda")
    plain_header, plain = sources.kernel_source("tq_decode_tc8", "cuda")
    assert body == plain  # one body: the fused step is a compile-time switch of tq_decode_tc8
    assert "#define TC8_FUSED 1" in header and "#define TC8_FUSED" not in plain_header
    assert body.count("#if TC8_FUSED") >= 4  # rotate q, window slot, merge, epilogue


def test_tc8_counter_stride_matches_the_table():
    _, body = sources.kernel_source("tq_decode_tc8", "cuda")
    assert f"constexpr int CNT_WORDS = {table.TC8_COUNTER_WORDS};" in body
    assert table.TC8_COUNTER_WORDS * 4 == 128  # a line per (batch, kv head)


def test_table_copies_match_the_kernel():
    """The host builds the pair tables with as many copies as the kernels' CK
    and CV read; the tables and the fused step's query scratch fit 48 KB of
    static shared memory; and a table keeps 32 copies (no bank conflicts)
    wherever that fits."""
    for kernel in ("tq_decode_tc8", "tq_decode_tc"):
        _, body = sources.kernel_source(kernel, "cuda")
        assert "constexpr bool ALL32 = (EK + EV) * 32 * 4 <= 40960;" in body
        assert "constexpr int CK = ALL32 || EK < 256 ? 32 : 16;" in body
        assert "constexpr int CV = ALL32 || EV < 256 ? 32 : 16;" in body
    for bk in (1, 2, 3, 4):
        for bv in (1, 2, 3, 4):
            ek, ev = 1 << (2 * bk), 1 << (2 * bv)
            all32 = (ek + ev) * 32 * 4 <= 40960
            copies = table.table_copies(bk, bv)
            assert copies == ((32 if all32 or ek < 256 else 16), (32 if all32 or ev < 256 else 16))
            assert (ek * copies[0] + ev * copies[1]) * 4 + 8 * 128 * 4 <= 48 << 10
            if (ek * 32 + ev * 32) * 4 + 8 * 128 * 4 <= 48 << 10:
                assert copies == (32, 32)
    assert table.table_copies(4, 3) == (32, 32)  # the 3.5-bit default
    assert table.table_copies(4, 4) == (16, 16)


def test_the_smaller_pair_table_comes_first():
    """Both tensor-core kernels put the smaller table at byte 0, so the other
    starts at most 16 KB in: an LDS immediate every ptxas folds (MLX 0.32.4's
    CUDA JIT did not fold 32 KB, the 4/3 default's value-table offset when
    keys came first: one more instruction per lookup)."""
    header, tc8 = sources.kernel_source("tq_decode_tc8", "cuda")
    assert "return key_bytes <= value_bytes ? 0u : (unsigned int)value_bytes;" in header
    assert "return key_bytes <= value_bytes ? (unsigned int)key_bytes : 0u;" in header
    assert "KT_OFF = tq_key_table_at(KT, VT), VT_OFF = tq_value_table_at(KT, VT);" in tc8
    _, tc = sources.kernel_source("tq_decode_tc", "cuda")
    assert "KOFF = tq_key_table_at(4 * EK * CK, 4 * EV * CV);" in tc
    assert "VOFF = tq_value_table_at(4 * EK * CK, 4 * EV * CV);" in tc
    assert "tq_lds(smem, KOFF + ((e << KSH) | kl4))" in tc
    for bk in (1, 2, 3, 4):
        for bv in (1, 2, 3, 4):
            ck, cv = table.table_copies(bk, bv)
            kt, vt = (1 << (2 * bk)) * ck * 4, (1 << (2 * bv)) * cv * 4
            assert min(kt, vt) <= 16 << 10


def test_parameter_structs_match_the_host_layout():
    common = (SOURCE_DIR / "tq_common.h").read_text()
    split = re.search(r"struct tq_split_params \{(.*?)\};", common, re.S).group(1)
    tc8 = re.search(r"struct tq_tc8_params \{(.*?)\};", common, re.S).group(1)
    fields = lambda s: re.findall(r"int (\w+);", s)  # noqa: E731
    assert fields(split) == ["n", "capacity", "toks", "hkv", "splits", "rows", "row_tiles"]
    assert len(fields(tc8)) == 16 and fields(tc8)[15] == "counter_offset" and fields(tc8)[11] == "window"
    assert "none of these" in common.lower() or "None of these" in common  # not compiled for Metal yet


def test_no_source_file_is_long_and_none_keeps_history():
    for path in list(SOURCE_DIR.rglob("*.inc")) + list(SOURCE_DIR.rglob("*.h")):
        text = path.read_text()
        assert len(text.splitlines()) <= 600, path
        assert not re.search(r"\b(session|run) \d+", text), path


def test_kernel_names_carry_the_dtypes(monkeypatch):
    """MLX caches compiled kernels by name (and CUDA ones on disk): a kernel
    built for float16 inputs must not be found again for float32 ones."""
    from packed_fixtures import RecordingKernel, cuda_stand_in

    log = []
    with cuda_stand_in(monkeypatch, lambda name, **kw: RecordingKernel(name, log)):
        f16, f32 = mx.zeros((2,), mx.float16), mx.zeros((2,), mx.float32)
        a = sources.kernel_for("tq_quantize", "", [f16, f32, f32, f32, f32], [mx.uint32, mx.float16])
        b = sources.kernel_for("tq_quantize", "", [f32, f32, f32, f32, f32], [mx.uint32, mx.float16])
        c = sources.kernel_for("tq_quantize", "", [f16, f32, f32, f32, f32], [mx.uint32, mx.float16])
        d = sources.kernel_for("tq_quantize", "", [f16, f32, f32, f32, f32], [mx.uint32, mx.float32])
    assert a is c and len({a.name, b.name, d.name}) == 3
    assert all(k.name.startswith("tq_quantize_") for k in (a, b, d))


@pytest.mark.skipif(not os.environ.get("NVRTC_LIB"), reason="NVRTC not configured (see scripts/cuda_compile_check.py)")
def test_cuda_sources_compile_with_nvrtc():
    import sys

    sys.path.insert(0, str(SOURCE_DIR.parent / "scripts"))
    from cuda_compile_check import CASES, case_source, compile_cuda

    for name, ins, outs, tmpl in CASES:
        ok, log = compile_cuda(case_source(name, ins, outs, dict(tmpl)), name)
        assert ok, f"{name} {tmpl}:\n{log}"
        # 4-bit keys at d=128 under the 128-register cap keep a few bytes on
        # the stack (4/4: 4 bytes; 4/3: 16-24 bytes, measured faster than
        # running uncapped at 4 warps: turboquant/attention/table.py)
        t = dict(tmpl)
        spills_allowed = t.get("MINB") and t["D"] == 128 and t["BK"] == 4 and t["BV"] in (3, 4)
        assert spills_allowed or "0 bytes spill stores" in log, log


def test_the_quantize_kernel_gets_the_codecs_scale_search(monkeypatch):
    """The kernel searches the scales the reference codec searches: the
    launch passes ``codec.SCALE_SEARCH`` itself and its length as NA."""
    from packed_fixtures import RecordingKernel, cuda_stand_in

    from turboquant.attention import cubins, launchers
    from turboquant.codec import SCALE_SEARCH, TurboQuantCodec
    from turboquant.rotation import HadamardRotation

    log = []
    monkeypatch.setattr(cubins, "toolchain", lambda: None)  # MLX's JIT path: the stand-in records it
    with cuda_stand_in(monkeypatch, lambda name, **kw: RecordingKernel(name, log)):
        launchers.quantize(mx.zeros((3, 64), mx.float16), TurboQuantCodec(64, 3, HadamardRotation(64, 1)))
    (name, kw), = log
    assert name.startswith("tq_quantize")
    assert ("NA", len(SCALE_SEARCH)) in kw["template"] and len(SCALE_SEARCH) > 1
    assert kw["inputs"][-1].tolist() == pytest.approx(list(SCALE_SEARCH))
    assert ("UNBIASED", 0) in kw["template"]
    log.clear()
    with cuda_stand_in(monkeypatch, lambda name, **kw: RecordingKernel(name, log)):
        launchers.quantize(mx.zeros((3, 64), mx.float16), TurboQuantCodec(64, 3, unbiased=True))
    assert ("UNBIASED", 1) in log[0][1]["template"]
