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


def test_batched_decode_equals_the_per_row_decode():
    tok = build_tiny_tokenizer()
    special = [tok.convert_tokens_to_ids(t) for t in tok.all_special_tokens][:3]
    assert len(special) >= 1
    special = (special * 3)[:3]
    ids, mask = _rows(len(tok), special)
    batch = Batch(
        prompts=torch.zeros(12, 2, dtype=torch.long), prompt_mask=torch.ones(12, 2, dtype=torch.long),
        responses=ids, response_mask=mask,
    )  # fmt: skip
    want = [tok.decode(r[: int(m.sum())].tolist(), skip_special_tokens=True) for r, m in zip(ids, mask)]
    got = Reward(tok).decode_responses(batch)
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


def test_tokenizers_without_a_backend_or_with_space_clean_up_decode_row_by_row():
    slow = _PerRowOnly()
    assert decode_batch(slow, [[1, 2], [], [3]]) == ["1,2", "", "3"]
    assert slow.calls == 3
    tok = build_tiny_tokenizer()
    tok.clean_up_tokenization_spaces = True  # a Python-side step the backend's decode_batch does not do
    calls = []
    tok.decode = lambda ids, skip_special_tokens=False: calls.append(ids) or "x"
    assert decode_batch(tok, [[5], [6, 7]]) == ["x", "x"]
    assert calls == [[5], [6, 7]]
