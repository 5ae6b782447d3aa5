"""The document-cache store: hits, misses that warn, LRU eviction, crashes and races."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import mlx.core as mx
import pytest

from pipeline.inference import kv_file
from pipeline.inference.doc_cache import DocCacheStore, DocKey, default_store_path
from tiny_models import prompt_tokens, tiny_llama
from turboquant import make_prompt_cache

REPO = Path(__file__).resolve().parents[3]


def key(**over) -> DocKey:
    fields = dict(content_hash="sha256:c0ffee", pages=None, model={"name": "tiny", "dtype": "float32"},
                  cache={"scheme": "turboquant", "kv_bits": 3.5, "window": 16},
                  context={"images": "auto", "dpi": 72}, reader="r1")
    fields.update(over)
    return DocKey(**fields)


@pytest.fixture(scope="module")
def prefilled():
    model = tiny_llama(seed=0, num_hidden_layers=2)
    caches = make_prompt_cache(model, kv_bits=3.5, window=16)
    toks = prompt_tokens(150)
    model(toks[None], cache=caches)
    mx.eval([c.state for c in caches])
    return model, caches, toks.tolist()


def test_miss_then_hit_after_save(tmp_path, prefilled):
    _, caches, ids = prefilled
    store = DocCacheStore(tmp_path)
    assert store.load(key(), ids) is None
    path = store.save(key(), caches, ids, {"length": len(ids)})
    assert path == store.path_for(key()) and path.is_file()
    hit = store.load(key(), ids)
    assert hit is not None and hit.info == {"length": len(ids)} and hit.load_s >= 0
    assert [c.offset for c in hit.caches] == [len(ids)] * 2
    assert hit.prefix_ids == ids
    (entry,) = store.entries()
    assert entry.name == f"c0ffee-{key().digest()}" and entry.error is None and entry.nbytes == path.stat().st_size
    assert [e.path for e in store.candidates("sha256:c0ffee")] == [path]
    assert store.candidates("sha256:c0ffef") == []  # another document: no header is read


def test_a_caller_with_other_tokens_replaces_the_entry(tmp_path, prefilled, caplog):
    """The document was read and cut to another budget: the entry is a miss
    and gone, so the caller's prefill stores the new reading."""
    _, caches, ids = prefilled
    store = DocCacheStore(tmp_path)
    store.save(key(), caches, ids, {})
    with caplog.at_level(logging.INFO):
        assert store.load(key(), ids[:-1]) is None
    assert "holds another cut of this document" in caplog.text and not store.path_for(key()).exists()


def test_every_key_field_separates_entries():
    base = key()
    variants = [key(content_hash="other"), key(pages="1-3"), key(model={"name": "other"}),
                key(cache={"scheme": "fp16"}), key(context={"images": "ocr"}), key(reader="r2"), key(version=0)]
    assert len({base.digest(), *(v.digest() for v in variants)}) == 1 + len(variants)


def test_default_path_follows_tqpipe_home(monkeypatch, tmp_path):
    monkeypatch.undo()  # conftest points the default at a per-test folder
    monkeypatch.setenv("TQPIPE_HOME", str(tmp_path))
    assert default_store_path() == tmp_path / "doc-caches"
    assert DocCacheStore().root == tmp_path / "doc-caches"


def test_file_from_another_model_is_a_miss_with_a_warning(tmp_path, prefilled, caplog):
    _, caches, ids = prefilled
    store = DocCacheStore(tmp_path)
    other = key(model={"name": "another-model", "dtype": "float32"})
    shutil.copy(store.save(other, caches, ids, {}), store.path_for(key()))  # planted under our name
    with caplog.at_level(logging.WARNING):
        assert store.load(key(), ids) is None
    assert "computed from something else (differs in: model)" in caplog.text
    assert not store.path_for(key()).exists() and store.path_for(other).exists()


def test_truncated_file_is_a_miss_with_a_warning(tmp_path, prefilled, caplog):
    _, caches, ids = prefilled
    store = DocCacheStore(tmp_path)
    path = store.save(key(), caches, ids, {})
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with caplog.at_level(logging.WARNING):
        assert store.load(key(), ids) is None
    assert "truncated" in caplog.text and not path.exists()
    assert store.save(key(), caches, ids, {}) == path and store.load(key(), ids) is not None


def test_lru_eviction_keeps_the_recently_used(tmp_path, prefilled):
    _, caches, ids = prefilled
    store = DocCacheStore(tmp_path)
    paths = [store.save(key(content_hash=f"d{i}"), caches, ids, {}) for i in range(3)]
    size = paths[0].stat().st_size
    for age, p in enumerate(reversed(paths)):  # d0 oldest ... d2 newest
        os.utime(p, (time.time() - 100 * (age + 1),) * 2)
    assert store.load(key(content_hash="d0"), ids) is not None  # d0 becomes the newest
    store.max_bytes = 3 * size  # room for three of the four
    new = store.save(key(content_hash="d3"), caches, ids, {})
    names = {e.name for e in store.entries()}
    assert names == {store.path_for(key(content_hash=h)).stem for h in ("d0", "d2", "d3")}
    assert new.exists() and store.total_bytes() <= store.max_bytes
    os.utime(new, (time.time() + 10,) * 2)  # beyond the clock tick that d0's touch shares
    assert store.prune(max_bytes=size) == [store.path_for(key(content_hash=h)).stem for h in ("d2", "d0")]
    assert [e.name for e in store.entries()] == [store.path_for(key(content_hash="d3")).stem]


def test_cache_larger_than_the_cap_is_not_stored(tmp_path, prefilled):
    _, caches, ids = prefilled
    store = DocCacheStore(tmp_path, max_bytes=1000)
    assert store.save(key(), caches, ids, {}) is None and store.entries() == []


def test_remove_by_prefix(tmp_path, prefilled):
    _, caches, ids = prefilled
    store = DocCacheStore(tmp_path)
    a = store.save(key(content_hash="a"), caches, ids, {})
    store.save(key(content_hash="b"), caches, ids, {})
    assert store.remove([a.stem[:8]]) == [a.stem]
    assert len(store.entries()) == 1


def test_files_the_store_did_not_name_are_never_listed_evicted_or_removed(tmp_path, prefilled):
    """A store folder may hold other .safetensors (cache_store.path pointed at a
    model folder): the store touches only entries it named itself."""
    _, caches, ids = prefilled
    store = DocCacheStore(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"not ours" * 1000)
    lookalike = tmp_path / "c0ffee-notes.safetensors"
    lookalike.write_bytes(b"also not ours")
    ours = store.save(key(), caches, ids, {})
    damaged = store.path_for(key(content_hash="d1"))
    damaged.write_bytes(b"a cache torn before its header")  # ours by name: an unusable entry
    assert {e.path for e in store.entries()} == {ours, damaged}
    assert store.remove(["model", "c0ffee-n"]) == []  # names the store did not give match nothing
    assert sorted(store.prune(max_bytes=0)) == sorted([ours.stem, damaged.stem]) and store.evict(0) == []
    assert store.entries() == [] and weights.read_bytes() == b"not ours" * 1000 and lookalike.exists()
    store.save(key(), caches, ids, {})  # a save evicts as it stores: still only its own entries
    assert weights.exists() and lookalike.exists()


_WRITER = textwrap.dedent("""
    import sys, time, os
    sys.path[:0] = [{repo!r}, {tests!r}]
    import turboquant
    import mlx.core as mx
    from pipeline.inference import kv_file
    from pipeline.inference.doc_cache import DocCacheStore, DocKey
    from tiny_models import prompt_tokens, tiny_llama
    from turboquant import make_prompt_cache
    model = tiny_llama(seed=0, num_hidden_layers=2)
    caches = make_prompt_cache(model, kv_bits=3.5, window=16)
    toks = prompt_tokens(150)
    model(toks[None], cache=caches)
    mx.eval([c.state for c in caches])
    mode, root = sys.argv[1], sys.argv[2]
    key = DocKey(content_hash="c0ffee", pages=None, model={{}}, cache={{}}, context={{}})
    if mode == "hang":  # stop between the complete temp file and the rename
        def hang(path):
            open(os.path.join(root, "READY"), "w").close()
            time.sleep(600)
        kv_file._fsync_file = hang
        DocCacheStore(root).save(key, caches, toks.tolist(), {{}})
    else:  # write the same key over and over
        open(os.path.join(root, f"READY-{{os.getpid()}}"), "w").close()
        for _ in range(int(mode)):
            kv_file.write(DocCacheStore(root).path_for(key), caches, toks.tolist(), key=key.fields(), info={{}})
""")


def _spawn(tmp_path, mode, root):
    script = tmp_path / "writer.py"
    script.write_text(_WRITER.format(repo=str(REPO), tests=str(REPO / "tests")))
    return subprocess.Popen([sys.executable, str(script), mode, str(root)])


def _wait_for(pred, timeout=120.0):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_kill_9_during_a_save_leaves_no_visible_entry(tmp_path, prefilled):
    root = tmp_path / "store"
    root.mkdir()
    proc = _spawn(tmp_path, "hang", root)
    try:
        assert _wait_for(lambda: (root / "READY").exists())
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    (root / "READY").unlink()
    temps = [p for p in root.iterdir()]
    assert len(temps) == 1 and temps[0].name.startswith(".")  # the dead writer's temporary file
    store = DocCacheStore(root)
    _, caches, ids = prefilled
    k = DocKey(content_hash="c0ffee", pages=None, model={}, cache={}, context={})
    assert store.entries() == [] and store.load(k, ids) is None
    assert store.prune() == []  # too young to be a dead writer's
    os.utime(temps[0], (time.time() - 7200,) * 2)
    assert store.prune() == [temps[0].name] and list(root.iterdir()) == []
    assert store.save(k, caches, ids, {}) is not None and store.load(k, ids) is not None


def test_two_writers_of_one_key_never_expose_a_broken_file(tmp_path, prefilled):
    root = tmp_path / "store"
    root.mkdir()
    procs = [_spawn(tmp_path, "6", root) for _ in range(2)]
    _, _, ids = prefilled
    k = DocKey(content_hash="c0ffee", pages=None, model={}, cache={}, context={})
    path = DocCacheStore(root).path_for(k)
    reads = 0
    try:
        assert _wait_for(lambda: len(list(root.glob("READY-*"))) == 2)
        while any(p.poll() is None for p in procs):
            if path.exists():
                got = kv_file.read(path, key=k.fields())  # raises if ever partial
                assert got.prefix_ids == ids
                reads += 1
    finally:
        for p in procs:
            p.wait(timeout=120)
    assert all(p.returncode == 0 for p in procs)
    assert reads > 0  # the reader did overlap the writers
    assert kv_file.read(path, key=k.fields()).prefix_ids == ids
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith("READY")) == [path.name]


def test_document_key_separates_what_changes_the_cache(tmp_path):
    from pipeline.inference.doc_cache import document_key, model_identity
    from pipeline.schema.job import CacheSpec, ContextSpec

    model = model_identity("m", {"model_type": "llama"})

    def k(ctx=ContextSpec(), m=model, cache=CacheSpec(), h="sha256:a", reads_images=False):
        return document_key(h, ctx, m, cache, reads_images=reads_images)

    base = k()
    # the limit and overflow policy only decide whether the document is cut (token ids are compared)
    assert base == k(ContextSpec(max_tokens=999)) == k(ContextSpec(overflow="error"))
    others = [
        k(h="sha256:b"), k(ContextSpec(pages="1-2")), k(ContextSpec(dpi=144)), k(ContextSpec(images="ocr")),
        k(ContextSpec(page_markers=False)), k(reads_images=True), k(m=model_identity("n", {})),
        k(cache=CacheSpec(kv_bits=3)), k(cache=CacheSpec(prefill_chunk=256)), k(cache=CacheSpec(quantizer="tcq")),
    ]
    assert len({base.digest(), *(o.digest() for o in others)}) == 1 + len(others)


def test_the_reader_fingerprint_follows_the_reading_code(monkeypatch, tmp_path):
    """A tqpipe whose PDF reading or prompt code differs is another reader: its
    caches are not answered from an older reading."""
    import pipeline
    from pipeline.inference import doc_cache

    doc_cache.reader_fingerprint.cache_clear()
    ours = doc_cache.reader_fingerprint()
    fake = tmp_path / "pipeline"
    for rel in doc_cache.READER_MODULES:
        (fake / rel).parent.mkdir(parents=True, exist_ok=True)
        (fake / rel).write_bytes((Path(pipeline.__file__).parent / rel).read_bytes())
    monkeypatch.setattr(pipeline, "__file__", str(fake / "__init__.py"))
    doc_cache.reader_fingerprint.cache_clear()
    assert doc_cache.reader_fingerprint() == ours  # same code, same reader
    (fake / "inputs/pdf.py").write_text((fake / "inputs/pdf.py").read_text() + "\n# changed\n")
    doc_cache.reader_fingerprint.cache_clear()
    assert doc_cache.reader_fingerprint() != ours
    doc_cache.reader_fingerprint.cache_clear()


def test_model_identity_follows_every_model_file(tmp_path):
    from pipeline.inference.doc_cache import model_identity

    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    a = model_identity("m", {}, model_dir=tmp_path)
    assert a == model_identity("m", {}, model_dir=tmp_path) and a["device"] and a["mlx"]
    (tmp_path / "model.safetensors").write_bytes(b"y" * 11)
    b = model_identity("m", {}, model_dir=tmp_path)
    assert b["files"] != a["files"]
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "other"}')  # a new template, same weights
    assert model_identity("m", {}, model_dir=tmp_path)["files"] != b["files"]


def test_a_store_that_cannot_be_written_is_a_warning(tmp_path, prefilled, caplog):
    _, caches, ids = prefilled
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    with caplog.at_level(logging.WARNING):
        assert DocCacheStore(blocker).save(key(), caches, ids, {}) is None
    assert "document cache not stored" in caplog.text


def test_any_error_while_reading_is_a_miss(tmp_path, prefilled, caplog, monkeypatch):
    _, caches, ids = prefilled
    store = DocCacheStore(tmp_path)
    store.save(key(), caches, ids, {})

    def broken(*a, **k):
        raise RuntimeError("unexpected")

    monkeypatch.setattr(kv_file, "read", broken)
    with caplog.at_level(logging.WARNING):
        assert store.load(key(), ids) is None
    assert "RuntimeError: unexpected" in caplog.text and not store.path_for(key()).exists()
