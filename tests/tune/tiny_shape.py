"""The tiny model shape the memory-model tests compute by hand (test_memory.py, test_plain_tune.py)."""

from __future__ import annotations

from klppo.tune.shapes import ModelShape

# h=64, 2 layers, 4 heads (head_dim 16), 2 kv heads (kvd 32), FFN=128, V=256, tied; max_position for the
# measured steps of test_plain_tune (rotary: no parameter depends on it)
TINY = ModelShape("tiny", "qwen2", 64, 2, 4, 2, 128, 256, True, max_position=512)
H, L, KVD, FFN, V = 64, 2, 32, 128, 256
LAYER = (H * H + H) + 2 * (H * KVD + KVD) + H * H + 3 * H * FFN + 2 * H  # q(+b), k,v(+b), o, mlp, 2 norms
ROOT = V * H + H  # tied embedding + final norm
P = L * LAYER + ROOT


def terms(phase) -> dict[str, float]:
    """A phase peak's terms by name, in bytes."""
    return {t.name: t.bytes for t in phase.terms}
