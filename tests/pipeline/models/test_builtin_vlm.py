"""The seeded tiny Qwen2-VL: deterministic, small, and runnable by mlx-vlm."""

import json

import mlx.core as mx
import mlx_vlm
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_vlm.prompt_utils import apply_chat_template
from PIL import Image

from fixtures_models import *  # noqa: F401,F403
from pipeline.models import builtin_vlm


def _image(seed: int, h: int = 80, w: int = 96) -> Image.Image:
    return Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8"))


def test_same_seed_same_bytes(tiny_vlm_dir, tmp_path):
    builtin_vlm.build_tiny_vlm(tmp_path / "again", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "preprocessor_config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (tiny_vlm_dir / name).read_bytes(), name


def test_other_seed_other_weights(tiny_vlm_dir):
    config = json.loads((tiny_vlm_dir / "config.json").read_text())
    w0 = builtin_vlm.seeded_weights(config, 0)
    w1 = builtin_vlm.seeded_weights(config, 1)
    key = "language_model.model.layers.0.self_attn.q_proj.weight"
    assert not mx.array_equal(w0[key], w1[key])
    assert mx.array_equal(w0[key], builtin_vlm.seeded_weights(config, 0)[key])


def test_small_enough_for_cpu_tests(tiny_vlm_model):
    n_params = sum(v.size for _, v in tree_flatten(tiny_vlm_model.model.parameters()))
    assert 1e6 < n_params < 5e6
    cfg = tiny_vlm_model.config
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 64  # TurboQuant head size
    assert isinstance(cfg["vision_config"]["mlp_ratio"], int)


@pytest.mark.parametrize(
    "text",
    [
        "The quick brown fox jumps over the lazy dog.",
        "Invoice 4471: total 1,234.56 USD, due 2024-03-15 (page 17).",
        "Unseen words round-trip too: Zürich, naïve café, 東京, emoji 🙂\n\tand tabs.",
    ],
)
def test_tokenizer_round_trips(tiny_vlm_model, text):
    tok = tiny_vlm_model.tokenizer
    ids = tok.encode(text)
    assert all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text


def test_tokenizer_learned_english_and_specials(tiny_vlm_model):
    tok = tiny_vlm_model.tokenizer
    assert len(tok.encode(" the capital of the document")) == 5  # whole common words
    assert len(tok.encode("2024")) == 4  # digits one by one, like Qwen2
    cfg = tiny_vlm_model.config
    for special, key in (("<|image_pad|>", "image_token_id"), ("<|vision_start|>", "vision_start_token_id")):
        assert tok.encode(special) == [cfg[key]]
    assert tok.encode("<|im_end|>")[0] in tok.eos_token_ids


def test_chat_template_inserts_one_vision_block_per_image(tiny_vlm_model):
    prompt = apply_chat_template(
        tiny_vlm_model.processor, tiny_vlm_model.model.config, "Compare the pages.", num_images=2
    )
    assert prompt.count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    assert prompt.endswith("<|im_start|>assistant\n")


def test_processor_keeps_pages_to_few_tokens(tiny_vlm_model):
    proc = tiny_vlm_model.processor
    image_id = tiny_vlm_model.config["image_token_id"]
    prompt = "<|vision_start|><|image_pad|><|vision_end|>"
    for size in ((80, 96), (1100, 850)):  # a thumbnail and a full page scan
        inputs = proc(text=[prompt], images=[_image(0, *size)])
        n_image_tokens = int((inputs["input_ids"] == image_id).sum().item())
        grid = inputs["image_grid_thw"].tolist()[0]
        assert n_image_tokens == grid[0] * grid[1] * grid[2] // 4
        assert 4 <= n_image_tokens <= 64


def test_mlx_vlm_loads_and_generates_with_images(tiny_vlm_dir):
    model, processor = mlx_vlm.load(str(tiny_vlm_dir))
    prompt = apply_chat_template(processor, model.config, "Describe both images.", num_images=2)
    text_only = len(processor.tokenizer.encode(prompt))
    result = mlx_vlm.generate(
        model, processor, prompt, image=[_image(1), _image(2, 64, 64)], max_tokens=6, verbose=False
    )
    assert result.prompt_tokens > text_only  # the image pads were expanded
    assert 1 <= result.generation_tokens <= 6
    # Greedy decoding of fixed weights is reproducible.
    again = mlx_vlm.generate(
        model, processor, prompt, image=[_image(1), _image(2, 64, 64)], max_tokens=6, verbose=False
    )
    assert again.text == result.text
