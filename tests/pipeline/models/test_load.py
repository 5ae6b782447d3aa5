"""The model loader: defaults per job kind, detection, CPU preparation, cache, errors."""

import json
import multiprocessing as mp
import shutil
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from fixtures_models import *  # noqa: F401,F403
from pipeline.models import load as models, store as model_cache
from pipeline.models.load import BUILTIN_TEXT, BUILTIN_VLM, ModelLoadError, is_vlm_config, load_model


def _dtypes(module: nn.Module) -> set:
    return {v.dtype for _, v in tree_flatten(module.parameters())}


# --- defaults -----------------------------------------------------------------


def test_text_jobs_default_to_smollm2(smollm2_model, smollm2_dir):
    m = smollm2_model
    assert (m.kind, m.name) == ("text", BUILTIN_TEXT)
    assert m.config == json.loads((smollm2_dir / "config.json").read_text())
    assert m.processor is m.tokenizer
    assert 2 in m.tokenizer.eos_token_ids  # <|im_end|>
    assert m.tokenizer.decode(m.tokenizer.encode("Page 12 of 40")) == "Page 12 of 40"


def test_tiny_vlm_by_name(tiny_vlm_model):
    m = tiny_vlm_model
    assert (m.kind, m.name) == ("vlm", BUILTIN_VLM)
    assert m.config["model_type"] == "qwen2_vl"
    assert hasattr(m.processor, "image_processor")
    im_end, eot = m.tokenizer.encode("<|im_end|>")[0], m.tokenizer.encode("<|endoftext|>")[0]
    assert {im_end, eot} <= set(m.tokenizer.eos_token_ids)


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="CPU preparation only")
def test_cpu_models_are_float32_and_dequantized(smollm2_model, tiny_vlm_model):
    # SmolLM2 is stored 4/8-bit, the tiny VLM float16: both run in float32 here.
    assert _dtypes(smollm2_model.model) == {mx.float32}
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for m in smollm2_model.model.modules())
    assert _dtypes(tiny_vlm_model.model) == {mx.float32}


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="CPU preparation only")
def test_keep_quantized_opt_out(monkeypatch):
    layer = nn.Linear(64, 32)
    model = nn.Sequential(layer)
    nn.quantize(model, group_size=32, bits=4)
    monkeypatch.setenv("TQPIPE_CPU_KEEP_QUANTIZED", "1")
    models.prepare_for_device(model)
    assert isinstance(model.layers[0], nn.QuantizedLinear)
    assert model.layers[0].scales.dtype == mx.float32
    monkeypatch.delenv("TQPIPE_CPU_KEEP_QUANTIZED")
    models.prepare_for_device(model)
    assert type(model.layers[0]) is nn.Linear and model.layers[0].weight.dtype == mx.float32


def test_gpu_models_keep_their_dtype_and_quantization(monkeypatch):
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 32))
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda path, m: path == "layers.0")
    monkeypatch.setattr(models.mx, "default_device", lambda: mx.Device(mx.gpu))
    models.prepare_for_device(model)
    assert isinstance(model.layers[0], nn.QuantizedLinear)
    assert model.layers[1].weight.dtype == mx.bfloat16


def test_local_directory_is_detected_as_vlm(tiny_vlm_dir):
    m = load_model(str(tiny_vlm_dir), needs_images=True)
    assert (m.kind, m.name) == ("vlm", str(tiny_vlm_dir))


def test_builtin_names_are_accepted(tiny_vlm_dir):
    assert load_model(BUILTIN_VLM).kind == "vlm"


@pytest.mark.parametrize(
    "config, vlm",
    [
        ({"model_type": "llama"}, False),
        ({"model_type": "qwen2"}, False),  # mlx-vlm also has qwen2, but it is text
        ({"model_type": "qwen2_vl", "vision_config": {"depth": 2}}, True),
        ({"model_type": "llava"}, True),  # only mlx-vlm implements it
        ({"model_type": "mistral3", "vision_config": {}}, False),  # empty means none
    ],
)
def test_is_vlm_config(config, vlm):
    assert is_vlm_config(config) is vlm


# --- errors -----------------------------------------------------------------


def test_text_model_asked_for_images(smollm2_dir):
    with pytest.raises(ModelLoadError, match=r"text-only.*needs page images") as e:
        load_model(str(smollm2_dir), needs_images=True)
    assert str(smollm2_dir) in str(e.value)


def test_vlm_without_mlx_vlm_names_the_extra(tmp_path, monkeypatch):
    module_exists = models._module_exists
    monkeypatch.setattr(models, "_module_exists", lambda name: not name.startswith("mlx_vlm") and module_exists(name))
    with pytest.raises(ModelLoadError, match=r"builtin:tiny-qwen2-vl.*pip install 'tqpipe\[vlm\]'"):
        load_model(BUILTIN_VLM, needs_images=True)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "vision_config": {"depth": 2}}))
    with pytest.raises(ModelLoadError, match=r"needs mlx-vlm, which is not installed: pip install 'tqpipe\[vlm\]'") as e:
        load_model(str(tmp_path))
    assert str(tmp_path) in str(e.value)


def test_warming_builds_the_vlm_only_with_mlx_vlm(monkeypatch, capsys):
    """``python -m pipeline.models`` on a node without the vlm extra (a Ray
    worker with ``tqpipe[ray]``) warms SmolLM2 and says why it skips the VLM."""
    built = []
    monkeypatch.setitem(models._BUILTINS, BUILTIN_TEXT, lambda: built.append("text") or Path("/m/text"))
    monkeypatch.setitem(models._BUILTINS, BUILTIN_VLM, lambda: built.append("vlm") or Path("/m/vlm"))
    module_exists = models._module_exists
    monkeypatch.setattr(models, "_module_exists", lambda name: not name.startswith("mlx_vlm") and module_exists(name))
    models.main()
    out = capsys.readouterr().out.splitlines()
    assert built == ["text"]
    assert out == [f"{BUILTIN_TEXT}\t/m/text", f"{BUILTIN_VLM}\tskipped: needs mlx-vlm (pip install 'tqpipe[vlm]')"]
    monkeypatch.setattr(models, "_module_exists", module_exists)
    models.main()
    assert built == ["text", "text", "vlm"]
    assert capsys.readouterr().out.splitlines()[1] == f"{BUILTIN_VLM}\t/m/vlm"


@pytest.mark.parametrize("path", ["/no/such/model-dir", "./missing-model", "~/no-such-tqpipe-model"])
def test_missing_local_path(path):
    with pytest.raises(ModelLoadError, match="does not exist") as e:
        load_model(path)
    assert path in str(e.value)


def test_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_model(str(tmp_path))


def test_broken_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json is not valid JSON"):
        load_model(str(tmp_path))


def test_unknown_hub_id_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="no-such-org/no-such-model"):
        load_model("no-such-org/no-such-model")


def test_unknown_builtin():
    with pytest.raises(ModelLoadError, match="unknown built-in model 'builtin:gpt-17'"):
        load_model("builtin:gpt-17")


# --- cache --------------------------------------------------------------------


def test_builtin_cache_is_reused_and_repaired(monkeypatch, tmp_path):
    monkeypatch.setenv("TQPIPE_HOME", str(tmp_path))
    first = models.builtin_vlm_dir()
    assert first == tmp_path / "models" / "tiny-qwen2-vl"
    weights = first / "model.safetensors"
    built_at = weights.stat().st_mtime_ns

    assert models.builtin_vlm_dir() == first
    assert weights.stat().st_mtime_ns == built_at  # not rebuilt

    size = weights.stat().st_size
    with open(weights, "r+b") as f:  # a crash mid-copy: truncated weights
        f.truncate(size // 2)
    models.builtin_vlm_dir()
    assert weights.stat().st_size == size
    assert load_model(BUILTIN_VLM, needs_images=True).kind == "vlm"

    shutil.rmtree(first)
    first.mkdir()  # an empty leftover directory
    (first / "config.json").write_text("{}")
    assert models.builtin_vlm_dir() == first and weights.stat().st_size == size


def test_stamp_change_rebuilds(tmp_path):
    calls = []

    def build(d: Path) -> None:
        calls.append(d)
        (d / "x.txt").write_text(str(len(calls)))

    target = tmp_path / "m"
    model_cache.cached_build(target, {"v": 1}, build)
    model_cache.cached_build(target, {"v": 1}, build)
    assert len(calls) == 1
    model_cache.cached_build(target, {"v": 2}, build)
    assert len(calls) == 2 and (target / "x.txt").read_text() == "2"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".m.")] == [".m.lock"]  # no temp leftovers


def test_failed_build_leaves_nothing(tmp_path):
    def build(d: Path) -> None:
        (d / "half.bin").write_bytes(b"x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        model_cache.cached_build(tmp_path / "m", {"v": 1}, build)
    assert not (tmp_path / "m").exists()
    assert [p.name for p in tmp_path.iterdir()] == [".m.lock"]


def _slow_build(target: str, log: str) -> None:
    def build(d: Path) -> None:
        with open(log, "a") as f:
            f.write("build\n")
        time.sleep(0.5)
        (d / "w.bin").write_bytes(b"0" * 1000)

    model_cache.cached_build(Path(target), {"v": 1}, build)
    assert (Path(target) / "w.bin").stat().st_size == 1000


def test_concurrent_builders_build_once(tmp_path):
    log = tmp_path / "log"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_slow_build, args=(str(tmp_path / "m"), str(log))) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert log.read_text() == "build\n"


def test_main_prints_built_dirs(smollm2_dir, tiny_vlm_dir, capsys):
    models.main()
    lines = dict(line.split("\t") for line in capsys.readouterr().out.splitlines())
    assert lines == {BUILTIN_TEXT: str(smollm2_dir), BUILTIN_VLM: str(tiny_vlm_dir)}


def test_models_home(monkeypatch, tmp_path):
    monkeypatch.setenv("TQPIPE_HOME", str(tmp_path))
    assert models.models_home() == tmp_path / "models"
    monkeypatch.delenv("TQPIPE_HOME")
    assert models.models_home() == Path.home() / ".cache" / "tqpipe" / "models"
