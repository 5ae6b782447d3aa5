"""Discovery and content hashing of documents (pipeline.inputs.discover)."""

from pathlib import Path

import pytest

from pipeline.inputs.discover import DocumentRef, content_hash, discover, natural_key
from pipeline.inputs.ingest import ingest
from pipeline.inputs.job_file import load_job
from pipeline.inputs.samples import make_image_set, make_text_pdf, write_samples
from pipeline.schema.job import ContextSpec
from input_refs import pdf_ref, job_in  # noqa: E402  (tests/pipeline/inputs)


# -- discovery --------------------------------------------------------------


def test_natural_sort():
    names = ["page10.png", "Page2.png", "page1.png", "page1b.png"]
    assert sorted(names, key=natural_key) == ["page1.png", "page1b.png", "Page2.png", "page10.png"]


def test_discover_folder_globs_and_dedupe(tmp_path):
    docs = tmp_path / "in"
    for name in ("r10.pdf", "r9.pdf", "R1.PDF"):
        make_text_pdf(docs / name, [name])
    make_image_set(docs / "scan2", {"p10.png": "c", "p2.png": "b", "p1.png": "a"})
    make_image_set(docs / "scan10", {"x.png": "x"})
    (docs / "empty_sub").mkdir()
    (docs / "readme.txt").write_text("ignored")
    (docs / ".r5.pdf").write_bytes(b"")  # hidden: a half-copied temp file
    (docs / "scan2" / "._p1.png").write_bytes(b"\0")  # macOS resource fork
    job = job_in(tmp_path, "[in/, 'in/r*.pdf', in/r9.pdf]")
    refs = discover(job)
    assert [(r.kind, r.doc_id) for r in refs] == [
        ("pdf", "in/R1.PDF"),
        ("pdf", "in/r9.pdf"),
        ("pdf", "in/r10.pdf"),
        ("images", "in/scan2"),
        ("images", "in/scan10"),
    ]  # the glob and the explicit file named PDFs already found: no duplicates
    scan = refs[3]
    assert [m.name for m in scan.members] == ["p1.png", "p2.png", "p10.png"]
    assert all(r.source.is_absolute() for r in refs)


def test_image_set_input_is_one_document(tmp_path):
    make_image_set(tmp_path / "shots", {"img10.png": "c", "img2.png": "b", "img1.png": "a", "other.png": "o"})
    job = job_in(tmp_path, "[{images: 'shots/img*.png'}, {images: shots}]")
    glob_ref, folder_ref = discover(job)
    assert glob_ref.kind == folder_ref.kind == "images"
    assert glob_ref.doc_id == "shots/img*.png"
    assert [m.name for m in glob_ref.members] == ["img1.png", "img2.png", "img10.png"]
    assert [m.name for m in folder_ref.members] == ["img1.png", "img2.png", "img10.png", "other.png"]


def test_single_image_file_is_a_one_page_document(tmp_path):
    make_image_set(tmp_path, {"photo.png": "hello"})
    (ref,) = discover(job_in(tmp_path, "[photo.png]"))
    doc = ingest(ref, ContextSpec())
    assert ref.kind == "images" and doc.page_count == 1 and doc.pages[0].image is not None


def test_doc_id_outside_job_folder(tmp_path):
    make_text_pdf(tmp_path / "data" / "x.pdf", ["x"])
    (tmp_path / "jobs").mkdir()
    (ref,) = discover(job_in(tmp_path / "jobs", "[../data/]"))
    assert ref.doc_id == "../data/x.pdf"


# -- hashing ----------------------------------------------------------------


def test_content_hash_tracks_bytes(tmp_path, samples):
    a = tmp_path / "a.pdf"
    a.write_bytes((samples / "report.pdf").read_bytes())
    h1 = content_hash(pdf_ref(a))
    assert h1.startswith("sha256:") and len(h1) == 7 + 64
    assert content_hash(pdf_ref(samples / "report.pdf")) == h1  # same bytes, other path
    a.write_bytes(a.read_bytes() + b"\n")
    assert content_hash(pdf_ref(a)) != h1


def test_image_set_hash_covers_names_and_bytes(tmp_path):
    make_image_set(tmp_path / "s", {"a.png": "one", "b.png": "two"})
    job = job_in(tmp_path, "[{images: s}]")
    h1 = content_hash(discover(job)[0])
    (tmp_path / "s" / "b.png").rename(tmp_path / "s" / "c.png")
    h2 = content_hash(discover(job)[0])
    assert h1 != h2
    assert content_hash(discover(job)[0]) == h2


def test_existing_name_with_glob_characters_is_taken_literally(tmp_path):
    make_text_pdf(tmp_path / "scan[1].pdf", ["literal"])
    make_text_pdf(tmp_path / "scan1.pdf", ["glob match"])
    (ref,) = discover(job_in(tmp_path, "['scan[1].pdf']"))
    assert ref.source.name == "scan[1].pdf"
    (ref,) = discover(job_in(tmp_path, "['scan[0-9].pdf']"))  # no such file: a real glob
    assert ref.source.name == "scan1.pdf"
