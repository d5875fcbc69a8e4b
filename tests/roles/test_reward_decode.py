"""The reward role decodes a batch of responses in one call of the tokenizer's Rust backend: the same texts
as decoding row by row, each row cut at its response mask."""

import torch

from klppo.batch import Batch
from klppo.models.tiny import build_tiny_tokenizer
from klppo.roles.reward import Reward, decode_batch


def _rows(vocab: int, special: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (12, 20), generator=g)
    ids[0, :3] = torch.tensor(special[:3])  # special tokens, dropped by skip_special_tokens
    lengths = torch.tensor([20, 0, 1, 7, 13, 20, 5, 19, 2, 11, 20, 9])
    mask = (torch.arange(20)[None, :] < lengths[:, None]).float()
    return ids, mask


def test_batched_decode_equals_the_per_row_decode(monkeypatch):
    tok = build_tiny_tokenizer()
    special = [tok.convert_tokens_to_ids(t) for t in tok.all_special_tokens][:3]
    assert len(special) >= 1
    special = (special * 3)[:3]
    ids, mask = _rows(len(tok), special)
    batch = Batch(
        prompts=torch.zeros(12, 2, dtype=torch.long),
        prompt_mask=torch.ones(12, 2, dtype=torch.long),
        responses=ids,
        response_mask=mask,
    )
    want = [tok.decode(r[: int(m.sum())].tolist(), skip_special_tokens=True) for r, m in zip(ids, mask)]
    batched = []
    backend_decode_batch = tok.backend_tokenizer.decode_batch

    class Spy:  # the Rust tokenizer's attributes are read-only: wrap it to see the batched call
        def __getattr__(self, name):
            return getattr(backend, name)

        def decode_batch(self, rows, **kw):
            batched.append(len(rows))
            return backend_decode_batch(rows, **kw)

    backend = tok.backend_tokenizer
    monkeypatch.setattr(tok, "_tokenizer", Spy())  # what the backend_tokenizer property returns
    got = Reward(tok).decode_responses(batch)
    assert batched == [12]  # one batched call, not a row-by-row fallback
    assert got == want
    assert got[1] == ""  # an empty response
    assert any(w != tok.decode(r.tolist(), skip_special_tokens=True) for w, r in zip(want, ids))  # masks cut


class _PerRowOnly:
    """A tokenizer without a Rust backend (a slow tokenizer): decoded row by row."""

    def __init__(self):
        self.calls = 0

    def decode(self, ids, skip_special_tokens=False):
        self.calls += 1
        return ",".join(map(str, ids)) + ("" if skip_special_tokens else "!")


def test_tokenizers_without_a_backend_with_space_clean_up_or_their_own_decode_go_row_by_row():
    slow = _PerRowOnly()
    assert decode_batch(slow, [[1, 2], [], [3]]) == ["1,2", "", "3"]
    assert slow.calls == 3
    tok = build_tiny_tokenizer()
    tok.clean_up_tokenization_spaces = True  # a Python-side step the backend's decode_batch does not do
    calls = []
    tok.decode = lambda ids, skip_special_tokens=False: calls.append(ids) or "x"
    assert decode_batch(tok, [[5], [6, 7]]) == ["x", "x"]
    assert calls == [[5], [6, 7]]

    class OwnDecode(type(build_tiny_tokenizer())):  # e.g. Whisper's or CodeGen's decode: post-processing
        def _decode(self, token_ids, **kwargs):
            return "own:" + super()._decode(token_ids, **kwargs)

    own = build_tiny_tokenizer()
    own.__class__ = OwnDecode
    ids = [[5, 6], [7]]
    assert decode_batch(own, ids) == [own.decode(r, skip_special_tokens=True) for r in ids]
    assert all(t.startswith("own:") for t in decode_batch(own, ids))
