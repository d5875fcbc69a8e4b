"""Multi-turn rollout throughput on the klppo engine: 2-turn conversations against one-turn rollouts of the
same total length, counting model tokens only (issue 55's criterion: at least 0.8× the one-turn figure).

    PYTHONPATH=$PWD python bench/multi_turn.py [--shape 0.5b] [--batch 256] [--prompt 256] [--turn 256]
        [--answer 32] [--repeats 3] [--keep-cache] [--out multi_turn.json] [--tiny]

Each conversation: a prompt of ``--prompt`` tokens, a model turn of ``--turn`` tokens ending with the
end-of-turn token, a tool answer of ``--answer`` tokens that comes at once, a second model turn of
``--turn`` tokens (cut by the response budget ``2·turn + answer``). Modes, on one engine, greedy, each timed
from the first engine call to the last output:

- ``one_turn``: ``generate`` of ``2·turn + answer`` tokens (EOS ignored): every response token is a model
  token;
- ``two_turn_kv``: the engine's session (``KLPPORollout.open``): turn 1, ``extend`` with the answer (only
  its tokens are prefilled), turn 2 — what the multi-turn loop runs on the klppo engine;
- ``two_turn_resend``: ``generate`` for turn 1, then ``generate`` on prompt + turn 1 + answer for turn 2 —
  the loop's path on engines without sessions.

``tokens_per_s`` counts model tokens (``2·turn`` per conversation in the two-turn modes); ``vs_one_turn``
divides a mode's by ``one_turn``'s of the same repeat; the rows give the median over ``--repeats`` warm
repeats (a first, cold round of every mode is not counted), the modes interleaved per repeat.

The model is a Qwen2.5 shape (``bench/rollout.py``'s ``SHAPES``), random bf16 weights made to count: every
layer's output projections are zero and the LM head is the embedding shifted by one row, so the next greedy
token is always the current token + 1. Turn lengths are then exact (the end-of-turn id is the prompt's last
id + ``turn``) while every matrix product, attention read and sampling step costs what it costs on any
weights. The script checks that both two-turn modes give the same tokens (``same_tokens``).
``--keep-cache`` runs the engine with ``free_cache_engine=False`` (workspace and graphs kept across calls);
by default every ``generate`` allocates its cache and captures its graphs, as in training by default.
``--tiny``: the tiny shape on the CPU, small sizes (the script's test).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.rollout import SHAPES, qwen_config
from klppo.rollout import EngineSettings, SamplingParams, make_rollout
from klppo.rollout.engine import KLPPORollout

FIRST_ID = 1000  # the prompts' last id: turn 1 counts from here


def counting_model(shape: str, dtype: torch.dtype, device: str, vocab: int | None = None):
    """A random model of ``shape`` whose greedy next token is the current token + 1 (module docstring)."""
    from transformers import AutoModelForCausalLM

    config = qwen_config(shape)
    config.tie_word_embeddings = False
    if vocab is not None:
        config.vocab_size, config.pad_token_id = vocab, 0
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.copy_(torch.roll(model.model.embed_tokens.weight, 1, dims=0))
    return model


def conversations(batch: int, prompt: int, turn: int, answer: int, vocab: int, device: str):
    """Prompts [B, P] (random ids, the last ``FIRST_ID``), the tool's answer ids and the end-of-turn id."""
    if FIRST_ID + 2 * turn + answer + 2 > vocab:
        raise SystemExit(
            f"--turn {turn} --answer {answer} need a vocabulary above {FIRST_ID + 2 * turn + answer}"
        )
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (batch, prompt), generator=gen)
    prompts[:, -1] = FIRST_ID
    eos = FIRST_ID + turn  # turn 1's last token
    answer_ids = list(range(eos + 1, eos + 1 + answer))  # turn 2 counts on from there: never the EOS
    return prompts.to(device), torch.ones_like(prompts).to(device), answer_ids, eos


def one_turn(engine, model, prompts, mask, budget: int):
    out = engine.generate(
        model, prompts, mask, SamplingParams(max_new_tokens=budget, do_sample=False, ignore_eos=True)
    )
    return int(out.response_mask.sum()), None


def two_turn_kv(engine: KLPPORollout, model, prompts, mask, budget: int, answer_ids: list[int]):
    session = engine.open(model, prompts, mask, SamplingParams(max_new_tokens=budget, do_sample=False))
    if session is None:
        raise SystemExit("the engine's slots cannot hold every conversation: lower --batch")
    rows = list(range(prompts.shape[0]))
    try:
        first = session.generate(rows)
        session.extend(rows, [answer_ids] * len(rows))
        second = session.generate(rows)
    finally:
        session.close()
    return int(first.response_mask.sum() + second.response_mask.sum()), (first, second)


def two_turn_resend(engine, model, prompts, mask, budget: int, answer_ids: list[int]):
    params = SamplingParams(max_new_tokens=budget, do_sample=False)
    first = engine.generate(model, prompts, mask, params)
    turn1 = first.responses[:, : int(first.response_mask.sum(dim=1).max())]
    answer = torch.tensor(answer_ids, device=prompts.device).expand(prompts.shape[0], -1)
    whole = torch.cat([prompts, turn1, answer], dim=1)
    room = budget - turn1.shape[1] - len(answer_ids)
    second = engine.generate(
        model, whole, torch.ones_like(whole), SamplingParams(max_new_tokens=room, do_sample=False)
    )
    return int(first.response_mask.sum() + second.response_mask.sum()), (first, second)


def timed(fn, *args):
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    tokens, outs = fn(*args)
    if cuda:
        torch.cuda.synchronize()
    return tokens, time.perf_counter() - t0, outs


def same_tokens(kv, resend) -> bool:
    """Whether both two-turn modes gave the same model tokens, turn by turn."""
    return all(
        torch.equal(a.responses[a.response_mask.bool()], b.responses[b.response_mask.bool()])
        for a, b in zip(kv, resend)
    )


def run(args) -> list[dict]:
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    model = counting_model(args.shape, dtype, device, vocab=args.vocab)
    vocab = model.config.vocab_size
    prompts, mask, answer_ids, eos = conversations(
        args.batch, args.prompt, args.turn, args.answer, vocab, device
    )
    budget = 2 * args.turn + args.answer
    settings = EngineSettings(eos_token_ids=(eos,), pad_token_id=0, free_cache_engine=not args.keep_cache)
    engine = make_rollout("klppo", settings)
    modes = {
        "one_turn": lambda: one_turn(engine, model, prompts, mask, budget),
        "two_turn_kv": lambda: two_turn_kv(engine, model, prompts, mask, budget, answer_ids),
        "two_turn_resend": lambda: two_turn_resend(engine, model, prompts, mask, budget, answer_ids),
    }
    times: dict[str, list[float]] = {m: [] for m in modes}
    tokens: dict[str, int] = {}
    outs: dict[str, tuple] = {}
    for repeat in range(args.repeats + 1):  # round 0: cold (allocation, compilation), not counted
        for mode, fn in modes.items():
            tokens[mode], elapsed, outs[mode] = timed(fn)
            if repeat:
                times[mode].append(elapsed)
    expected = {"one_turn": budget, "two_turn_kv": 2 * args.turn, "two_turn_resend": 2 * args.turn}
    rows = []
    for mode in modes:
        per_s = [tokens[mode] / t for t in times[mode]]
        ratio = [tokens[mode] / t / (tokens["one_turn"] / o) for t, o in zip(times[mode], times["one_turn"])]
        rows.append(
            dict(
                mode=mode,
                shape=args.shape,
                batch=args.batch,
                prompt=args.prompt,
                turn=args.turn,
                answer=args.answer,
                keep_cache=args.keep_cache,
                model_tokens=tokens[mode],
                tokens_as_planned=tokens[mode] == expected[mode] * args.batch,
                time_s=statistics.median(times[mode]),
                tokens_per_s=statistics.median(per_s),
                vs_one_turn=statistics.median(ratio),
                same_tokens=same_tokens(outs["two_turn_kv"], outs["two_turn_resend"]),
                device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
            )
        )
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="0.5b", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--turn", type=int, default=256)
    ap.add_argument("--answer", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=None, help="a smaller vocabulary than the shape's")
    ap.add_argument("--keep-cache", action="store_true")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.tiny:
        args.shape, args.vocab = "tiny", args.vocab or 2048
        args.batch, args.prompt, args.turn, args.answer = min(args.batch, 4), 16, 12, 4
        args.repeats = min(args.repeats, 1)
    rows = run(args)
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
