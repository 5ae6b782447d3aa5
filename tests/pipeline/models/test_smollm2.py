"""SmolLM2-135M-Instruct: GGUF -> mlx-lm conversion, and that it really answers."""

import json

import mlx.core as mx
import mlx_lm
import pytest
from safetensors import safe_open

from fixtures_models import *  # noqa: F401,F403
from pipeline.models import smollm2


def llama_cpp_permute(w: mx.array, n_heads: int) -> mx.array:
    """llama.cpp convert_hf_to_gguf.py's permute (HF rotate-half -> interleaved)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permute():
    w = mx.arange(6 * 64 * 5).reshape(6 * 64, 5)
    assert mx.array_equal(smollm2.unpermute_rope_rows(llama_cpp_permute(w, 6), 6), w)
    # and it is not the identity: row 1 of head 0 came from row 32 (second half)
    assert smollm2.unpermute_rope_rows(w, 6)[32, 0].item() == w[1, 0].item()


def test_converted_directory(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is True
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    # Q4_1 layers, and a Q8_0 token embedding: kept as MLX 4/8-bit, losslessly.
    assert config["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "model.embed_tokens": {"group_size": 32, "bits": 8},
    }
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)

    with safe_open(str(smollm2_dir / "model.safetensors"), "numpy") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.scales" in keys and "model.norm.weight" in keys
    assert "model.layers.29.self_attn.k_proj.weight" in keys
    assert "lm_head.weight" not in keys and not any(k.startswith(("blk.", "token_embd")) for k in keys)

    tok_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"]
    assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")


def test_answers_capital_of_france(smollm2_model):
    tok = smollm2_model.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    answer = mlx_lm.generate(smollm2_model.model, tok, prompt=prompt, max_tokens=20)  # greedy
    assert "Paris" in answer


def test_tokenizer_matches_smollm2(smollm2_model):
    tok = smollm2_model.tokenizer
    text = "The capital of France is Paris. In 2024, 17 people paid €3.50!"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # SmolLM2 splits digits one by one and treats chat markers as single tokens.
    assert len(tok.encode("2024")) == 4
    assert tok.encode("<|im_start|>user<|im_end|>") == [1, tok.encode("user")[0], 2]
    assert tok.encode(" Paris") == [tok.convert_tokens_to_ids("ĠParis")]
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_rope_layout_matches_the_gguf(smollm2_dir):
    """Converted Q/K with HF rope == the GGUF's own Q/K with llama.cpp's interleaved rope.

    This pins the un-permutation independently of answer quality: the
    converted model must compute exactly what llama.cpp computes from the file.
    """
    tokens = mx.array([[1, 504, 3575, 282, 4649, 314]])
    model, _ = mlx_lm.load(str(smollm2_dir), lazy=True)
    model.model.layers = model.model.layers[:3]  # enough to pin the layout, 10x cheaper
    reference = model(tokens)

    gguf = mx.load(str(smollm2.gguf_path()))
    for i, layer in enumerate(model.model.layers):  # the file's tensors, untouched
        for proj, name in ((layer.self_attn.q_proj, "attn_q"), (layer.self_attn.k_proj, "attn_k")):
            for part in ("weight", "scales", "biases"):
                setattr(proj, part, gguf[f"blk.{i}.{name}.{part}"])
    wrong = model(tokens)  # the file's rows with HF rope: must differ
    for layer in model.model.layers:
        layer.self_attn.rope.traditional = True  # llama.cpp's rope for llama
    assert mx.allclose(model(tokens), reference, atol=1e-3).item()
    assert mx.abs(wrong - reference).max().item() > 1.0


def test_bad_gguf_names_the_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="broken.gguf"):
        smollm2.convert_gguf(bad, tmp_path / "out")
