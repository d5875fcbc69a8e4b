"""Cold-start time of the klppo engine: the first ``generate`` in a fresh Python process.

    PYTHONPATH=$PWD python bench/rollout_cold.py [--modes compile,compile-warm-cache,eager] [--batch 64]
        [--repeat 3] [--out cold.json]

Each mode runs ``--repeat`` times, each run in its own child process (nothing imported or compiled
beforehand) on the Qwen2.5-0.5B shape, bf16, prompt 256, 256 new tokens forced: the first call (KV cache
allocation, compile of the decode functions, CUDA-graph capture of each batch bucket met) and then a
second call of the same shape (warm). The compile caches are klppo's own (``klppo.rollout.compiled``:
``$KLPPO_CACHE/compile/{inductor,triton}``): each child gets ``KLPPO_CACHE`` and no
``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR``, so the engine's default choice is what is measured.
Modes:

- ``compile``: the default engine, each process with a new empty cache directory (a machine's very first
  run); its split layers run on Triton kernels, so with the Triton sampler nothing is compiled by Inductor
  (``inductor_imported`` says whether Inductor's compiler was imported at all);
- ``compile-warm-cache``: the default engine, reusing the cache directory the last fresh process filled
  (every later process on that machine: a resumed run, the next job);
- ``compile-1thread``: as ``compile`` with inductor's compile-worker pool off (in-process compiles);
- ``precompile``: empty caches, ``CompiledFunctions.start_precompile`` (``klppo.rollout.compiled``) started
  from the model's config before the model is built, on the object then handed to the engine (as the
  trainer does before loading weights), so compilation overlaps the build; the first call waits for what
  is left of it (it also runs the attention and sampler kernels once: Triton compiles them there on empty
  caches);
- ``eager``: ``compile_decode=False`` (CUDA graphs of uncompiled kernels), empty caches;
- ``sdpa``: the torch reference backend (``decode_attention="sdpa"``: compiled unsplit layers), empty
  caches.

``--profile-first N`` puts each process's first ``generate`` under cProfile and adds its N costliest
functions by cumulative and by own time to the row (``first_call_top_cumulative`` / ``_tottime``: where
the first call's seconds go — tracing, cache loads, kernel loading, device initialisation);
``--profile-dump DIR`` also writes each of those profiles to ``DIR/MODE-PID.prof`` (``pstats``);
``import_torch_s`` is the ``import torch`` part of ``import_s``.
``--sampler`` (default ``auto``: the Triton kernels on CUDA; ``torch``: the torch sampler).
``setup_to_first_s`` = model build + engine + first call (+ the pre-compile start): the start-up a user
sees after the imports; ``to_first_result_s`` = the same from the child's first line (imports included);
``process_s`` = the child process's wall time, interpreter start and exit included;
``fxgraph_cache_hit`` / ``_miss``: inductor's FX graph cache in that process. ``--tiny``: a tiny model on
the CPU with the decode compiled (the test of this script). ``--out`` writes
``{"runs": [...], "median": {mode: {figure: median over the repeats}}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
    "sdpa": dict(engine=dict(decode_attention="sdpa"), fresh_cache=True),
}


def child(
    mode: str,
    batch: int,
    tiny: bool,
    profile_first: int = 0,
    profile_dump: str | None = None,
    sampler: str = "auto",
) -> None:
    t_start = time.perf_counter()
    import logging

    import torch

    t_torch = time.perf_counter() - t_start

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    sys.path.insert(0, os.path.dirname(__file__))
    from rollout import NEW, PROMPT, build, qwen_config

    from klppo.rollout import EngineSettings, SamplingParams, make_rollout
    from klppo.rollout.compiled import CompiledFunctions

    shape, device, dtype, prompt, new = (
        ("tiny", "cpu", torch.float32, 8, 8) if tiny else ("0.5b", "cuda", torch.bfloat16, PROMPT, NEW)
    )
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    t_import = time.perf_counter() - t_start
    t_setup = time.perf_counter()
    compiled = CompiledFunctions()
    params = SamplingParams(max_new_tokens=new, temperature=1.0, top_p=1.0, top_k=-1, seed=0, ignore_eos=True)
    settings = EngineSettings(
        eos_token_ids=[151645],
        pad_token_id=151643,
        gpu_memory_utilization=0.9,
        free_cache_engine=False,
        sampler=sampler,
        **{"compile_decode": True, **MODES[mode]["engine"]},
    )
    if MODES[mode].get("precompile"):
        compiled.start_precompile(
            qwen_config(shape), settings, dtype=dtype, device=torch.device(device), sampling=(params,)
        )
    model = build(shape, dtype, device)
    engine = make_rollout("klppo", settings, compiled=compiled)
    prompts = torch.randint(0, 151000, (batch, prompt), device=device)
    mask = torch.ones_like(prompts)
    row = dict(mode=mode, batch=batch, sampler=sampler, import_s=t_import, import_torch_s=t_torch)
    for phase in ("cold", "warm"):
        sync()
        t0 = time.perf_counter()
        profiler = _start_profile() if profile_first and phase == "cold" else None
        s = engine.generate(model, prompts, mask, params).stats
        sync()
        if profiler is not None:
            row.update(_top_functions(profiler, profile_first))
            if profile_dump:
                profiler.dump_stats(os.path.join(profile_dump, f"{mode}-{os.getpid()}.prof"))
        decode_s = s["rollout/time_s"] - s["rollout/prefill_s"] - s["rollout/graph_capture_s"]
        if phase == "cold":
            row["setup_to_first_s"] = time.perf_counter() - t_setup
            row["to_first_result_s"] = time.perf_counter() - t_start
        row.update(
            {
                f"{phase}_call_s": time.perf_counter() - t0,
                f"{phase}_capture_s": s["rollout/graph_capture_s"],
                f"{phase}_prefill_s": s["rollout/prefill_s"],
                f"{phase}_ms_per_step": decode_s / s["rollout/decode_steps"] * 1e3,
            }
        )
    from torch._dynamo.utils import counters

    row.update({k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")})
    row["inductor_imported"] = "torch._inductor.compile_fx" in sys.modules
    if os.environ.get("KLPPO_COLD_BREAKDOWN"):
        print(torch._dynamo.utils.compile_times(repr="str"), file=sys.stderr)
    print(
        "ROW " + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
        flush=True,
    )


def _start_profile():
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    return profiler


def _top_functions(profiler, n: int) -> dict[str, list[str]]:
    """The first call's ``n`` costliest functions (host time: Python, and the C calls it makes, waits on
    the device included) by cumulative and by own time, as "seconds file:line(function)"."""
    import pstats

    profiler.disable()
    stats = pstats.Stats(profiler)
    out = {}
    for key, column in (("cumulative", 3), ("tottime", 2)):
        stats.sort_stats(key)
        rows = []
        for func in stats.fcn_list[:n]:
            filename, line, name = func
            where = "/".join(filename.split("/")[-2:])
            rows.append(f"{stats.stats[func][column]:.3f}s {where}:{line}({name})")
        out[f"first_call_top_{key}"] = rows
    return out


def run_child(
    mode: str,
    batch: int,
    cache: str,
    tiny: bool = False,
    profile_first: int = 0,
    profile_dump: str | None = None,
    sampler: str = "auto",
) -> dict | None:
    """One child process of ``mode`` with ``KLPPO_CACHE=cache``: its row (None when it printed none)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env.update(KLPPO_CACHE=cache, **MODES[mode].get("env", {}))
    t0 = time.perf_counter()
    argv = [
        sys.executable,
        __file__,
        "--child",
        mode,
        "--batch",
        str(batch),
        *(["--tiny"] if tiny else []),
        "--profile-first",
        str(profile_first),
        *(["--profile-dump", profile_dump] if profile_dump else []),
        "--sampler",
        sampler,
    ]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    rows = [line[4:] for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    if proc.returncode or not rows or os.environ.get("KLPPO_COLD_BREAKDOWN"):
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
    if not rows:
        return None
    row = json.loads(rows[0])
    row["process_s"] = round(time.perf_counter() - t0, 2)
    return row


def medians(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Per mode, the median of every numeric figure over its runs."""
    out: dict[str, dict[str, float]] = {}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        rows = [r for r in runs if r["mode"] == mode]
        keys = [k for k, v in rows[0].items() if isinstance(v, int | float) and k != "batch"]
        out[mode] = {"runs": len(rows), **{k: round(statistics.median(r[k] for r in rows), 4) for k in keys}}
    return out


def _cache_for(mode: str, caches: dict[str, str]) -> str:
    """The cache directory of ``mode``'s process: a new empty one for a fresh-cache mode (recorded for its
    engine configuration), else the one the last fresh process *of the same engine configuration* filled
    (its engine settings: a cache filled by other compiled functions would be a miss, not a warm start)."""
    key = json.dumps(MODES[mode]["engine"], sort_keys=True)
    if MODES[mode]["fresh_cache"] or key not in caches:
        if not MODES[mode]["fresh_cache"]:
            print(
                f"{mode}: no fresh process of its engine ran before it; its cache starts empty",
                file=sys.stderr,
            )
        caches[key] = tempfile.mkdtemp(prefix="klppo-cold-")
    return caches[key]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="compile,compile-warm-cache,eager")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=1, help="processes per mode (the JSON gives medians)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU, decode compiled (tests)")
    ap.add_argument("--child", default=None)
    ap.add_argument(
        "--profile-first",
        type=int,
        default=0,
        help="N > 0: each process's first generate under cProfile; its N costliest functions by "
        "cumulative and own time go into the row",
    )
    ap.add_argument(
        "--profile-dump",
        default=None,
        help="with --profile-first: also write each first call's cProfile to DIR/MODE-PID.prof",
    )
    ap.add_argument(
        "--sampler",
        default="auto",
        choices=("auto", "triton", "torch"),
        help="the engine's sampler (auto: the trainer's default)",
    )
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.batch, args.tiny, args.profile_first, args.profile_dump, args.sampler)
        return
    caches: dict[str, str] = {}  # per engine configuration: the cache its last fresh process filled
    runs = []
    for mode in args.modes.split(","):
        for _ in range(args.repeat):
            cache = _cache_for(mode, caches)
            row = run_child(
                mode, args.batch, cache, args.tiny, args.profile_first, args.profile_dump, args.sampler
            )
            if row is None:
                continue
            runs.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump({"runs": runs, "median": medians(runs)}, f, indent=1)
    print(json.dumps({"median": medians(runs)}, indent=1), flush=True)


if __name__ == "__main__":
    main()
