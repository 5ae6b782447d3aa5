"""Find the documents a job names, and hash their bytes.

Discovery touches no file contents and hashing only streams bytes, so the
work plan can compute every record key and skip finished documents before
paying for :func:`pipeline.inputs.ingest.ingest`.  An image set (a folder or
glob of images) is ONE multi-page document, one image per page, natural order.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pipeline.errors import IngestError, JobFileError
from pipeline.schema.job import ImageSetInput, Job

PDF_SUFFIXES = frozenset({".pdf"})
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp", ".webp", ".gif"})


@dataclass(frozen=True)
class DocumentRef:
    """A document found by discovery: enough to hash and read it, nothing read yet."""

    source: Path  # the PDF, the image folder, or (glob image sets) the absolute pattern
    kind: Literal["pdf", "images"]
    doc_id: str  # stable and readable: source relative to the job's folder
    members: tuple[Path, ...] = ()  # image sets: the image files, in page order



def natural_key(path: str | Path) -> tuple:
    """Sort key that orders ``page2`` before ``page10`` (case-insensitive)."""
    return tuple(int(t) if t.isdigit() else t.lower() for t in re.split(r"(\d+)", str(path)))


def discover(job: Job) -> list[DocumentRef]:
    """All documents of ``job``, in input order then natural order, without duplicates."""
    seen: set[tuple] = set()
    refs: list[DocumentRef] = []
    for item in job.spec.inputs:
        for ref in expand_input(job, item):
            key = (ref.kind, ref.source, ref.members)
            if key not in seen:
                seen.add(key)
                refs.append(ref)
    return refs


def _input_folders(job: Job) -> list[tuple[str, Path]]:
    """``(inputs entry, folder)`` for each entry that names a folder (not an
    ``{images: ...}`` set): where a folder input can pass files over."""
    return [(item, job.resolve(item)) for item in job.spec.inputs
            if not isinstance(item, ImageSetInput) and job.resolve(item).is_dir()]


def unsupported_files(job: Job) -> list[Path]:
    """Visible files in the job's input folders that are neither PDFs nor
    images, so no document: a folder input passes them over (unlike a file
    named on its own, an error), and ``validate`` and ``run`` say which."""
    return [c for _, folder in _input_folders(job) for c in sorted(folder.iterdir(), key=natural_key)
            if _visible(c) and c.is_file() and c.suffix.lower() not in PDF_SUFFIXES | IMAGE_SUFFIXES]


def unread_entries(job: Job) -> list[tuple[Path, str]]:
    """Entries of the job's input folders that look like documents but are
    not read, each with why: a sub-folder holding PDFs (folders are read one
    level deep: their PDFs, and each sub-folder of images as an image set)
    and a document name that is a symlink to nothing.  ``validate`` and
    ``run`` name them, so no document is left out without a word."""
    out: list[tuple[Path, str]] = []
    for item, folder in _input_folders(job):
        for c in sorted(folder.iterdir(), key=natural_key):
            if not _visible(c):
                continue
            if c.is_symlink() and not c.exists() and c.suffix.lower() in PDF_SUFFIXES | IMAGE_SUFFIXES:
                out.append((c, "a symlink to nothing"))
            elif c.is_dir() and not _images(c.iterdir()) and any(  # a bounded look: a huge tree is no input
                    _visible(g) and g.suffix.lower() in PDF_SUFFIXES for g in itertools.islice(c.rglob("*"), 10_000)):
                out.append((c, f"a folder of PDFs, not searched (name it in inputs:, or a glob such as "
                               f"'{item.rstrip('/')}/**/*.pdf')"))
    return out


def expand_input(job: Job, item: str | ImageSetInput) -> list[DocumentRef]:
    """The documents one ``inputs:`` entry names (possibly none).

    A string is a file, a folder or a glob.  A folder yields its PDFs, each
    direct sub-folder that holds images as one image set, and its own loose
    images (if any) as one image set.  ``{images: ...}`` is always exactly one
    image set.  Unsupported explicit files raise :class:`JobFileError`.
    """
    if isinstance(item, ImageSetInput):
        target = job.resolve(item.images)
        if _is_glob(item.images) and not target.exists():  # "scan[1]" may be a real name
            files = _images(Path(p) for p in glob.glob(str(target), recursive=True))
            return [_image_set(job, target, files)] if files else []
        if target.is_dir():
            files = _images(target.iterdir())
            return [_image_set(job, target, files)] if files else []
        if not target.exists():
            return []
        raise JobFileError(job.path, None, f"{item.images!r} is not a folder or a glob of images")
    target = job.resolve(item)
    if _is_glob(item) and not target.exists():
        matches = sorted((Path(p) for p in glob.glob(str(target), recursive=True)), key=natural_key)
        return [ref for m in matches for ref in _refs_for_path(job, m, explicit=False)]
    if not target.exists():
        return []
    return _refs_for_path(job, target, explicit=True)


def _refs_for_path(job: Job, path: Path, *, explicit: bool) -> list[DocumentRef]:
    suffix = path.suffix.lower()
    if path.is_dir():
        children = sorted(path.iterdir(), key=natural_key)
        refs = [_pdf(job, c) for c in children if _visible(c) and c.is_file() and c.suffix.lower() in PDF_SUFFIXES]
        loose = _images(children)
        if loose:
            refs.append(_image_set(job, path, loose))
        for sub in children:
            if _visible(sub) and sub.is_dir() and (files := _images(sub.iterdir())):
                refs.append(_image_set(job, sub, files))
        return refs
    if suffix in PDF_SUFFIXES:
        return [_pdf(job, path)]
    if suffix in IMAGE_SUFFIXES:
        return [_image_set(job, path, (path,))]
    if explicit:
        raise JobFileError(
            job.path, None, f"{str(path)!r} is neither a PDF nor an image ({', '.join(sorted(IMAGE_SUFFIXES))})"
        )
    return []  # a glob may sweep up unrelated files


def _images(paths) -> tuple[Path, ...]:
    found = (p for p in paths if _visible(p) and p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    return tuple(sorted(found, key=natural_key))


def _visible(p: Path) -> bool:
    """Hidden files are editor locks, macOS ``._`` forks or half-copied temp files, not documents."""
    return not p.name.startswith(".")


def _is_glob(s: str) -> bool:
    return any(c in s for c in "*?[")


def _doc_id(job: Job, path: Path) -> str:
    return Path(os.path.relpath(path, job.base_dir)).as_posix()


def _pdf(job: Job, path: Path) -> DocumentRef:
    path = Path(os.path.abspath(path))  # not resolve(): a symlink keeps its readable name
    return DocumentRef(source=path, kind="pdf", doc_id=_doc_id(job, path))


def _image_set(job: Job, source: Path, files: tuple[Path, ...]) -> DocumentRef:
    source = Path(os.path.abspath(source))
    members = tuple(Path(os.path.abspath(f)) for f in files)
    return DocumentRef(source=source, kind="images", doc_id=_doc_id(job, source), members=members)


def content_hash(ref: DocumentRef) -> str:
    """``sha256:<hex>`` of the file bytes (image sets: of each member's name, size and bytes).

    Streams in 1 MiB blocks, so it is cheap next to ingestion and safe on
    huge files.  Raises :class:`IngestError` (``transient``) if a file cannot be read.
    """
    h = hashlib.sha256()
    files = ref.members if ref.kind == "images" else (ref.source,)
    for f in files:
        try:
            if ref.kind == "images":  # the name's own bytes: not every name is UTF-8 (same hash where it is)
                h.update(os.fsencode(f.name) + f"\0{f.stat().st_size}\0".encode())
            with open(f, "rb") as fh:
                while block := fh.read(1 << 20):
                    h.update(block)
        except OSError as e:
            raise IngestError(f, f"cannot read file: {e.strerror or e}", transient=True) from None
    return "sha256:" + h.hexdigest()


def unreadable_digest(ref: DocumentRef) -> str:
    """The stand-in content hash of a file that cannot be read, one per path,
    so its error records have keys of their own (and the retry rule applies)."""
    return "unreadable:" + hashlib.sha256(os.fsencode(ref.source)).hexdigest()[:16]


def name_tag(ref: DocumentRef) -> str:
    """A short stable tag of a document's name (its ``doc_id`` bytes), for the
    record keys of a second name with the same content (:mod:`pipeline.run.plan`)."""
    return hashlib.sha256(os.fsencode(ref.doc_id)).hexdigest()[:12]


