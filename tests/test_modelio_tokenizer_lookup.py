"""Where the GPT-2 BPE files come from: GPT2_TOKENIZER_DIR, then tiktoken's cache
(TIKTOKEN_CACHE_DIR, then DATA_GYM_CACHE_DIR), then the project's cache, then a download. Every
test runs in temporary folders with any download made to fail loudly.
"""

from __future__ import annotations

import logging
import shutil
import urllib.request
from pathlib import Path

import pytest
import tiktoken.load
import tiktoken_ext.openai_public

from gpt2.model import tokenizer
from gpt2.model.tokenizer import (
    BPE_SHA256,
    TokenizerNotAvailableError,
    _load_tokenizer,
    bpe_files,
    get_tokenizer,
    tiktoken_cache_name,
)

NAMES = ("vocab.bpe", "encoder.json")
URLS = {name: "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/" + name for name in NAMES}


class DownloadAttempted(AssertionError):
    """Raised by the faked network: no test here may download."""


@pytest.fixture
def env(tmp_path, monkeypatch):
    """No source set, an empty project cache, and no network (tiktoken's nor ours)."""
    for name in ("GPT2_TOKENIZER_DIR", "TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GPT2_CACHE_DIR", str(tmp_path / "project-cache"))

    def no_download(url, *args, **kwargs):
        raise DownloadAttempted(f"a download was attempted: {url}")

    monkeypatch.setattr(urllib.request, "urlopen", no_download)
    monkeypatch.setattr(tiktoken.load, "read_file", no_download)
    _load_tokenizer.cache_clear()
    yield monkeypatch
    _load_tokenizer.cache_clear()


def _tiktoken_writes_its_cache(shared_data, monkeypatch, directory) -> None:
    """Fill ``directory`` the way a user's online ``tiktoken.get_encoding("gpt2")`` does: tiktoken's
    own gpt2 loader, with its fetch served from the offline copies.
    """
    served = {url: (shared_data / "gpt2-tokenizer" / name).read_bytes() for name, url in URLS.items()}
    with monkeypatch.context() as patch:
        patch.setenv("TIKTOKEN_CACHE_DIR", str(directory))
        patch.setattr(tiktoken.load, "read_file", served.__getitem__)
        tiktoken_ext.openai_public.gpt2()


def _project_cache(shared_data, tmp_path, *names):
    folder = tmp_path / "project-cache" / "gpt2-tokenizer"
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copy(shared_data / "gpt2-tokenizer" / name, folder / name)
    return folder


def test_tiktoken_cache_names_match_tiktoken(shared_data, tmp_path, env):
    _tiktoken_writes_its_cache(shared_data, env, tmp_path / "tiktoken")
    assert sorted(p.name for p in (tmp_path / "tiktoken").iterdir()) == sorted(
        tiktoken_cache_name(url) for url in URLS.values()
    )
    # The offline copy that ../shared/data documents uses the same names.
    assert {tiktoken_cache_name(url) for url in URLS.values()} <= {
        p.name for p in (shared_data / "tiktoken-cache").iterdir()
    }


def test_offline_tiktoken_cache_is_read_without_a_download(shared_data, tmp_path, env):
    _tiktoken_writes_its_cache(shared_data, env, tmp_path / "tiktoken")
    env.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken"))
    vocab_bpe, encoder_json = bpe_files()
    assert vocab_bpe == tmp_path / "tiktoken" / tiktoken_cache_name(URLS["vocab.bpe"])
    assert encoder_json == tmp_path / "tiktoken" / tiktoken_cache_name(URLS["encoder.json"])
    text = "Hello there<|endoftext|>"
    assert get_tokenizer().encode(text) == tiktoken.Encoding(**tiktoken_ext.openai_public.gpt2()).encode(
        text, allowed_special="all"
    )
    assert not (tmp_path / "project-cache").exists()


def test_data_gym_cache_dir_is_read_too(shared_data, tmp_path, env):
    shutil.copytree(shared_data / "tiktoken-cache", tmp_path / "data-gym")
    env.setenv("DATA_GYM_CACHE_DIR", str(tmp_path / "data-gym"))
    assert all(path.parent == tmp_path / "data-gym" for path in bpe_files())
    assert get_tokenizer().n_vocab == 50257


def test_order_tokenizer_dir_then_tiktoken_then_data_gym_then_project_cache(shared_data, tmp_path, env):
    _project_cache(shared_data, tmp_path, *NAMES)
    assert all(path.parent == tmp_path / "project-cache" / "gpt2-tokenizer" for path in bpe_files())

    shutil.copytree(shared_data / "tiktoken-cache", tmp_path / "data-gym")
    env.setenv("DATA_GYM_CACHE_DIR", str(tmp_path / "data-gym"))
    assert all(path.parent == tmp_path / "data-gym" for path in bpe_files())

    shutil.copytree(shared_data / "tiktoken-cache", tmp_path / "tiktoken")
    env.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken"))
    assert all(path.parent == tmp_path / "tiktoken" for path in bpe_files())

    # An explicit folder (Hugging Face names here) wins over every cache.
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "merges.txt").symlink_to(shared_data / "gpt2-tokenizer" / "vocab.bpe")
    (tmp_path / "hf" / "vocab.json").symlink_to(shared_data / "gpt2-tokenizer" / "encoder.json")
    env.setenv("GPT2_TOKENIZER_DIR", str(tmp_path / "hf"))
    assert bpe_files() == (tmp_path / "hf" / "merges.txt", tmp_path / "hf" / "vocab.json")
    # ... and when it lacks the files, nothing else is tried.
    env.setenv("GPT2_TOKENIZER_DIR", str(tmp_path / "missing"))
    with pytest.raises(TokenizerNotAvailableError, match="GPT2_TOKENIZER_DIR"):
        bpe_files()


def test_empty_or_missing_tiktoken_caches_fall_through(shared_data, tmp_path, env):
    _project_cache(shared_data, tmp_path, *NAMES)
    # An empty value turns tiktoken's cache off; a folder without the files has nothing to give.
    env.setenv("TIKTOKEN_CACHE_DIR", "")
    env.setenv("DATA_GYM_CACHE_DIR", str(tmp_path / "no-such-folder"))
    assert all(path.parent == tmp_path / "project-cache" / "gpt2-tokenizer" for path in bpe_files())


def test_each_file_is_looked_up_on_its_own(shared_data, tmp_path, env):
    """vocab.bpe only in tiktoken's cache, encoder.json only in the project's: no download."""
    (tmp_path / "tiktoken").mkdir()
    name = tiktoken_cache_name(URLS["vocab.bpe"])
    shutil.copy(shared_data / "tiktoken-cache" / name, tmp_path / "tiktoken" / name)
    project = _project_cache(shared_data, tmp_path, "encoder.json")
    env.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken"))
    assert bpe_files() == (tmp_path / "tiktoken" / name, project / "encoder.json")
    assert get_tokenizer().n_vocab == 50257


def test_a_damaged_tiktoken_file_is_passed_over(shared_data, tmp_path, env, caplog):
    shutil.copytree(shared_data / "tiktoken-cache", tmp_path / "tiktoken")
    damaged = tmp_path / "tiktoken" / tiktoken_cache_name(URLS["encoder.json"])
    damaged.chmod(0o644)
    damaged.write_bytes(damaged.read_bytes()[:-10])
    project = _project_cache(shared_data, tmp_path, *NAMES)
    env.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken"))
    with caplog.at_level(logging.WARNING, logger=tokenizer.__name__):
        vocab_bpe, encoder_json = bpe_files()
    assert vocab_bpe.parent == tmp_path / "tiktoken" and encoder_json == project / "encoder.json"
    assert str(damaged) in caplog.text and BPE_SHA256["encoder.json"] in caplog.text
    # tiktoken's cache is left as it was: it is tiktoken's to repair.
    assert damaged.is_file()


def test_nothing_cached_downloads_into_the_project_cache_only(shared_data, tmp_path, env):
    (tmp_path / "tiktoken").mkdir()
    env.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken"))
    with pytest.raises(DownloadAttempted, match="vocab.bpe"):
        bpe_files()

    fetched = []

    def serve(url, timeout):
        fetched.append(url)
        return open(shared_data / "gpt2-tokenizer" / url.rsplit("/", 1)[1], "rb")

    env.setattr(urllib.request, "urlopen", serve)
    vocab_bpe, encoder_json = bpe_files()
    assert fetched == [URLS["vocab.bpe"], URLS["encoder.json"]]
    assert (vocab_bpe, encoder_json) == tuple(tmp_path / "project-cache" / "gpt2-tokenizer" / n for n in NAMES)
    assert list((tmp_path / "tiktoken").iterdir()) == []


def test_offline_error_names_the_tiktoken_variable(tmp_path, env):
    def offline(url, timeout):
        raise OSError("network disabled in tests")

    env.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(TokenizerNotAvailableError) as info:
        get_tokenizer()
    for hint in ("GPT2_TOKENIZER_DIR", "TIKTOKEN_CACHE_DIR", str(tmp_path / "project-cache" / "gpt2-tokenizer")):
        assert hint in str(info.value)


def test_get_tokenizer_is_cached_per_tiktoken_cache(shared_data, tmp_path, env):
    shutil.copytree(shared_data / "tiktoken-cache", tmp_path / "a")
    env.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "a"))
    first = get_tokenizer()
    assert get_tokenizer() is first
    shutil.copytree(shared_data / "tiktoken-cache", tmp_path / "b")
    env.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "b"))
    assert get_tokenizer() is not first


def test_an_unreadable_tiktoken_file_is_passed_over(shared_data, tmp_path, env, caplog):
    # a shared cache of another user's: tests run as root here, so the read error is made, not a chmod
    shutil.copytree(shared_data / "tiktoken-cache", tmp_path / "tiktoken")
    unreadable = tmp_path / "tiktoken" / tiktoken_cache_name(URLS["encoder.json"])
    project = _project_cache(shared_data, tmp_path, *NAMES)
    env.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken"))
    sha256_file = tokenizer.sha256_file

    def refuse(path, *args):
        if Path(path) == unreadable:
            raise PermissionError(13, "Permission denied", str(path))
        return sha256_file(path, *args)

    env.setattr(tokenizer, "sha256_file", refuse)
    with caplog.at_level(logging.WARNING, logger=tokenizer.__name__):
        vocab_bpe, encoder_json = bpe_files()
    assert vocab_bpe.parent == tmp_path / "tiktoken" and encoder_json == project / "encoder.json"
    assert f"passing over {unreadable} in tiktoken's cache: it cannot be read" in caplog.text
