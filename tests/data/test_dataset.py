"""PromptLoader: filtering, padding, templates, shuffling, exact resume, multi-file, bad rows, streaming."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from klppo.data import LoaderSettings, PromptLoader
from klppo.data.gsm8k import SCHEMA, make_row
from klppo.models.tiny import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _rows(n: int, *, start: int = 0, long_every: int = 0) -> list[dict]:
    """GSM8K-format rows; every ``long_every``-th question is padded with many extra words."""
    rows = []
    for i in range(start, start + n):
        q = f"Row {i}: what is {i} plus 1?"
        if long_every and i % long_every == 0:
            q += " and then" * 40
        rows.append(make_row(q, f"{i}+1={i + 1}\n#### {i + 1}", split="train", index=i))
    return rows


def _write(path, rows, *, row_group_size=None, schema=SCHEMA) -> str:
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=row_group_size)
    return str(path)


def _ref_ids(tok, content: str) -> list[int]:
    """Independent tokenisation: template to text, then encode."""
    text = tok.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return tok(text, add_special_tokens=False)["input_ids"]


def _drain(loader, num_batches):
    return [loader.next_batch() for _ in range(num_batches)]


def test_filtering_padding_and_template(tmp_path, tok):
    rows = _rows(30, long_every=5)
    path = _write(tmp_path / "a.parquet", rows)
    lengths = [len(_ref_ids(tok, r["prompt"][0]["content"])) for r in rows]
    limit = max(n for i, n in enumerate(lengths) if i % 5) + 1
    expected_overlong = sum(n > limit for n in lengths)
    assert expected_overlong == 6
    loader = PromptLoader(
        LoaderSettings(path, batch_size=4, max_prompt_length=limit, shuffle=False, drop_last=False), tok
    )
    assert loader.stats.num_overlong == expected_overlong and loader.stats.num_rows == 24
    assert len(loader) == 6
    batches = list(loader)
    assert len(batches) == 6
    seen = []
    for b in batches:
        assert b.prompts.dtype == torch.long and b.prompts.shape == b.prompt_mask.shape
        width = b.prompts.shape[1]
        for k in range(len(b)):
            row = int(b.uid[k].split(":")[1])
            seen.append(row)
            ref = _ref_ids(tok, rows[row]["prompt"][0]["content"])
            n = int(b.prompt_mask[k].sum())
            assert n == len(ref) <= limit
            assert b.prompt_mask[k].tolist() == [0] * (width - n) + [1] * n  # left padded
            assert b.prompts[k, width - n :].tolist() == ref
            assert (b.prompts[k, : width - n] == tok.pad_token_id).all()
            assert b.ground_truth[k] == str(row + 1) and b.data_source[k] == "openai/gsm8k"
            assert b.raw_prompt[k] == rows[row]["prompt"] and b.extra_info[k]["index"] == row
        assert width == max(int(m.sum()) for m in b.prompt_mask)  # padded to the batch max only
    assert seen == [i for i in range(30) if i % 5]  # val usage: file order, all rows, last batch complete


def test_raw_text_without_template(tmp_path, tok):
    path = _write(tmp_path / "a.parquet", _rows(4))
    raw = PromptLoader(
        LoaderSettings(path, batch_size=4, max_prompt_length=512, shuffle=False, use_chat_template=False), tok
    )
    b = raw.next_batch()
    content = _rows(1)[0]["prompt"][0]["content"]
    first = b.prompts[0][b.prompt_mask[0].bool()].tolist()
    assert first == tok(content)["input_ids"] and tok.decode(first) == content  # no template tokens
    no_template = build_tiny_tokenizer()
    no_template.chat_template = None
    b2 = PromptLoader(
        LoaderSettings(path, batch_size=4, max_prompt_length=512, shuffle=False), no_template
    ).next_batch()
    assert torch.equal(b.prompts, b2.prompts)
    # verl's return_raw_chat only asks for the messages (always carried): tokens stay templated.
    chat = PromptLoader(
        LoaderSettings(path, batch_size=4, max_prompt_length=512, shuffle=False, return_raw_chat=True), tok
    )
    b3 = chat.next_batch()
    assert b3.prompts[0][b3.prompt_mask[0].bool()].tolist() == _ref_ids(tok, content)
    assert b3.raw_prompt[0] == [{"role": "user", "content": content}]


def test_truncation_when_not_filtering(tmp_path, tok):
    path = _write(tmp_path / "a.parquet", _rows(4, long_every=2))
    kwargs = dict(batch_size=4, max_prompt_length=20, shuffle=False, filter_overlong_prompts=False)
    ref0 = _ref_ids(tok, _rows(1, long_every=2)[0]["prompt"][0]["content"])
    left = PromptLoader(LoaderSettings(path, truncation="left", **kwargs), tok).next_batch()
    assert left.prompts[0].tolist() == ref0[-20:] and left.prompts.shape[1] == 20
    right = PromptLoader(LoaderSettings(path, truncation="right", **kwargs), tok).next_batch()
    assert right.prompts[0].tolist() == ref0[:20]
    middle = PromptLoader(LoaderSettings(path, truncation="middle", **kwargs), tok).next_batch()
    assert middle.prompts[0].tolist() == ref0[:10] + ref0[-10:]
    with pytest.raises(ValueError, match=r"a.parquet row 0 has \d+ tokens > max_prompt_length=20"):
        PromptLoader(LoaderSettings(path, truncation="error", **kwargs), tok).next_batch()


def test_shuffle_determinism_and_epochs(tmp_path, tok):
    path = _write(tmp_path / "a.parquet", _rows(23))

    def make(seed):
        return PromptLoader(LoaderSettings(path, batch_size=5, max_prompt_length=512, seed=seed), tok)

    a, b, c = make(1), make(1), make(2)
    uids_a = [u for batch in _drain(a, 8) for u in batch.uid]
    assert uids_a == [u for batch in _drain(b, 8) for u in batch.uid]
    assert uids_a != [u for batch in _drain(make(2), 8) for u in batch.uid]
    assert len(a) == 4 and a.epoch == 1  # 23 rows // 5 = 4 batches; 8 batches = 2 epochs
    e0, e1 = uids_a[:20], uids_a[20:]
    assert len(set(e0)) == 20 and len(set(e1)) == 20 and e0 != e1
    assert e0 != sorted(e0, key=lambda u: int(u.split(":")[1]))  # actually shuffled
    assert c.seed == 2


@pytest.mark.parametrize("buffer", [None, 6])
def test_exact_resume(tmp_path, tok, buffer):
    p1 = _write(tmp_path / "a.parquet", _rows(17), row_group_size=4)
    kwargs = dict(batch_size=3, max_prompt_length=512, seed=7, shuffle_buffer_rows=buffer)
    full = PromptLoader(LoaderSettings(p1, **kwargs), tok)
    reference = _drain(full, 14)  # crosses two epoch boundaries (5 batches per epoch)
    for cut in (2, 5, 7):
        first = PromptLoader(LoaderSettings(p1, **kwargs), tok)
        _drain(first, cut)
        state = first.state_dict()
        resumed = PromptLoader(LoaderSettings(p1, **kwargs), tok)
        resumed.load_state_dict(state)
        for got, want in zip(_drain(resumed, 14 - cut), reference[cut:]):
            assert got.uid == want.uid and torch.equal(got.prompts, want.prompts)
    other = PromptLoader(LoaderSettings(p1, **{**kwargs, "seed": 8}), tok)
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(state)


def test_buffer_mode_covers_each_row_once(tmp_path, tok):
    path = _write(tmp_path / "a.parquet", _rows(40, long_every=7), row_group_size=5)
    loader = PromptLoader(
        LoaderSettings(path, batch_size=8, max_prompt_length=60, shuffle_buffer_rows=10, drop_last=False), tok
    )
    exact = PromptLoader(LoaderSettings(path, batch_size=8, max_prompt_length=60, drop_last=False), tok)
    assert loader.stats.num_rows == exact.stats.num_rows == 34 and len(loader) == 5
    epoch0 = [u for b in loader for u in b.uid]
    epoch1 = [u for b in loader for u in b.uid]
    usable = sorted(f"0:{i}" for i in range(40) if i % 7)
    assert sorted(epoch0) == usable and sorted(epoch1) == usable and epoch0 != epoch1
    assert epoch0 != usable


def test_multi_file_and_home_expansion(tmp_path, tok, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    _write(tmp_path / "a.parquet", _rows(5))
    _write(tmp_path / "b.parquet", _rows(7, start=100))
    loader = PromptLoader(
        LoaderSettings(["~/a.parquet", "~/b.parquet"], batch_size=4, max_prompt_length=512, drop_last=False),
        tok,
    )
    uids = [u for b in loader for u in b.uid]
    assert sorted(uids) == sorted([f"0:{i}" for i in range(5)] + [f"1:{i}" for i in range(7)])
    assert loader.source.paths[0] == os.path.join(str(tmp_path), "a.parquet")
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        PromptLoader(LoaderSettings(["~/missing.parquet"], batch_size=1, max_prompt_length=8), tok)


def test_bad_rows_skip_and_error(tmp_path, tok):
    rows = _rows(8)
    rows[1]["prompt"] = None  # missing
    rows[3]["prompt"] = []  # no messages
    rows[4]["prompt"] = [{"role": "user", "content": "   "}]  # empty text
    rows[6]["prompt"] = [{"role": "user", "content": None}]  # wrong type inside
    path = _write(tmp_path / "bad.parquet", rows)
    loader = PromptLoader(LoaderSettings(path, batch_size=2, max_prompt_length=512, shuffle=False), tok)
    assert loader.stats.num_bad_rows == 4 and loader.stats.num_rows == 4
    assert [s.split(": ")[0].rsplit(" ", 1)[1] for s in loader.stats.bad_rows] == ["1", "3", "4", "6"]
    assert "bad.parquet row 1: missing prompt" in loader.stats.bad_rows[0]
    assert [u for b in loader for u in b.uid] == ["0:0", "0:2", "0:5", "0:7"]
    with pytest.raises(ValueError, match=r"bad.parquet row 1: missing prompt"):
        PromptLoader(LoaderSettings(path, batch_size=2, max_prompt_length=512, bad_row_policy="error"), tok)
    ints = _write(tmp_path / "ints.parquet", [{"prompt": 5}], schema=pa.schema([("prompt", pa.int64())]))
    with pytest.raises(ValueError, match=r"ints.parquet row 0: prompt has type int"):
        PromptLoader(LoaderSettings(ints, batch_size=1, max_prompt_length=512, bad_row_policy="error"), tok)
    with pytest.raises(ValueError, match="has no column 'question'"):
        PromptLoader(LoaderSettings(path, batch_size=1, max_prompt_length=512, prompt_key="question"), tok)


def test_empty_after_filtering_is_a_clear_error(tmp_path, tok):
    rows = _rows(6)
    rows[0]["prompt"] = None
    path = _write(tmp_path / "a.parquet", rows)
    with pytest.raises(
        ValueError, match=r"no usable prompts.*6 rows.*1 bad.*5 longer than max_prompt_length=3"
    ):
        PromptLoader(LoaderSettings(path, batch_size=2, max_prompt_length=3), tok)
    with pytest.raises(
        ValueError, match=r"only 5 usable prompts in .*, fewer than one batch of 8 \(data.train_batch_size"
    ):
        PromptLoader(LoaderSettings(path, batch_size=8, max_prompt_length=512), tok)


def test_row_group_streaming_is_memory_bounded(tmp_path, tok, monkeypatch):
    path = _write(tmp_path / "big.parquet", _rows(64), row_group_size=4)
    assert pq.ParquetFile(path).metadata.num_row_groups == 16

    def refuse(*args, **kwargs):
        raise AssertionError("whole-file read")

    monkeypatch.setattr(pq, "read_table", refuse)
    monkeypatch.setattr(pq.ParquetFile, "read", refuse)
    loader = PromptLoader(
        LoaderSettings(path, batch_size=8, max_prompt_length=512, max_cached_row_groups=2, drop_last=False),
        tok,
    )
    assert loader.stats.row_groups_read == 16 and loader.stats.max_rows_resident == 4  # scan: one at a time
    uids = [u for b in loader for u in b.uid]
    assert sorted(uids, key=lambda u: int(u[2:])) == [f"0:{i}" for i in range(64)]
    assert loader.source.stats.max_rows_resident <= (2 + 1) * 4  # cache of 2 row groups + the one read
    assert loader.source.stats.row_groups_read > 16 + 8  # batches read row groups, not the file
    buffered = PromptLoader(
        LoaderSettings(
            path, batch_size=8, max_prompt_length=512, max_cached_row_groups=2, shuffle_buffer_rows=6
        ),
        tok,
    )
    assert len([b for b in buffered]) == 8 and buffered.source.stats.max_rows_resident <= 12


def test_batch_counts_and_validation(tmp_path, tok):
    path = _write(tmp_path / "a.parquet", _rows(10))
    assert len(PromptLoader(LoaderSettings(path, batch_size=4, max_prompt_length=512), tok)) == 2
    assert (
        len(PromptLoader(LoaderSettings(path, batch_size=4, max_prompt_length=512, drop_last=False), tok))
        == 3
    )
    for bad in (dict(truncation="center"), dict(bad_row_policy="warn"), dict(batch_size=0)):
        with pytest.raises(ValueError):
            PromptLoader(LoaderSettings(path, **{"batch_size": 2, "max_prompt_length": 512, **bad}), tok)
    loader = PromptLoader(
        LoaderSettings(path, batch_size=4, max_prompt_length=512, drop_last=False, shuffle=False), tok
    )
    sizes = [len(b) for b in loader]
    assert sizes == [4, 4, 2] and np.sum(sizes) == 10


def test_max_samples_template_kwargs_and_reward_fn_key(tmp_path, tok):
    rows = [dict(r, ability=f"src{i % 3}") for i, r in enumerate(_rows(12, long_every=4))]
    path = _write(tmp_path / "a.parquet", rows)
    # max_samples: the first N usable rows in file order (overlong rows filtered first), whatever the shuffle
    loader = PromptLoader(
        LoaderSettings(path, batch_size=2, max_prompt_length=60, max_samples=4, seed=3), tok
    )
    seen = sorted(uid for _ in range(len(loader)) for uid in loader.next_batch().uid)
    usable = [i for i in range(12) if i % 4 != 0]  # every 4th row is long (longer than 60 tokens)
    assert len(loader) == 2 and seen == sorted(f"0:{i}" for i in usable[:4])

    # extra chat-template arguments reach the template (a template that prints one of them)
    tok2 = build_tiny_tokenizer()
    tok2.chat_template = "{{ flavour }}:{% for m in messages %}{{ m['content'] }}{% endfor %}"
    plain = PromptLoader(LoaderSettings(path, batch_size=2, max_prompt_length=512, shuffle=False), tok2)
    tagged = PromptLoader(
        LoaderSettings(
            path,
            batch_size=2,
            max_prompt_length=512,
            shuffle=False,
            apply_chat_template_kwargs={"flavour": "zz"},
        ),
        tok2,
    )
    text = tok2.decode(tagged.next_batch().prompts[0], skip_special_tokens=True)
    assert text.startswith("zz:") and not tok2.decode(plain.next_batch().prompts[0]).startswith("zz:")

    # reward_fn_key: the scorer-selecting column is read from another column; a missing one is an error
    by_ability = PromptLoader(
        LoaderSettings(path, batch_size=3, max_prompt_length=512, shuffle=False, reward_fn_key="ability"), tok
    )
    assert by_ability.next_batch().data_source == ["src0", "src1", "src2"]
    with pytest.raises(ValueError, match="no column 'nope'"):
        PromptLoader(LoaderSettings(path, batch_size=3, max_prompt_length=512, reward_fn_key="nope"), tok)
