"""A tiny Qwen2-VL with seeded random weights, built locally.

Jobs over page images need a vision-language model, and a fresh machine with
no model hub must still run the whole pipeline end to end (ingest, prefill,
TurboQuant cache, generation, records).  This module writes a complete
``qwen2_vl`` model directory that ``mlx_vlm.load`` accepts:

* ``config.json`` – a few-million-parameter Qwen2-VL (64-dim heads, GQA,
  M-RoPE, a 2-block vision tower) so a 1-2k token prefill with a couple of
  small images takes well under a second on CPU;
* ``model.safetensors`` – weights from MLX's default initialisers under
  ``mx.random.seed(seed)``: the same seed gives the same bytes;
* ``tokenizer.json`` – a byte-level BPE trained with ``tokenizers`` on the
  small built-in corpus below, with Qwen2-VL's special tokens; byte-level
  means any text round-trips, digits are split one by one as Qwen2 does;
* ``tokenizer_config.json`` / ``chat_template.json`` – Qwen2-VL's chat
  template, which inserts ``<|vision_start|><|image_pad|><|vision_end|>`` per
  image;
* ``preprocessor_config.json`` (+ processor/video configs) – Qwen2-VL image
  processor settings with small min/max pixels, so a page becomes at most 64
  image tokens.  All of them are written so that mlx-vlm never falls back to
  the Hub for a missing file.

Its output is noise: it proves plumbing, not quality.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

BUILD_VERSION = 1
DEFAULT_SEED = 0
VOCAB_SIZE = 2048

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Qwen2-VL-Instruct's chat template (verbatim).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Enough ordinary English (and document vocabulary) for BPE to learn common
# words; rare words and other scripts still round-trip as bytes.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A document has pages, and each page has text.
This report describes the results of the study in section 3, table 2 and figure 4.
What is the capital of France? The capital of France is Paris.
Please answer the question using only the information in the document.
Return a JSON object with the fields "title", "date", "pages" and "summary".
The total amount due is 1,234.56 dollars, payable on 2024-03-15 to the account number 9876.
Invoice number 4471 was issued on 12 January 2023 by the finance department.
The contract starts on the first day of the month and ends after twelve months.
Figure 1 shows the growth of revenue from 2019 to 2023; the table below lists the values.
In the introduction, the authors explain why long documents are hard to read in one pass.
Chapter two covers the methods: data collection, cleaning, analysis and the final review.
The meeting was held in London with members from Berlin, Madrid, Rome and New York.
Results: accuracy 91.5 percent, recall 88.2 percent, precision 93.0 percent on 10,000 samples.
The patient was admitted on Monday and discharged on Friday after treatment.
All rights reserved. No part of this publication may be reproduced without permission.
Summary: the company reported higher sales, lower costs and a stable outlook for next year.
Question: which page mentions the budget? Answer: the budget is on page 17.
The image shows a chart, a photo of a building, and a map of the city centre.
Name, address, phone number, email and signature are required on every form.
The committee will review the proposal and publish its decision within 30 days.
Water boils at 100 degrees and freezes at 0 degrees at sea level.
There are 7 days in a week, 12 months in a year and 365 days in most years.
He said that she would read the book, write a letter, and then call them at home.
It is important to note that these results are preliminary and may change.
For more information, see the appendix at the end of this document.
"""

# A few million parameters: 64-dim heads (a TurboQuant-friendly size), GQA,
# Qwen2-VL's M-RoPE split over the 32 rotary frequency pairs.
TEXT_CONFIG: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
    "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},
    "tie_word_embeddings": True,
}
VISION_CONFIG: dict[str, Any] = {
    "model_type": "qwen2_vl",
    "depth": 2,
    "embed_dim": 64,
    "hidden_size": TEXT_CONFIG["hidden_size"],  # the merger projects into the LM
    "num_heads": 2,
    "mlp_ratio": 2,  # mlx-vlm needs an int here
    "in_channels": 3,
    "patch_size": 14,
    "spatial_patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
# Qwen2-VL's CLIP normalisation; pixels are capped so a page is <= 64 tokens.
IMAGE_PROCESSOR: dict[str, Any] = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "rescale_factor": 1 / 255,
    "min_pixels": 4 * 28 * 28,
    "max_pixels": 64 * 28 * 28,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
}


def stamp(seed: int = DEFAULT_SEED) -> dict[str, Any]:
    """What a cached build depends on (a change rebuilds it)."""
    return {"builder": "tiny-qwen2-vl", "version": BUILD_VERSION, "seed": seed}


def train_tokenizer() -> "tokenizers.Tokenizer":  # noqa: F821
    """Byte-level BPE on :data:`CORPUS` with Qwen2-VL's special tokens first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    return tok


def model_config(vocab_size: int) -> dict[str, Any]:
    """The ``config.json`` for a tokenizer of ``vocab_size`` tokens."""
    ids = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        **TEXT_CONFIG,
        "vocab_size": vocab_size,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "vision_config": dict(VISION_CONFIG),
        "torch_dtype": "float16",
    }


def seeded_weights(config: dict[str, Any], seed: int) -> dict[str, mx.array]:
    """Initialise mlx-vlm's own Qwen2-VL under ``seed``; float16 like real checkpoints."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    config = json.loads(json.dumps(config))  # mlx-vlm mutates what it is given
    model_class, _ = get_model_and_args(config)
    model_config = model_class.ModelConfig.from_dict(config)
    model_config = update_module_configs(model_config, model_class, config, ["text", "vision"])
    mx.random.seed(seed)
    model = model_class.Model(model_config)
    weights = {k: v.astype(mx.float16) for k, v in tree_flatten(model.parameters())}
    mx.eval(weights)
    return weights


def build_tiny_vlm(out_dir: Path, seed: int = DEFAULT_SEED) -> None:
    """Write the tiny Qwen2-VL model directory into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    tok.save(str(out_dir / "tokenizer.json"))
    config = model_config(tok.get_vocab_size())
    mx.save_safetensors(
        str(out_dir / "model.safetensors"), seeded_weights(config, seed), metadata={"format": "mlx"}
    )

    def dump(name: str, obj: Any) -> None:
        (out_dir / name).write_text(json.dumps(obj, indent=2))

    dump("config.json", config)
    dump(
        "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "add_bos_token": False,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": TEXT_CONFIG["max_position_embeddings"],
            "chat_template": CHAT_TEMPLATE,
        },
    )
    dump("chat_template.json", {"chat_template": CHAT_TEMPLATE})
    dump("preprocessor_config.json", IMAGE_PROCESSOR)
    dump("video_preprocessor_config.json", {**IMAGE_PROCESSOR, "video_processor_type": "Qwen2VLVideoProcessor"})
    dump("processor_config.json", {"processor_class": "Qwen2VLProcessor"})
    dump("generation_config.json", {"eos_token_id": config["eos_token_id"], "pad_token_id": config["pad_token_id"]})


def ensure_tiny_vlm(target: Path, seed: int = DEFAULT_SEED) -> Path:
    """The tiny VLM directory at ``target``, built once if needed."""
    from pipeline.models.store import cached_build

    return cached_build(Path(target), stamp(seed), lambda tmp: build_tiny_vlm(tmp, seed))
