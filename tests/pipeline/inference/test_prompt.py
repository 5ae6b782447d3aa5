"""Prompt assembly: one shared document prefix, per-task suffixes, page offsets, truncation."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures_models import *  # noqa: F403  (session model fixtures)
from PIL import Image

from pipeline.errors import ContextOverflowError
from pipeline.inference.prompt import ImagesNeedVLMError, PromptBuilder, task_text
from pipeline.inputs.discover import DocumentRef
from pipeline.inputs.document import Document, Page
from pipeline.models.load import BUILTIN_VLM
from pipeline.run.dry_run import tokenizer_only
from pipeline.schema.job import ContextSpec, TaskSpec

TASKS = [
    TaskSpec(name="summary", prompt="Summarize the document.", max_tokens=16),
    TaskSpec(name="fields", prompt="Extract the author.", format="json", fields=["author"], max_tokens=32),
]
TEXTS = [
    "Quarterly report of the Harbor Authority. Revenue grew by 12 percent.",
    "Author: Ada Lovelace. Approved on 2024-03-01.",
    "Total dredging cost: 1250 EUR. Next review in June.",
]


def make_doc(images: dict[int, Image.Image] | None = None, texts=TEXTS) -> Document:
    images = images or {}
    pages = [Page(number=i + 1, text=t, image=images.get(i + 1), scanned=(i + 1) in images and not t)
             for i, t in enumerate(texts)]
    ref = DocumentRef(source=Path("/docs/report.pdf"), kind="pdf", doc_id="report.pdf")
    return Document(ref=ref, content_hash="sha256:0", page_count=len(pages), pages=pages)


@pytest.fixture(scope="module")
def text_builder(smollm2_dir) -> PromptBuilder:
    return tokenizer_only(None, images=False)  # tokenizer only, no weights


@pytest.fixture(scope="module")
def vlm_builder(tiny_vlm_dir) -> PromptBuilder:
    return tokenizer_only(BUILTIN_VLM, images=True)


def test_prefix_plus_suffix_is_the_chat_template_render(text_builder):
    tok = text_builder.tokenizer
    prompt = text_builder.build(make_doc(), ContextSpec(), TASKS)
    for task in TASKS:
        full = tok.decode(prompt.prefix_ids + prompt.task_ids[task.name])
        user = "".join(f"[Page {i + 1}]\n{t}\n\n" for i, t in enumerate(TEXTS)) + task_text(task)
        expected = tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)
        assert full == expected
    # the task text is not in the shared prefix; the prefix is the same whatever the tasks
    other = text_builder.build(make_doc(), ContextSpec(), TASKS[:1])
    assert other.prefix_ids == prompt.prefix_ids
    assert "Summarize" not in tok.decode(prompt.prefix_ids)


def test_page_offsets_point_at_page_markers(text_builder):
    tok = text_builder.tokenizer
    prompt = text_builder.build(make_doc(), ContextSpec(), TASKS)
    assert prompt.included_pages == [1, 2, 3]
    offsets = prompt.page_offsets
    assert sorted(offsets) == [1, 2, 3] and offsets[1] < offsets[2] < offsets[3] < prompt.n_tokens
    for n, off in offsets.items():
        end = offsets.get(n + 1, prompt.n_tokens)
        page = tok.decode(prompt.prefix_ids[off:end])
        assert page.startswith(f"[Page {n}]\n") and TEXTS[n - 1] in page
    rec = prompt.pages_record()
    assert rec["token_offsets"] == {str(k): v for k, v in offsets.items()} and rec["included"] == [1, 2, 3]


def test_no_page_markers_still_tracks_offsets(text_builder):
    tok = text_builder.tokenizer
    prompt = text_builder.build(make_doc(), ContextSpec(page_markers=False), TASKS)
    assert "[Page" not in tok.decode(prompt.prefix_ids)
    assert tok.decode(prompt.prefix_ids[prompt.page_offsets[2]:]).startswith(TEXTS[1])


def test_truncate_drops_trailing_pages_and_says_so(text_builder):
    full = text_builder.build(make_doc(), ContextSpec(), TASKS)
    suffix = max(len(v) for v in full.task_ids.values())
    gen = max(t.max_tokens for t in TASKS)
    # room for the head and the first page plus a few tokens of page 2
    limit = full.page_offsets[2] + 5 + suffix + gen
    prompt = text_builder.build(make_doc(), ContextSpec(max_tokens=limit, overflow="truncate"), TASKS)
    t = prompt.truncation
    assert t["truncated"] is True and t["pages_dropped"] == [3] and t["partial_page"] == 2
    assert prompt.included_pages == [1, 2]
    assert prompt.n_tokens == full.page_offsets[2] + 5
    assert t["tokens_dropped"] == full.n_tokens - prompt.n_tokens
    assert prompt.n_tokens + suffix + gen <= limit


def test_overflow_error_names_the_file(text_builder):
    with pytest.raises(ContextOverflowError, match="report.pdf"):
        text_builder.build(make_doc(), ContextSpec(max_tokens=120, overflow="error"), TASKS)
    # fits: no truncation recorded
    assert text_builder.build(make_doc(), ContextSpec(), TASKS).truncation == {"truncated": False}


def test_json_task_text_asks_for_fields():
    assert task_text(TASKS[1]).endswith("Answer with one JSON object with the keys: author.")
    assert task_text(TASKS[0]) == "Summarize the document."


def test_text_model_refuses_image_only_pages(text_builder):
    doc = make_doc({2: Image.new("RGB", (32, 32))}, texts=[TEXTS[0], "", TEXTS[2]])
    with pytest.raises(ImagesNeedVLMError, match="pages 2 are images"):
        text_builder.build(doc, ContextSpec(), TASKS)


def test_vlm_page_images_become_image_tokens_at_their_page(vlm_builder):
    proc = vlm_builder.processor
    image_id = proc.image_token_id
    doc = make_doc({2: Image.new("RGB", (56, 56), (200, 30, 30))}, texts=[TEXTS[0], "", TEXTS[2]])
    prompt = vlm_builder.build(doc, ContextSpec(), TASKS)
    assert prompt.n_images == 1
    grid = prompt.image_inputs["image_grid_thw"].tolist()
    merge = proc.image_processor.merge_size
    n_image_tokens = grid[0][0] * grid[0][1] * grid[0][2] // merge**2
    positions = [i for i, t in enumerate(prompt.prefix_ids) if t == image_id]
    assert len(positions) == n_image_tokens > 0
    # every image token lies inside page 2's span
    assert prompt.page_offsets[2] < positions[0] and positions[-1] < prompt.page_offsets[3]
    assert prompt.image_inputs["pixel_values"].shape[0] == grid[0][0] * grid[0][1] * grid[0][2]


@pytest.mark.parametrize("builder", ["text_builder", "vlm_builder"])
def test_task_suffixes_without_a_document_equal_the_built_ones(builder, request):
    """What lets a stored document cache be used without reading the document."""
    b = request.getfixturevalue(builder)
    doc = make_doc({2: Image.new("RGB", (56, 56))}) if builder == "vlm_builder" else make_doc()
    assert b.task_ids(TASKS) == b.build(doc, ContextSpec(), TASKS).task_ids


def test_a_prompt_survives_its_stored_fields(vlm_builder):
    import json

    from pipeline.inference.prompt import DocumentPrompt

    doc = make_doc({2: Image.new("RGB", (56, 56))}, texts=[TEXTS[0], "", TEXTS[2]])
    prompt = vlm_builder.build(doc, ContextSpec(), TASKS)
    fields = json.loads(json.dumps(prompt.stored_fields()))  # as the cache file keeps them
    back = DocumentPrompt.from_stored(prompt.prefix_ids, fields, prompt.task_ids)
    assert back.pages_record() == prompt.pages_record() and back.truncation == prompt.truncation
    assert back.n_images == prompt.n_images == 1 and back.n_tokens == prompt.n_tokens
    assert [(s, e) for s, e, _ in back.image_spans] == [(s, e) for s, e, _ in prompt.image_spans]
    with pytest.raises(ValueError, match="tokens"):
        DocumentPrompt.from_stored(prompt.prefix_ids[:-1], fields, prompt.task_ids)
