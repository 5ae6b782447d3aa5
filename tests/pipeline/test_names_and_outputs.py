"""Issue 27: file names that are not UTF-8, and an ``output:`` that must not write into other files."""

from __future__ import annotations

import base64
import logging
import os
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner
from fixtures_models import *  # noqa: F403

from pipeline.cli import main
from pipeline.inputs.samples import make_corrupt_pdf, make_text_pdf

BAD = os.fsdecode(b"caf\xe9 scan.pdf")  # Latin-1 bytes, as from an old zip or SMB share
NEWLINE = "two\nlines.pdf"


def make_job(tmp_path: Path, model: Path, *, output: str = "out/results.jsonl", inputs: str = "[docs/]",
             extra: str = "") -> Path:
    job = tmp_path / "job.yaml"
    job.write_text(
        f"name: names\ninputs: {inputs}\nmodel: {{path: '{model}'}}\n"
        "cache: {kv_quant_scheme: turboquant, kv_bits: 3.5, prefill_chunk: 64}\n"
        f"{extra}tasks:\n  - {{name: t0, prompt: 'Question?', max_tokens: 2}}\noutput: {output}\n"
    )
    return job


def lines(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def pdf_named(path: Path, text: str) -> Path:
    """A text PDF under any name (MuPDF itself only writes UTF-8 names)."""
    tmp = path.with_name("tmp-writing.pdf")
    make_text_pdf(tmp, [text])
    os.rename(tmp, path)
    return path


def docs_with_bad_names(tmp_path: Path) -> Path:
    d = tmp_path / "docs"
    d.mkdir()
    make_text_pdf(d / "a.pdf", ["First document."])
    pdf_named(d / BAD, "A name that is not UTF-8.")
    make_corrupt_pdf(d / os.fsdecode(b"broken \xff.pdf"))
    pdf_named(d / NEWLINE, "A newline in the name.")
    make_text_pdf(d / "z.pdf", ["Last document."])
    return d


def test_undecodable_names_never_stop_the_run_and_records_keep_the_bytes(tmp_path, tiny_vlm_dir, caplog):
    from pipeline.schema.paths import path_from_b64

    docs_with_bad_names(tmp_path)
    job = make_job(tmp_path, tiny_vlm_dir)
    with caplog.at_level(logging.INFO):
        r = CliRunner().invoke(main, ["run", str(job), "--no-progress"])
    assert r.exit_code == 1, r.output  # only the corrupt PDF failed
    recs = {x["doc_id"]: x for x in lines(tmp_path / "out" / "results.jsonl")}
    assert set(recs) == {"docs/a.pdf", "docs/caf\\xe9 scan.pdf", "docs/broken \\xff.pdf", "docs/two\nlines.pdf",
                         "docs/z.pdf"}
    bad = recs["docs/caf\\xe9 scan.pdf"]
    assert bad["status"] == "ok" and bad["source"].endswith("/docs/caf\\xe9 scan.pdf")
    assert base64.b64decode(bad["source_b64"]).endswith(b"/docs/caf\xe9 scan.pdf")
    assert path_from_b64(bad["source_b64"]).read_bytes().startswith(b"%PDF")  # the bytes lead back to the file
    assert "source_b64" not in recs["docs/a.pdf"]  # valid UTF-8 names: text only
    broken = recs["docs/broken \\xff.pdf"]
    assert broken["status"] == "error" and "broken \\xff.pdf" in broken["error"]["message"]  # names the file
    # a newline in a name cannot split a log line: names are quoted
    assert not any(line.startswith("lines.pdf") for line in caplog.text.splitlines())
    assert "'docs/two\\nlines.pdf'" in caplog.text
    # a rerun skips everything, still exit 1 for the one broken file
    r = CliRunner().invoke(main, ["run", str(job), "--no-progress"])
    assert r.exit_code == 1 and "0 records" in r.output


def test_shown_quotes_only_odd_names():
    from pipeline.schema.paths import shown

    assert shown("/data/report.pdf") == "/data/report.pdf"
    assert shown(NEWLINE) == "'two\\nlines.pdf'"
    assert shown(BAD) == "'caf\\xe9 scan.pdf'"


def test_watch_survives_undecodable_names_across_restarts(tmp_path, tiny_vlm_dir):
    (tmp_path / "docs").mkdir()
    job = make_job(tmp_path, tiny_vlm_dir, inputs="[]")
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    pdf_named(inbox / BAD, "Dropped with a Latin-1 name.")
    (inbox / os.fsdecode(b"copy \xe9.pdf")).write_bytes((inbox / BAD).read_bytes())  # same bytes, bad name too
    args = ["watch", str(inbox), "--job", str(job), "--settle", "0", "--poll", "0.05", "--max-polls", "4"]
    for _ in range(2):  # the restart used to exit 2 on the duplicate's ledger entry
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 0, r.output
    ledger = lines(tmp_path / "out" / "results.jsonl.inbox.jsonl")
    assert sorted(e["path"] for e in ledger) == ["caf\\xe9 scan.pdf", "copy \\xe9.pdf"]
    assert {e["status"] for e in ledger} <= {"ok", "duplicate"}
    assert all(base64.b64decode(e["path_b64"]).startswith((b"caf\xe9", b"copy \xe9")) for e in ledger)
    recs = lines(tmp_path / "out" / "results.jsonl")
    assert sorted(x["doc_id"].rsplit("/", 1)[-1] for x in recs) == ["caf\\xe9 scan.pdf", "copy \\xe9.pdf"]
    copy = next(x for x in recs if "copy" in x["doc_id"])
    assert copy["same_content_as"].endswith("caf\\xe9 scan.pdf") and copy["status"] == "ok"


# -- output: ------------------------------------------------------------------


@pytest.fixture
def one_doc(tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    make_text_pdf(d / "a.pdf", ["Only document."])
    return d


@pytest.mark.parametrize("output, reason", [
    ("docs/a.pdf", "is an input document of this job (docs/a.pdf)"),
    ("job.yaml", "is the job file itself"),
    ("docs", "is a folder"),
    ("notes.jsonl", "is not a tqpipe results file (none of its first lines is a tqpipe record)"),
    ("link.jsonl", "is an input document of this job (docs/a.pdf)"),
    ("dangling.jsonl", "is a symlink to nothing"),
])
def test_output_refuses_other_files_with_one_line_exit_2(tmp_path, one_doc, tiny_vlm_dir, output, reason):
    (tmp_path / "notes.jsonl").write_text('{"note": "someone else\'s data"}\n')
    (tmp_path / "link.jsonl").symlink_to(one_doc / "a.pdf")
    (tmp_path / "dangling.jsonl").symlink_to(tmp_path / "nowhere" / "x.jsonl")
    job = make_job(tmp_path, tiny_vlm_dir, output=output)
    before = {p: p.read_bytes() for p in (one_doc / "a.pdf", job, tmp_path / "notes.jsonl")}
    for cmd in (["run"], ["validate"], ["status"]):
        r = CliRunner().invoke(main, [*cmd, str(job)])
        assert r.exit_code == 2, (cmd, r.output)
        [line] = r.output.strip().splitlines()
        assert line.startswith(f"tqpipe: error: {job}: output: ") and reason in line, line
    assert all(p.read_bytes() == data for p, data in before.items())  # nothing was appended anywhere


def test_output_may_be_any_folder_new_file_or_our_results(tmp_path, one_doc, tiny_vlm_dir):
    shared = tmp_path / "elsewhere" / "shared results"
    job = make_job(tmp_path, tiny_vlm_dir, output=str(shared / "r.jsonl"))
    r = CliRunner().invoke(main, ["validate", str(job)])
    assert r.exit_code == 0 and f"output:    {shared / 'r.jsonl'} (new)" in r.output
    assert CliRunner().invoke(main, ["run", str(job), "--no-progress"]).exit_code == 0
    (tmp_path / "mine.jsonl").symlink_to(shared / "r.jsonl")  # a symlink to a results file is fine
    job = make_job(tmp_path, tiny_vlm_dir, output="mine.jsonl")
    r = CliRunner().invoke(main, ["validate", str(job)])
    assert r.exit_code == 0 and f"output:    {shared / 'r.jsonl'}" in r.output  # the resolved path
    r = CliRunner().invoke(main, ["run", str(job), "--no-progress"])
    assert r.exit_code == 0 and "0 records" in r.output


@pytest.mark.parametrize("damage", ["first byte lost", "byte-order mark", "junk first line"])
def test_a_damaged_first_line_leaves_the_other_records_reachable(tmp_path, one_doc, tiny_vlm_dir, damage):
    """A results file whose first line was mangled is still ours: status,
    export and run read the rest (the bad line is skipped with a warning,
    its key done again), instead of refusing the whole file."""
    make_text_pdf(one_doc / "b.pdf", ["Second document."])
    job = make_job(tmp_path, tiny_vlm_dir)
    assert CliRunner().invoke(main, ["run", str(job), "--no-progress"]).exit_code == 0
    out = tmp_path / "out" / "results.jsonl"
    data = out.read_bytes()
    out.write_bytes({"first byte lost": data[1:], "byte-order mark": b"\xef\xbb\xbf" + data,
                     "junk first line": b"#!garbage\n" + data}[damage])
    r = CliRunner().invoke(main, ["status", str(job)])
    assert r.exit_code == 0 or "pending" in r.output, r.output
    assert "not a tqpipe results file" not in r.output
    r = CliRunner().invoke(main, ["run", str(job), "--no-progress"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["status", str(job)])
    assert r.exit_code == 0 and "done 2, failed 0, pending 0" in r.output, r.output


def test_validate_refuses_an_output_that_cannot_be_written(tmp_path, one_doc, tiny_vlm_dir, monkeypatch):
    """What run would meet at its first append (exit 4), validate says before
    anything runs; a read-only mount is simulated (this may run as root)."""
    import os as real_os

    import pipeline.output.target as target

    ro = tmp_path / "ro"
    ro.mkdir()
    job = make_job(tmp_path, tiny_vlm_dir, output=str(ro / "new" / "r.jsonl"))
    statvfs, access = real_os.statvfs, real_os.access  # target.os is this os: keep the originals

    class ReadOnly:
        def __init__(self, st):
            self.f_flag = st.f_flag | real_os.ST_RDONLY

    monkeypatch.setattr(target.os, "statvfs", lambda p: ReadOnly(statvfs(p)) if Path(p) == ro else statvfs(p))
    r = CliRunner().invoke(main, ["validate", str(job)])
    assert r.exit_code == 4, r.output
    [line] = r.output.strip().splitlines()
    assert line == f"tqpipe: error: {job}: output: {ro / 'new' / 'r.jsonl'} cannot be written: {ro} is on a read-only file system"
    monkeypatch.setattr(target.os, "statvfs", statvfs)
    monkeypatch.setattr(target.os, "access", lambda p, mode: Path(p) != ro)
    r = CliRunner().invoke(main, ["validate", str(job)])
    assert r.exit_code == 4 and f"the folder {ro} is not writable" in r.output, r.output
    monkeypatch.setattr(target.os, "access", access)
    assert CliRunner().invoke(main, ["validate", str(job)]).exit_code == 0


def test_an_image_set_with_an_undecodable_member_name_is_read(tmp_path, tiny_vlm_dir):
    """Image-set members are hashed by their name's bytes: a Latin-1 name no
    longer stops run and status with a UnicodeEncodeError, and a UTF-8 name
    hashes as it always did (records already written keep their keys)."""
    import hashlib

    from pipeline.inputs.discover import DocumentRef, content_hash
    from pipeline.inputs.samples import make_image_set

    folder = make_image_set(tmp_path / "docs" / "scans", {"p1.png": "Page one.", "p2.png": "Page two."})
    os.rename(folder / "p2.png", folder / os.fsdecode(b"p\xe9.png"))
    job = make_job(tmp_path, tiny_vlm_dir)
    r = CliRunner().invoke(main, ["run", str(job)])
    assert r.exit_code == 0, r.output
    (rec,) = lines(tmp_path / "out" / "results.jsonl")
    assert rec["status"] == "ok" and rec["doc_id"] == "docs/scans"
    r = CliRunner().invoke(main, ["status", str(job)])
    assert r.exit_code == 0 and "done 1, failed 0, pending 0" in r.output, r.output

    good = folder / "p1.png"
    expected = hashlib.sha256(f"{good.name}\0{good.stat().st_size}\0".encode() + good.read_bytes()).hexdigest()
    assert content_hash(DocumentRef(source=folder, kind="images", doc_id="x", members=(good,))) == "sha256:" + expected
