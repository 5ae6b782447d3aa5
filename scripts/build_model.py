"""Build a local mlx-lm model directory of a real model's shape, with seeded random weights.

No weights can be downloaded where tqpipe is benchmarked, yet speed and memory
at scale depend only on the shapes: layers, heads, head dim, MLP width,
vocabulary.  This writes what ``model.path`` needs (``mlx_lm.load`` reads it):

* ``config.json``: the Llama-3.1-8B or Llama-3.2-1B architecture (``--shape``),
  or ``tiny`` (2 layers, for tests on CPU);
* ``model-NNNNN.safetensors``: every tensor drawn from N(0, 0.02) with a key
  derived from ``--seed`` and the tensor's name (norms are ones), so the same
  command writes the same weights in any order, in ``--dtype``;
* ``tokenizer.json`` + ``tokenizer_config.json``: a byte-level BPE trained
  here on the text of tqpipe's own long sample PDFs (``pipeline.inputs.samples``),
  with Llama-3's special tokens and chat template.  Its ids sit below the
  config's vocabulary (the embedding rows above are simply never used).

Answers are noise; tokens per page, prefill and decode cost are real.
Usage::

    python scripts/build_model.py --shape 8b OUT_DIR     # ~15 GiB of bf16
    python scripts/build_model.py --shape 1b OUT_DIR
    python scripts/build_model.py --shape tiny OUT_DIR   # seconds, for tests
"""

from __future__ import annotations

import argparse
import json
import random
import zlib
from pathlib import Path
from typing import Iterator

from pipeline.models.store import write_marker

_LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}

#: The architectures, as their published config.json files state them.
SHAPES: dict[str, dict] = {
    "8b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False,
           "rope_theta": 500000.0, "rope_scaling": _LLAMA3_ROPE, "max_position_embeddings": 131072},
    "1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 8192, "vocab_size": 128256, "tie_word_embeddings": True, "head_dim": 64,
           "rope_theta": 500000.0, "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0},
           "max_position_embeddings": 131072},
    "tiny": {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 512, "vocab_size": 4096, "tie_word_embeddings": False,
             "rope_theta": 500000.0, "max_position_embeddings": 131072},
}

BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
SPECIALS = [BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", EOT]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SHARD_BYTES = 2 << 30


def config_for(shape: str) -> dict:
    c = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
         "rms_norm_eps": 1e-5, "attention_bias": False, "mlp_bias": False, **SHAPES[shape]}
    return c


def tensor_shapes(c: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every weight of a llama model with config ``c``."""
    h, v, f = c["hidden_size"], c["vocab_size"], c["intermediate_size"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    yield "model.embed_tokens.weight", (v, h)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (q, h)
        yield p + "self_attn.k_proj.weight", (kv, h)
        yield p + "self_attn.v_proj.weight", (kv, h)
        yield p + "self_attn.o_proj.weight", (h, q)
        yield p + "mlp.gate_proj.weight", (f, h)
        yield p + "mlp.up_proj.weight", (f, h)
        yield p + "mlp.down_proj.weight", (h, f)
    yield "model.norm.weight", (h,)
    if not c["tie_word_embeddings"]:
        yield "lm_head.weight", (v, h)


def write_weights(out: Path, c: dict, seed: int, dtype: str, used_vocab: int | None = None) -> int:
    """Write the seeded random weights in shards; returns their total bytes.

    With ``used_vocab`` (the tokenizer's size) the output projection's rows
    for ids at or above it are zero: their logits are 0 while the real
    tokens' are spread around it, so greedy answers are text the tokenizer
    can decode (not ids beyond it, which decode to nothing) and comparisons
    of answers mean something.  Shapes, and so speed, are unchanged.
    """
    import mlx.core as mx

    dt = getattr(mx, dtype)
    shard: dict = {}
    shard_bytes, total, names = 0, 0, {}
    shards: list[dict] = []
    output_name = "model.embed_tokens.weight" if c["tie_word_embeddings"] else "lm_head.weight"

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            shards.append(shard)
            name = f"model-{len(shards):05d}.safetensors"
            mx.save_safetensors(str(out / name), shard, metadata={"format": "mlx"})
            names.update({k: name for k in shard})
            shard, shard_bytes = {}, 0

    for name, shape in tensor_shapes(c):
        if name.endswith("norm.weight"):
            w = mx.ones(shape, dtype=dt)
        else:
            key = mx.random.key((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 31))
            w = (0.02 * mx.random.normal(shape, key=key)).astype(dt)
            if used_vocab is not None and name == output_name and used_vocab < shape[0]:
                w = w * (mx.arange(shape[0]) < used_vocab)[:, None].astype(dt)
        mx.eval(w)
        shard[name] = w
        shard_bytes += w.nbytes
        total += w.nbytes
        if shard_bytes >= SHARD_BYTES:
            flush()
    flush()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": names}, indent=1))
    return total


def corpus(pages: int = 400, seed: int = 0) -> Iterator[str]:
    """Text like the long sample PDFs' pages (the tokenizer's training set)."""
    from pipeline.inputs.samples import _WORDS, long_pdf_code_word

    rng = random.Random(seed)
    words = _WORDS.split()
    for n in range(1, pages + 1):
        body = " ".join(rng.choice(words) for _ in range(300))
        yield f"This is page {n} of {pages}. The code word for page {n} is {long_pdf_code_word(n, seed)}.\n\n{body}"
    yield "Summarize the document. Answer the question. Extract the fields as JSON: title, author, date, total."


def write_tokenizer(out: Path, vocab: int) -> dict:
    """Train a byte-level BPE on :func:`corpus`; write tokenizer files; return special ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos)])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOT,
        "model_max_length": 1 << 20, "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
    }, indent=1))
    return {"bos_token_id": bos, "eos_token_id": [tok.token_to_id(EOS), tok.token_to_id(EOT)]}


def _tokenizer_size(out: Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()


def build(out: str | Path, shape: str = "8b", *, seed: int = 0, dtype: str = "bfloat16",
          tokenizer_vocab: int = 4096) -> Path:
    """Write the model directory ``out`` (created) and return it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    c = config_for(shape)
    ids = write_tokenizer(out, min(tokenizer_vocab, c["vocab_size"]))
    c.update(ids, torch_dtype=dtype)
    (out / "config.json").write_text(json.dumps(c, indent=1))
    write_weights(out, c, seed, dtype, used_vocab=_tokenizer_size(out))
    # the build marker: tqpipe marks every record of this model random_weights (its answers are noise)
    write_marker(out, {"builder": "scripts/build_model.py", "random_weights": True, "shape": shape, "seed": seed,
                       "dtype": dtype})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="model directory to write (model.path in a job)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--tokenizer-vocab", type=int, default=4096)
    a = ap.parse_args()
    path = build(a.out, a.shape, seed=a.seed, dtype=a.dtype, tokenizer_vocab=a.tokenizer_vocab)
    print(path)


if __name__ == "__main__":
    main()
