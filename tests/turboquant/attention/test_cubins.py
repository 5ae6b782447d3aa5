"""CUDA kernels kept per machine (turboquant/attention/cubins.py): the
translation unit, the store, compile-once-then-read, and the fall back to
MLX's JIT.  No GPU here: NVRTC and the launch are stand-ins, except in the
test that compiles a real cubin where NVRTC is configured."""

from __future__ import annotations

import os

import mlx.core as mx
import pytest

from turboquant.attention import cubins, sources


class FakeNvrtc:
    """Records compiles; returns ``b"CUBIN:" + symbol`` (or fails)."""

    def __init__(self, fail=False):
        self.compiled, self.fail = [], fail

    def version(self):
        return "13.0"

    def compile(self, source, name, arch, include_dirs, extra=()):
        self.compiled.append((name, arch, source))
        return (None, "error: boom") if self.fail else (b"CUBIN:" + name.encode(), "")


@pytest.fixture
def launches(monkeypatch):
    """``mx.fast.precompiled_cuda_kernel`` as a recorder returning zeros."""
    calls = []

    def launch(**kw):
        calls.append(kw)
        return [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", launch)
    return calls


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setattr(cubins, "_store", tmp_path / "kernels")
    return tmp_path / "kernels"


# tq_quantize's buffers as the CUDA backend types them
QUANTIZE_INPUTS = [("x", "float16"), ("signs", "float32"), ("bounds", "float32"), ("cents", "float32"),
                   ("alphas", "float32")]


def quantize_kernel(nvrtc, fallback=None):
    header, body = sources.mlx_source("tq_quantize", "cuda")
    tools = cubins.Toolchain(nvrtc, ("/nowhere",), "sm_90")
    fallback = fallback or (lambda: pytest.fail("fell back to MLX's JIT"))
    return cubins.CubinKernel("tq_quantize", header, body,
                              QUANTIZE_INPUTS,
                              [("packed", "uint32"), ("norms", "float16")], tools, fallback)


def launch_quantize(kernel, d=128, dtype=mx.float16):
    x = mx.zeros((4, d), dtype)
    return kernel(inputs=[x, x, x, x, x], template=[("D", d), ("BITS", 3), ("NA", 9), ("UNBIASED", 0), ("T", dtype)],
                  grid=(4 * d, 1, 1), threadgroup=(d, 1, 1), output_shapes=[(4, 12), (4,)],
                  output_dtypes=[mx.uint32, mx.float16])


def test_translation_unit_is_what_mlx_would_build_with_a_c_symbol():
    text = cubins.translation_unit("k_1", "// header\n", "out[0] = x[0];", [("x", mx.float16), ("m", "int32")],
                                   [("out", mx.bfloat16)], [("D", 128), ("F", True), ("T", mx.float32)])
    assert text.startswith(cubins.PREAMBLE) and "// header" in text
    assert 'extern "C" __global__ void k_1(\n    const __half* x,\n    const int32_t* m,\n    __nv_bfloat16* out) {' in text
    assert "constexpr int D = 128;" in text and "constexpr bool F = true;" in text and "using T = float;" in text
    assert text.rstrip().endswith("out[0] = x[0];\n}")


def test_a_body_using_mlx_shape_arguments_is_refused():
    """MLX's JIT passes ``x_shape`` and the like when a body names them; a
    precompiled kernel gets only the arrays, so such a body must not compile here."""
    with pytest.raises(ValueError, match="x_shape"):
        cubins.translation_unit("k", "", "int n = x_shape[0];", [("x", "float32")], [("o", "float32")])
    cubins.translation_unit("k", "", "int n = xx_shape[0];", [("x", "float32")], [("o", "float32")])


def test_symbols_differ_by_source_dtype_and_template():
    base = ("tq_x", "", "body;", [("x", "float16")], [("o", "float32")], [("D", 128)])
    symbols = {cubins.named_unit(*base)[0],
               cubins.named_unit("tq_x", "", "body2;", *base[3:])[0],
               cubins.named_unit("tq_x", "", "body;", [("x", "float32")], *base[4:])[0],
               cubins.named_unit(*base[:5], [("D", 64)])[0]}
    assert len(symbols) == 4 and all(s.startswith("tq_x_") for s in symbols)
    symbol, text = cubins.named_unit(*base)
    assert f"void {symbol}(" in text and cubins.named_unit(*base) == (symbol, text)


def test_a_stored_cubin_reads_back_and_a_damaged_one_does_not(tmp_path):
    path = tmp_path / "a" / "k.cubin"
    cubins.write_cubin(path, b"\x7fELF" + bytes(range(200)))
    assert cubins.read_cubin(path) == b"\x7fELF" + bytes(range(200))
    assert [p.name for p in path.parent.iterdir()] == ["k.cubin"]  # no temp file left
    data = path.read_bytes()
    path.write_bytes(data[:-10])  # truncated
    assert cubins.read_cubin(path) is None
    path.write_bytes(data[:40] + b"X" + data[41:])  # one byte altered
    assert cubins.read_cubin(path) is None
    assert cubins.read_cubin(tmp_path / "missing.cubin") is None


def test_compiled_once_per_machine_then_read_from_the_store(store, launches):
    nvrtc = FakeNvrtc()
    first = quantize_kernel(nvrtc)
    launch_quantize(first)
    launch_quantize(first)
    assert len(nvrtc.compiled) == 1  # once per process ...
    symbol, arch, source = nvrtc.compiled[0]
    assert arch == "sm_90" and f'extern "C" __global__ void {symbol}(' in source and "using T = __half;" in source
    assert launches[-1]["name"] == symbol and launches[-1]["compiled_source"] == b"CUBIN:" + symbol.encode()
    assert launches[-1]["ensure_row_contiguous"] is True and launches[-1]["scalars"] == []
    assert (store / "sm_90-nvrtc13.0" / f"{symbol}.cubin").is_file()

    again = FakeNvrtc()  # ... and once per machine: a new process reads it
    launch_quantize(quantize_kernel(again))
    assert again.compiled == [] and launches[-1]["compiled_source"] == b"CUBIN:" + symbol.encode()

    launch_quantize(quantize_kernel(again), d=64, dtype=mx.float32)  # another template: its own cubin
    assert len(again.compiled) == 1 and launches[-1]["name"] != symbol

    x = mx.zeros((4, 128), mx.float16)  # a stream given reaches the launch
    first(inputs=[x] * 4, template=[("D", 128), ("BITS", 3), ("T", mx.float16)], grid=(32, 4, 1),
          threadgroup=(32, 1, 1), output_shapes=[(4, 12), (4,)], output_dtypes=[mx.uint32, mx.float16],
          stream=mx.cpu)
    assert launches[-1]["stream"] == mx.cpu


def test_a_damaged_store_file_is_compiled_again(store, launches):
    launch_quantize(quantize_kernel(FakeNvrtc()))
    (path,) = (store / "sm_90-nvrtc13.0").iterdir()
    path.write_bytes(path.read_bytes()[:-3])
    nvrtc = FakeNvrtc()
    launch_quantize(quantize_kernel(nvrtc))
    assert len(nvrtc.compiled) == 1 and cubins.read_cubin(path) == launches[-1]["compiled_source"]


def test_a_unit_that_does_not_compile_runs_on_mlx_jit(store, launches, caplog):
    jit_calls = []

    def jit():
        return lambda **kw: jit_calls.append(kw) or [mx.zeros((1,))]

    kernel = quantize_kernel(FakeNvrtc(fail=True), fallback=jit)
    launch_quantize(kernel)
    launch_quantize(kernel)
    assert launches == [] and len(jit_calls) == 2
    assert jit_calls[0]["template"] == [("D", 128), ("BITS", 3), ("NA", 9), ("UNBIASED", 0), ("T", mx.float16)]
    assert "did not compile" in caplog.text and "boom" in caplog.text
    assert not (store / "sm_90-nvrtc13.0").exists()


def test_an_unwritable_store_still_launches(tmp_path, monkeypatch, launches, caplog):
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(cubins, "_store", tmp_path / "file")  # not a folder
    nvrtc = FakeNvrtc()
    launch_quantize(quantize_kernel(nvrtc))
    assert len(launches) == 1 and "cannot keep" in caplog.text


def test_the_cuda_backend_builds_cubin_kernels_where_the_toolchain_is_found(monkeypatch):
    from packed_fixtures import RecordingKernel, cuda_stand_in

    log = []
    tools = cubins.Toolchain(FakeNvrtc(), ("/nowhere",), "sm_90")
    f16, f32 = mx.zeros((2,), mx.float16), mx.zeros((2,), mx.float32)
    with cuda_stand_in(monkeypatch, lambda name, **kw: RecordingKernel(name, log)):
        monkeypatch.setattr(cubins, "toolchain", lambda: tools)
        k = sources.kernel_for("tq_quantize", "", [f16, f32, f32, f32, f32], [mx.uint32, mx.float16])
        assert isinstance(k, cubins.CubinKernel) and k.tools is tools
        assert k.inputs == (("x", "float16"), ("signs", "float32"), ("bounds", "float32"), ("cents", "float32"),
                            ("alphas", "float32"))
        assert k.outputs == (("packed", "uint32"), ("norms", "float16"))
        sources.clear_cache()
        monkeypatch.setattr(cubins, "toolchain", lambda: None)
        k = sources.kernel_for("tq_quantize", "", [f16, f32, f32, f32, f32], [mx.uint32, mx.float16])
        assert isinstance(k, RecordingKernel)  # MLX's JIT


def test_no_toolchain_without_a_cuda_gpu():
    if cubins.gpu_arch() is not None:
        pytest.skip("a CUDA GPU is present")
    cubins.toolchain.cache_clear()
    assert cubins.toolchain() is None


@pytest.mark.skipif(not os.environ.get("NVRTC_LIB"), reason="NVRTC not configured (see scripts/cuda_compile_check.py)")
def test_nvrtc_builds_a_cubin_that_exports_the_symbol(store, launches):
    includes = [os.environ["CUDA_INCLUDE"]] if os.environ.get("CUDA_INCLUDE") else cubins.cuda_include_dirs()
    nvrtc = cubins.Nvrtc.load(os.environ["NVRTC_LIB"])
    header, body = sources.mlx_source("tq_quantize", "cuda")
    kernel = cubins.CubinKernel("tq_quantize", header, body,
                                QUANTIZE_INPUTS,
                                [("packed", "uint32"), ("norms", "float16")],
                                cubins.Toolchain(nvrtc, tuple(includes), "sm_90"), lambda: pytest.fail("JIT"))
    launch_quantize(kernel)
    cubin, symbol = launches[-1]["compiled_source"], launches[-1]["name"]
    assert cubin[:4] == b"\x7fELF" and symbol.encode() + b"\0" in cubin  # unmangled: MLX finds it by name


@pytest.mark.parametrize("outcome", ["right", "wrong", "raises", "no compile"])
def test_the_toolchain_is_used_only_after_its_probe_kernel_computes_right(store, monkeypatch, caplog, outcome):
    def launch(**kw):
        if outcome == "raises":
            raise RuntimeError("Failed to load compiled kernel")
        (x,) = kw["inputs"]
        assert kw["name"].startswith("tq_probe_") and kw["grid"] == (64, 1, 1)
        return [2 * x + 1 if outcome == "right" else x]

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", launch)
    tools = cubins.Toolchain(FakeNvrtc(fail=outcome == "no compile"), ("/nowhere",), "sm_90")
    assert cubins.probe(tools) is (outcome == "right")
    warned = "did not compile" if outcome == "no compile" else "failed its check"
    assert (warned in caplog.text) is (outcome != "right")
