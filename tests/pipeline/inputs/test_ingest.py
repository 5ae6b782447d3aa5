"""Reading PDFs and image sets into pages (pipeline.inputs.ingest, document, pdf, images)."""

import time
from pathlib import Path

import pytest
from PIL import Image

from pipeline.errors import IngestError
from pipeline.inputs import pdf as pdf_mod
from pipeline.inputs.discover import DocumentRef, content_hash, discover, natural_key
from pipeline.inputs.ingest import ingest
from pipeline.inputs.job_file import load_job
from pipeline.schema.job import ContextSpec, Job, JobSpec, TaskSpec, with_pages
from pipeline.inputs.samples import (
    IMAGESET_PAGES,
    SAMPLE_FACTS,
    make_broken_page_pdf,
    make_corrupt_pdf,
    make_encrypted_pdf,
    make_image_set,
    make_long_pdf,
    make_text_pdf,
    write_samples,
)
from input_refs import pdf_ref, job_in  # noqa: E402  (tests/pipeline/inputs)

EMPTY_PDF = (
    b"%PDF-1.4\n1 0 obj\n<< /Type /Catalog /Pages 2 0 R >>\nendobj\n"
    b"2 0 obj\n<< /Type /Pages /Kids [] /Count 0 >>\nendobj\ntrailer\n<< /Root 1 0 R >>\n%%EOF\n"
)


# -- text, scanned and image documents -----------------------------------------


def test_text_pdf(samples):
    doc = ingest(pdf_ref(samples / "report.pdf"), ContextSpec())
    assert doc.page_count == 4 and [p.number for p in doc.pages] == [1, 2, 3, 4]
    assert not any(p.scanned or p.image is not None for p in doc.pages)  # images: auto, nothing scanned
    assert "Total income: $482,310.75" in doc.pages[2].text
    assert doc.skipped_pages == [] and doc.notes == []
    text = doc.text()
    assert text.startswith("[Page 1]\nAnnual Report 2023")
    assert text.index("[Page 3]") < text.index("$482,310.75") < text.index("[Page 4]")
    assert "[Page" not in doc.text(markers=False)
    assert doc.content_hash == content_hash(doc.ref)


def test_images_always_at_dpi(samples):
    doc = ingest(pdf_ref(samples / "invoice.pdf"), ContextSpec(images="always", dpi=36))
    assert all(p.image is not None and p.image.size == (298, 421) and p.image.mode == "RGB" for p in doc.pages)
    doc144 = ingest(pdf_ref(samples / "invoice.pdf"), ContextSpec(images="always", dpi=144, pages="1"))
    assert doc144.pages[0].image.size == (1190, 1684)
    assert "EUR 1,932.40" in doc.pages[1].text  # text is still extracted


def test_scanned_pdf_auto_and_never(samples):
    auto = ingest(pdf_ref(samples / "scanned.pdf"), ContextSpec())
    assert [p.scanned for p in auto.pages] == [True, True]
    assert all(p.text.strip() == "" and p.image is not None for p in auto.pages)
    # the rendered page is a picture of the text, not blank
    lo, hi = auto.pages[0].image.convert("L").getextrema()
    assert lo < 100 < hi
    never = ingest(pdf_ref(samples / "scanned.pdf"), ContextSpec(images="never"))
    assert all(p.image is None and p.scanned for p in never.pages)
    assert any("looks scanned" in n and "page 1" in n for n in never.notes)


def test_image_set_pages_in_natural_order(samples):
    job = job_in(samples.parent, f"[{{images: {samples.name}/imageset}}]")
    (ref,) = discover(job)
    doc = ingest(ref, ContextSpec())
    assert doc.page_count == 3 and [p.number for p in doc.pages] == [1, 2, 3]
    expected = ["page1.png", "page2.png", "page10.png"]
    assert sorted(IMAGESET_PAGES, key=natural_key) == expected
    for page, name in zip(doc.pages, expected):
        with Image.open(samples / "imageset" / name) as im:
            assert page.image.tobytes() == im.convert("RGB").tobytes()
        assert page.scanned and page.text == ""
    with pytest.raises(IngestError, match="images: never"):
        ingest(ref, ContextSpec(images="never"))


def test_sample_facts_reach_the_text(samples):
    for name, facts in SAMPLE_FACTS.items():
        if name == "scanned.pdf":
            continue  # pictures only: the facts are in the images
        text = ingest(pdf_ref(samples / name), ContextSpec()).text()
        for key, value in facts.items():
            assert value in text.replace("\n", " "), (name, key)


# -- page selection ---------------------------------------------------------


def test_page_selection(samples):
    ref = pdf_ref(samples / "report.pdf")
    doc = ingest(ref, ContextSpec(pages="2,-1"))
    assert [p.number for p in doc.pages] == [2, 4] and doc.page_count == 4
    assert doc.pages[1].text.startswith("Outlook")
    job = Job(spec=JobSpec(name="t", inputs=[str(ref.source)], tasks=[TaskSpec(name="a", prompt="p")],
                           output="o.jsonl", context=ContextSpec(pages="2,-1")), path=samples / "j.yaml", base_dir=samples)
    override = ingest(ref, with_pages(job, "1-2").spec.context)  # CLI --pages wins
    assert [p.number for p in override.pages] == [1, 2]
    # a selection past the end is clipped, and says so (issue 27: README's 1-20,35,-5 on short documents)
    clipped = ingest(ref, ContextSpec(pages="1-20,35,-5"))
    assert [p.number for p in clipped.pages] == [1, 2, 3, 4]
    assert clipped.pages_clipped == "pages '1-20,35,-5' reach past this 4-page document: 1-20 (kept 1-4), 35 (none left), -5 (none left)"
    assert ingest(ref, ContextSpec(pages="2,-1")).pages_clipped is None
    with pytest.raises(IngestError) as e:  # nothing left at all: the document fails, naming itself
        ingest(ref, ContextSpec(pages="20-30"))
    msg = str(e.value)
    assert msg.startswith(str(ref.source)) and "selects no page of this 4-page document" in msg


# -- broken documents -------------------------------------------------------


def test_zero_byte_corrupt_encrypted_empty(tmp_path):
    (tmp_path / "zero.pdf").write_bytes(b"")
    (tmp_path / "empty.pdf").write_bytes(EMPTY_PDF)
    (tmp_path / "text.pdf").write_text("just some text, not a PDF\n" * 20)
    cases = {
        "zero.pdf": "zero-byte file",
        make_corrupt_pdf(tmp_path / "corrupt.pdf").name: "not a readable PDF",
        "text.pdf": "not a readable PDF",
        make_encrypted_pdf(tmp_path / "locked.pdf").name: "encrypted PDF",
        "empty.pdf": "empty PDF: it has 0 pages",
    }
    for name, fragment in cases.items():
        with pytest.raises(IngestError) as e:
            ingest(pdf_ref(tmp_path / name), ContextSpec())
        assert str(e.value).startswith(str(tmp_path / name) + ": ") and fragment in str(e.value), str(e.value)


def test_vanished_file_is_an_ingest_error(tmp_path):
    with pytest.raises(IngestError, match="gone.pdf: cannot read file"):
        ingest(pdf_ref(tmp_path / "gone.pdf"), ContextSpec())


def test_broken_page_is_skipped_with_a_note(tmp_path, monkeypatch):
    path = make_broken_page_pdf(tmp_path / "b.pdf", pages=5, broken=(3,))
    calls = []
    real = pdf_mod._read_pdf_page
    monkeypatch.setattr(pdf_mod, "_read_pdf_page", lambda pdf, n, c, *route: calls.append(n) or real(pdf, n, c, *route))
    doc = ingest(pdf_ref(path), ContextSpec(page_retries=2))  # 1 of 5 failed = 0.2 <= 0.25
    assert [p.number for p in doc.pages] == [1, 2, 4, 5]
    assert doc.pages[2].text.startswith("Page 4: intact")
    assert len(doc.skipped_pages) == 1 and doc.skipped_pages[0]["page"] == 3
    assert "zlib" in doc.skipped_pages[0]["error"]  # MuPDF's own diagnosis is kept
    assert calls.count(3) == 3 and calls.count(1) == 1  # retried page_retries times, others once
    assert any(n.startswith("page 3: skipped after 3 attempt(s)") for n in doc.notes)


def test_too_many_failed_pages_fail_the_document(tmp_path):
    path = make_broken_page_pdf(tmp_path / "b.pdf", pages=5, broken=(2, 4))
    with pytest.raises(IngestError) as e:
        ingest(pdf_ref(path), ContextSpec())  # 2/5 = 0.4 > 0.25
    assert str(e.value).startswith(str(path)) and "2 of 5 selected pages" in str(e.value)
    assert "pages 2, 4" in str(e.value) and not e.value.transient  # the pages themselves are broken
    doc = ingest(pdf_ref(path), ContextSpec(max_failed_page_fraction=0.5))
    assert [p.number for p in doc.pages] == [1, 3, 5]
    # the fraction counts SELECTED pages: page 2 alone is 100% failed
    with pytest.raises(IngestError, match="1 of 1 selected pages"):
        ingest(pdf_ref(path), ContextSpec(max_failed_page_fraction=1.0, pages="2"))


def test_transient_page_failure_recovers_on_retry(samples, monkeypatch):
    real = pdf_mod._read_pdf_page
    failures = {2: 1}  # page 2 fails once, then reads fine

    def flaky(pdf, n, context, *route):
        if failures.get(n):
            failures[n] -= 1
            raise MemoryError("simulated")
        return real(pdf, n, context, *route)

    monkeypatch.setattr(pdf_mod, "_read_pdf_page", flaky)
    doc = ingest(pdf_ref(samples / "report.pdf"), ContextSpec(page_retries=1))
    assert [p.number for p in doc.pages] == [1, 2, 3, 4] and doc.skipped_pages == []
    failures[2] = 1
    doc = ingest(pdf_ref(samples / "report.pdf"), ContextSpec(page_retries=0))
    assert doc.skipped_pages == [{"page": 2, "error": "MemoryError: simulated"}]


@pytest.mark.parametrize("error", [MemoryError("simulated"), OSError(5, "Input/output error")])
def test_a_document_failing_for_memory_or_io_is_transient(samples, monkeypatch, error):
    """Out of memory or an I/O error while reading its pages says nothing of the
    document: its error record is transient, so a plain rerun retries it."""
    def failing(pdf, n, context, *route):
        raise error

    monkeypatch.setattr(pdf_mod, "_read_pdf_page", failing)
    with pytest.raises(IngestError) as e:
        ingest(pdf_ref(samples / "report.pdf"), ContextSpec(page_retries=0))
    assert e.value.transient and "4 of 4 selected pages" in str(e.value)


def test_a_half_copied_pdf_fails_with_its_name_and_nothing_unattributed_on_stderr(tmp_path):
    """MuPDF's own stderr lines name no file (a watcher's log read 'MuPDF
    error: format error: non-page object in page tree'); the error names it.
    In a fresh process: MuPDF's printing state is per process."""
    import subprocess
    import sys

    whole = make_text_pdf(tmp_path / "whole.pdf", ["hello world"] * 3)
    half = tmp_path / "half.pdf"
    half.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    code = ("import sys; from pathlib import Path; from pipeline.inputs.ingest import ingest; "
            "from pipeline.inputs.discover import DocumentRef; from pipeline.schema.job import ContextSpec\n"
            "try:\n    ingest(DocumentRef(source=Path(sys.argv[1]), kind='pdf', doc_id='half.pdf'), ContextSpec())\n"
            "except Exception as e:\n    print(e)")
    r = subprocess.run([sys.executable, "-c", code, str(half)], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[3])
    assert r.stdout.startswith(str(half)) and "could not be read" in r.stdout, (r.stdout, r.stderr)
    assert "MuPDF" not in r.stderr, r.stderr


def test_partially_readable_page_is_kept_with_a_note(tmp_path):
    import pymupdf

    path = make_text_pdf(tmp_path / "p.pdf", ["first page", "second page"])
    pdf = pymupdf.open(path)
    xref = pdf[1].get_contents()[0]
    pdf.update_stream(xref, b"BT /Helv 12 Tf 72 700 Td (partial text) Tj ET ((( unbalanced ] >>")
    pdf.save(tmp_path / "q.pdf")
    doc = ingest(pdf_ref(tmp_path / "q.pdf"), ContextSpec())
    assert [p.number for p in doc.pages] == [1, 2] and "partial" in doc.pages[1].text
    assert any(n.startswith("page 2: MuPDF reported problems") for n in doc.notes)


def test_corrupt_image_in_set(tmp_path):
    make_image_set(tmp_path / "s", {f"p{i}.png": str(i) for i in range(1, 5)})
    data = (tmp_path / "s" / "p3.png").read_bytes()
    (tmp_path / "s" / "p3.png").write_bytes(data[: len(data) // 3])  # truncated, like a half-copied file
    (ref,) = discover(job_in(tmp_path, "[{images: s}]"))
    doc = ingest(ref, ContextSpec())
    assert [p.number for p in doc.pages] == [1, 2, 4] and doc.skipped_pages[0]["page"] == 3
    (tmp_path / "s" / "p1.png").write_bytes(b"")
    with pytest.raises(IngestError, match="2 of 4 selected pages"):
        ingest(ref, ContextSpec())


def test_16_bit_grayscale_scans_keep_their_contrast(tmp_path):
    """Pillow's convert("RGB") clips I;16 at 255: a 16-bit scan became a white page."""
    import numpy as np

    from pipeline.inputs.images import to_rgb

    ramp = np.tile(np.linspace(0, 65535, 256), (64, 1)).astype(np.uint16)  # dark to light, left to right
    (tmp_path / "s").mkdir()
    Image.fromarray(ramp).save(tmp_path / "s" / "p1.png")
    (ref,) = discover(job_in(tmp_path, "[{images: s}]"))
    page = ingest(ref, ContextSpec()).pages[0]
    px = np.asarray(page.image)
    assert px.shape == (64, 256, 3) and px[0, 0, 0] == 0 and px[0, -1, 0] == 255
    assert abs(px.mean() - 127.5) < 1
    wide = Image.fromarray(np.array([[0, 100, 255]], np.int32), "I")  # 8-bit values in a 32-bit mode
    assert np.asarray(to_rgb(wide))[0, :, 0].tolist() == [0, 100, 255]
    floats = Image.fromarray(np.array([[0.0, 0.5, 1.0]], np.float32), "F")
    assert np.asarray(to_rgb(floats))[0, :, 0].tolist() == [0, 1, 1]  # 0-1 floats: held within 0-255, as they are


def test_a_multi_page_tiff_gives_a_page_per_frame(tmp_path):
    """A fax or a scanner's batch TIFF holds many pages in one file: each is a
    page (and --pages counts them); an animated GIF's frames are not pages,
    its first is read with a note."""
    frames = [Image.new("RGB", (50, 40), c) for c in ("red", "green", "blue")]
    (tmp_path / "s").mkdir()
    frames[0].save(tmp_path / "s" / "a.tif", save_all=True, append_images=frames[1:])
    frames[0].save(tmp_path / "s" / "b.gif", save_all=True, append_images=frames[1:])
    (ref,) = discover(job_in(tmp_path, "[{images: s}]"))
    doc = ingest(ref, ContextSpec())
    assert doc.page_count == 4 and [p.image.getpixel((0, 0)) for p in doc.pages] == [
        (255, 0, 0), (0, 128, 0), (0, 0, 255), (255, 0, 0)]
    assert doc.notes == ["page 4: b.gif holds 3 frames; the first is read"]
    doc = ingest(ref, ContextSpec(pages="2-3"))
    assert [p.image.getpixel((0, 0)) for p in doc.pages] == [(0, 128, 0), (0, 0, 255)]


# -- speed ------------------------------------------------------------------


def test_300_page_pdf_ingests_in_seconds(tmp_path):
    path = make_long_pdf(tmp_path / "long.pdf", pages=300)
    t = time.perf_counter()
    doc = ingest(pdf_ref(path), ContextSpec())
    elapsed = time.perf_counter() - t
    assert len(doc.pages) == 300 and "This is page 300 of 300" in doc.pages[-1].text
    assert elapsed < 10, f"300-page text ingest took {elapsed:.1f} s"


def test_scanned_detection_rule(tmp_path):
    """Scanned = no text, or almost no text (a stray page number) on a page with images."""
    import pymupdf

    from pipeline.inputs.samples import make_scanned_pdf

    scan = pymupdf.open(make_scanned_pdf(tmp_path / "s.pdf", ["scanned body text"]))
    scan[0].insert_text((500, 820), "12")  # an OCR'd page number over the picture
    out = pymupdf.open()
    out.insert_pdf(scan)
    short = out.new_page()
    short.insert_text((72, 72), "Chapter 1")  # short text, no images: a real text page
    out.new_page()  # blank page
    out.save(tmp_path / "mixed.pdf")
    doc = ingest(pdf_ref(tmp_path / "mixed.pdf"), ContextSpec())
    assert [(p.scanned, p.image is not None) for p in doc.pages] == [(True, True), (False, False), (True, True)]
    assert doc.pages[0].text.strip() == "12"


def test_concurrent_ingest_from_threads(samples, tmp_path):
    """The runner may ingest from a thread pool; MuPDF is serialized so warnings stay per page."""
    from concurrent.futures import ThreadPoolExecutor

    broken = make_broken_page_pdf(tmp_path / "b.pdf", pages=5, broken=(3,))
    refs = [pdf_ref(samples / "report.pdf"), pdf_ref(broken)] * 4
    with ThreadPoolExecutor(4) as pool:
        docs = list(pool.map(lambda r: ingest(r, ContextSpec()), refs))
    for ref, doc in zip(refs, docs):
        expected = [1, 2, 4, 5] if ref.source == broken else [1, 2, 3, 4]
        assert [p.number for p in doc.pages] == expected
        assert bool(doc.skipped_pages) == (ref.source == broken)


def test_a_poster_sized_page_is_rendered_within_the_pixel_cap(tmp_path):
    """A 100 x 100 inch page at 72 dpi would be 52 MP (and 225 MP at the OCR
    resolution): it is rendered at the dpi that fits, and the record says so."""
    import pymupdf

    pdf = pymupdf.open()
    pdf.new_page(width=7200, height=7200)
    pdf.new_page(width=612, height=792)
    pdf.save(tmp_path / "poster.pdf")
    doc = ingest(pdf_ref(tmp_path / "poster.pdf"), ContextSpec(images="always", dpi=72))
    big, letter = doc.pages[0].image, doc.pages[1].image
    assert big.width * big.height <= pdf_mod.MAX_RENDER_PIXELS and big.width == 50 * 100
    assert letter.size == (612, 792)  # a normal page keeps the job's dpi
    assert doc.notes == ["page 1: 100 x 100 in, rendered at 50 dpi instead of 72 to stay within 25 MP"]
