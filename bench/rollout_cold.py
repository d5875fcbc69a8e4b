"""Cold-start time of the klppo engine: the first ``generate`` in a fresh Python process.

    PYTHONPATH=$PWD python bench/rollout_cold.py [--modes compile,compile-warm-cache,eager] [--batch 64]

Each mode runs in its own child process (nothing imported or compiled beforehand) on the Qwen2.5-0.5B
shape, bf16, prompt 256, 256 new tokens forced: the first call (KV cache allocation, compile of the
decode functions, CUDA-graph capture of each batch bucket met) and then a second call of the same shape
(warm). Modes:

- ``compile``: the default engine with empty inductor and triton caches (a machine's very first run);
- ``compile-warm-cache``: the default engine again, reusing the on-disk caches the previous mode left
  (every later process on that machine: a resumed run, the next job);
- ``compile-1thread``: as ``compile`` with inductor's compile-worker pool off (in-process compiles);
- ``precompile``: empty caches, ``CompiledFunctions.start_precompile`` (``klppo.rollout.compiled``) started
  from the model's config before the model is built, on the object then handed to the engine (as the
  trainer does before loading weights), so compilation overlaps the build; the first call waits for what
  is left of it;
- ``eager``: ``compile_decode=False`` (CUDA graphs of uncompiled kernels), empty caches.

``setup_to_first_s`` = model build + engine + first call (+ the pre-compile start): the start-up a user sees.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

MODES = {
    "compile": dict(engine={}, fresh_cache=True),
    "compile-warm-cache": dict(engine={}, fresh_cache=False),
    "compile-1thread": dict(engine={}, fresh_cache=True, env=dict(TORCHINDUCTOR_COMPILE_THREADS="1")),
    "precompile": dict(engine={}, fresh_cache=True, precompile=True),
    "eager": dict(engine=dict(compile_decode=False), fresh_cache=True),
}


def child(mode: str, batch: int) -> None:
    t_start = time.perf_counter()
    import logging

    import torch

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    sys.path.insert(0, os.path.dirname(__file__))
    from rollout import NEW, PROMPT, build, qwen_config

    from klppo.rollout import SamplingParams, make_rollout
    from klppo.rollout.compiled import CompiledFunctions

    t_import = time.perf_counter() - t_start
    t_setup = time.perf_counter()
    compiled = CompiledFunctions()
    if MODES[mode].get("precompile"):
        compiled.start_precompile(qwen_config("0.5b"), dtype=torch.bfloat16, device=torch.device("cuda"))
    model = build("0.5b", torch.bfloat16)
    params = SamplingParams(max_new_tokens=NEW, temperature=1.0, top_p=1.0, top_k=-1, seed=0, ignore_eos=True)
    engine = make_rollout("klppo", eos_token_ids=[151645], pad_token_id=151643, gpu_memory_utilization=0.9,
                          free_cache_engine=False, compiled=compiled, **MODES[mode]["engine"])  # fmt: skip
    prompts = torch.randint(0, 151000, (batch, PROMPT), device="cuda")
    mask = torch.ones_like(prompts)
    row = dict(mode=mode, batch=batch, import_s=t_import)
    for phase in ("cold", "warm"):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        s = engine.generate(model, prompts, mask, params).stats
        torch.cuda.synchronize()
        decode_s = s["rollout/time_s"] - s["rollout/prefill_s"] - s["rollout/graph_capture_s"]
        if phase == "cold":
            row["setup_to_first_s"] = time.perf_counter() - t_setup
        row.update({f"{phase}_call_s": time.perf_counter() - t0, f"{phase}_capture_s": s["rollout/graph_capture_s"],
                    f"{phase}_prefill_s": s["rollout/prefill_s"],
                    f"{phase}_ms_per_step": decode_s / s["rollout/decode_steps"] * 1e3})  # fmt: skip
    if os.environ.get("KLPPO_COLD_BREAKDOWN"):
        print(torch._dynamo.utils.compile_times(repr="str"), file=sys.stderr)
    print(
        "ROW " + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="compile,compile-warm-cache,eager")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.batch)
        return
    cache = tempfile.mkdtemp(prefix="klppo-cold-")
    for mode in args.modes.split(","):
        if MODES[mode]["fresh_cache"]:
            cache = tempfile.mkdtemp(prefix="klppo-cold-")
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor", TRITON_CACHE_DIR=f"{cache}/triton",
                   **MODES[mode].get("env", {}))  # fmt: skip
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--child", mode, "--batch", str(args.batch)], env=env,
                              capture_output=True, text=True)  # fmt: skip
        rows = [line[4:] for line in proc.stdout.splitlines() if line.startswith("ROW ")]
        if proc.returncode or not rows or os.environ.get("KLPPO_COLD_BREAKDOWN"):
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
        if not rows:
            continue
        row = json.loads(rows[0])
        row["process_s"] = round(time.perf_counter() - t0, 2)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
