"""resolve_model_path: local dirs, GGUF files, hub ids from a fake HF cache, and the not-a-model errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from klppo.models.paths import ModelLoadError, looks_like_hub_id, resolve_model_path


def _fake_model_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text('{"model_type": "qwen2"}')
    return path


def _fake_hub_cache(cache: Path, repo_id: str, commit: str, *, write_ref: bool = True) -> Path:
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = _fake_model_dir(repo / "snapshots" / commit)
    if write_ref:
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(commit + "\n")
    return snapshot


def test_local_dir_and_home_expansion(tmp_path, monkeypatch):
    model = _fake_model_dir(tmp_path / "home" / "models" / "m")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert resolve_model_path("~/models/m") == str(model.resolve())
    assert resolve_model_path(str(model)) == str(model.resolve())


def test_gguf_file_is_accepted_by_magic_bytes(tmp_path):
    good = tmp_path / "m.gguf"
    good.write_bytes(b"GGUF" + b"\0" * 32)
    assert resolve_model_path(str(good)) == str(good.resolve())
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        resolve_model_path(str(fake))


def test_hub_id_resolved_from_cache_ref(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    _fake_hub_cache(tmp_path / "hub", "Qwen/Qwen2.5-7B-Instruct", "aaa111", write_ref=False)
    want = _fake_hub_cache(tmp_path / "hub", "Qwen/Qwen2.5-7B-Instruct", "bbb222")
    # the ref decides, not the newest directory
    (want.parent / "ccc333").mkdir()
    assert resolve_model_path("Qwen/Qwen2.5-7B-Instruct") == str(want)


def test_hub_id_via_hf_home_without_ref_takes_newest_snapshot(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    snapshot = _fake_hub_cache(tmp_path / "hf" / "hub", "org/model", "abc", write_ref=False)
    assert resolve_model_path("org/model") == str(snapshot)


def test_hub_id_not_cached_says_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(ModelLoadError) as info:
        resolve_model_path("Qwen/Qwen2.5-7B-Instruct")
    message = str(info.value)
    assert "offline" in message and "local directory" in message and str(tmp_path / "empty") in message
    assert isinstance(info.value, ValueError)


def test_cached_hub_repo_without_config_is_not_a_model(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = _fake_hub_cache(tmp_path / "hub", "org/gguf-only", "c0ffee")
    (snapshot / "config.json").unlink()
    (snapshot / "model-Q4.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match=r"model-Q4\.gguf"):
        resolve_model_path("org/gguf-only")


def test_not_a_model_errors(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model_path(str(empty))
    run = tmp_path / "run"
    (run / "global_step_10").mkdir(parents=True)
    with pytest.raises(ModelLoadError, match="klppo export"):
        resolve_model_path(str(run))
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        resolve_model_path(str(text))
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_path(str(tmp_path / "missing" / "dir"))
    with pytest.raises(ModelLoadError, match="non-empty"):
        resolve_model_path("  ")


def test_hub_id_shape():
    assert looks_like_hub_id("Qwen/Qwen2.5-7B-Instruct")
    assert looks_like_hub_id("gpt2")
    for not_id in ("/abs/path", "./rel", "~/m", "a/b/c", "m.gguf", "org/"):
        assert not looks_like_hub_id(not_id), not_id
