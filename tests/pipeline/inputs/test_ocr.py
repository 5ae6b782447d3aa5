"""OCR of scanned pages and image sets for text-only models (pipeline.inputs.ocr, scanned_route)."""

from pathlib import Path

import pytest

from pipeline.inputs.discover import DocumentRef, discover
from pipeline.inputs.document import scanned_route
from pipeline.inputs.ingest import ingest
from pipeline.inputs.job_file import load_job
from pipeline.inputs.samples import IMAGESET_PAGES, SAMPLE_FACTS, write_samples
from pipeline.schema.job import ContextSpec
from input_refs import pdf_ref  # noqa: E402  (tests/pipeline/inputs)


@pytest.mark.parametrize(
    "images, reads_images, route",
    [
        ("auto", False, "ocr"),
        ("auto", True, "image"),
        ("ocr", True, "ocr"),
        ("ocr", False, "ocr"),
        ("always", True, "image"),
        ("always", False, "image"),  # a text model then fails, saying so
        ("never", False, "none"),
        ("never", True, "none"),
    ],
)
def test_scanned_route(images, reads_images, route):
    assert scanned_route(images, reads_images) == route


def test_scanned_sample_is_read_into_page_text_the_same_every_time(samples):
    doc = ingest(pdf_ref(samples / "scanned.pdf"), ContextSpec(), model_reads_images=False)
    assert ingest(pdf_ref(samples / "scanned.pdf"), ContextSpec(images="ocr")).text() == doc.text()  # deterministic
    assert [(p.number, p.via, p.image) for p in doc.pages] == [(1, "ocr", None), (2, "ocr", None)]
    assert not doc.needs_images
    text = doc.text()
    assert text.startswith("[Page 1]\nDelivery Note DN-7781\n")
    assert "[Page 2]\nDelivery Note DN-7781, page 2" in text
    for value in SAMPLE_FACTS["scanned.pdf"].values():
        assert value.split()[0] in text, value
    assert "Parcels delivered: 37" in text and "Signed: H. Kobayashi" in text
    assert "35 parcels intact, 2 parcels with dented corners." in text


def test_image_set_is_read_page_by_page_in_natural_order(samples):
    job_file = samples / "job.yaml"
    job_file.write_text("name: t\ninputs: [{images: imageset}]\ntasks: [{name: a, prompt: hi}]\noutput: o.jsonl\n")
    ref = discover(load_job(job_file))[0]
    doc = ingest(ref, ContextSpec(images="ocr"))
    assert [p.via for p in doc.pages] == ["ocr"] * 3
    expected = [IMAGESET_PAGES[n].replace("\n\n", "\n") for n in ("page1.png", "page2.png", "page10.png")]
    assert [p.text for p in doc.pages] == expected


def test_vlm_keeps_page_images_under_auto(samples):
    doc = ingest(pdf_ref(samples / "scanned.pdf"), ContextSpec(), model_reads_images=True)
    assert [p.via for p in doc.pages] == ["image", "image"]
    assert all(p.image is not None and p.text.strip() == "" for p in doc.pages)


def test_long_sample_mixes_text_and_ocr_pages(samples):
    doc = ingest(pdf_ref(samples / "harbour-log.pdf"), ContextSpec(), model_reads_images=False)
    via = {p.number: p.via for p in doc.pages}
    assert [n for n, v in via.items() if v == "ocr"] == [14, 36, 62]
    assert len(doc.pages) == 62 and set(via.values()) == {"text", "ocr"}
    storm = doc.pages[13].text
    assert "Storm Alva closed the port on 2024-03-14 for 38 hours" in storm.replace("\n", " ")
