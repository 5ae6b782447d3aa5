"""Sample document generator (pipeline.inputs.samples): contents, determinism, damaged files."""

import subprocess
import sys
from pathlib import Path

import pymupdf
import pytest

from pipeline.inputs.samples import (
    IMAGESET_PAGES,
    SAMPLE_FACTS,
    long_pdf_code_word,
    make_broken_page_pdf,
    make_corrupt_pdf,
    make_encrypted_pdf,
    make_long_pdf,
    write_samples,
)


def tree_bytes(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_write_samples_layout(tmp_path):
    paths = write_samples(tmp_path)
    assert [p.name for p in paths] == ["report.pdf", "invoice.pdf", "minutes.pdf", "scanned.pdf", "imageset"]
    assert all(p.exists() for p in paths)
    assert sorted(p.name for p in (tmp_path / "imageset").iterdir()) == sorted(IMAGESET_PAGES)
    assert set(SAMPLE_FACTS) <= {p.name for p in paths}


def test_text_samples_state_their_facts(tmp_path):
    write_samples(tmp_path)
    for name in ("report.pdf", "invoice.pdf", "minutes.pdf"):
        with pymupdf.open(tmp_path / name) as doc:
            assert doc.page_count >= 2  # multi-page: facts are spread over pages
            text = " ".join(page.get_text() for page in doc).replace("\n", " ")
            assert doc.metadata["title"] == SAMPLE_FACTS[name]["title"]
        for key, value in SAMPLE_FACTS[name].items():
            assert value in text, (name, key, value)


def test_scanned_sample_has_only_images(tmp_path):
    write_samples(tmp_path)
    with pymupdf.open(tmp_path / "scanned.pdf") as doc:
        assert doc.page_count == 2
        for page in doc:
            assert page.get_text().strip() == ""
            assert len(page.get_images()) == 1


def test_samples_are_byte_identical_across_runs_and_processes(tmp_path):
    write_samples(tmp_path / "a")
    write_samples(tmp_path / "b")
    code = "import sys; from pipeline.inputs.samples import write_samples; write_samples(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "c")], check=True)
    a = tree_bytes(tmp_path / "a")
    assert len(a) == 7 and a == tree_bytes(tmp_path / "b") == tree_bytes(tmp_path / "c")


def test_long_pdf(tmp_path):
    path = make_long_pdf(tmp_path / "long.pdf", pages=40)
    with pymupdf.open(path) as doc:
        assert doc.page_count == 40
        text = doc[16].get_text().replace("\n", " ")
        assert "This is page 17 of 40." in text
        assert f"The code word for page 17 is {long_pdf_code_word(17)}." in text
        assert len(text) > 1500  # a realistic amount of text per page
    assert long_pdf_code_word(17) != long_pdf_code_word(18)
    assert make_long_pdf(tmp_path / "again.pdf", pages=40).read_bytes() == path.read_bytes()


def test_damaged_files_are_damaged(tmp_path):
    with pymupdf.open(make_encrypted_pdf(tmp_path / "e.pdf")) as doc:
        assert doc.needs_pass and not doc.authenticate("wrong") and doc.authenticate("secret")
    with pytest.raises(Exception):
        pymupdf.open(make_corrupt_pdf(tmp_path / "c.pdf"), filetype="pdf")
    with pymupdf.open(make_broken_page_pdf(tmp_path / "b.pdf", pages=4, broken=(2,))) as doc:
        assert doc.page_count == 4
        pymupdf.TOOLS.mupdf_warnings(reset=True)
        assert doc[1].get_text() == ""
        assert "zlib" in pymupdf.TOOLS.mupdf_warnings(reset=True)
        assert "intact text of page 3" in doc[2].get_text()
