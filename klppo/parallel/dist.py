"""Process-group set-up: one code path for 1 process, torchrun, and SLURM (+ torchrun).

Contract:
- ``init_distributed`` always leaves a ``torch.distributed`` process group behind, also for a single
  process started by hand (a 1-process group on a free local port), so sharding, checkpointing and
  reductions run the same code whatever the world size.
- ``phase(name)`` labels what the program is doing; a collective that fails or times out inside it is
  re-raised as :class:`CollectiveTimeoutError` naming the phase and the rank, instead of a bare gloo/NCCL
  message. That needs the backend to raise, and NCCL does not always: its watchdog thread only watches
  collectives already launched on the GPU (it then aborts the process, no Python exception), and a rank
  whose thread is still inside the NCCL call (the first collective of a kind on a communicator sets up its
  connections there, waiting for peers that never come) hangs forever, timeout or not. So ``init_distributed``
  (world size > 1) starts a :class:`PhaseWatch` on every rank: at 80% of the collective timeout a rank
  that stays in one phase prints which phase (the stalled rank names the cause, the waiting ranks the
  collective they wait in), and a rank whose main thread has stayed inside one ``torch.distributed``
  collective call for the timeout plus a grace (:func:`stall_grace_s`) prints one line naming its phase and
  the call, dumps every thread's Python stack, writes the line to torchrun's error file and ends with exit
  code :data:`COLLECTIVE_STALL_EXIT` (torchrun then stops the other ranks). The grace lets the backend's
  own error (gloo's exception, NCCL's watchdog) come first where it works. The label is also in the env
  var ``KLPPO_PHASE`` (read by :func:`current_phase`).
- Knows nothing about models or PPO.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

_current_phase = "startup"
_phase_stack: list[str] = []  # enclosing phases, outermost first: an error names the whole path
_phase_since = time.monotonic()  # when the innermost phase was entered or returned to

RENDEZVOUS_MIN_S = 300.0
"""Least time the start-up rendezvous waits for every rank to join (trainer.collective_timeout_s when
longer)."""
COLLECTIVE_STALL_EXIT = 75  # a rank ended by its PhaseWatch: it waited in one collective past the timeout
# the Python files whose functions enter the backends' collectives (dist.all_reduce, FSDP's all-gathers
# and reduce-scatters, barrier, new_group, destroy_process_group; functional collectives and DTensor)
COLLECTIVE_FILES = ("torch/distributed/distributed_c10d.py", "torch/distributed/_functional_collectives.py")


class CollectiveTimeoutError(RuntimeError):
    """A collective failed or timed out; the message names the phase and rank."""


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: ``rank`` in ``[0, world_size)``, ``local_rank`` on its node."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def under_launcher(env: dict[str, str] | None = None) -> bool:
    """True when a launcher already started the ranks: torchrun (``TORCHELASTIC_RUN_ID`` or
    ``RANK``+``WORLD_SIZE``) or a multi-task SLURM step (``SLURM_NTASKS`` > 1)."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env):
        return True
    return int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env


def free_port() -> int:
    """A TCP port free on 127.0.0.1 at the time of the call."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fill_rank_env() -> None:
    """Make ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_*`` present for ``env://`` init.

    torchrun sets them; a bare ``srun`` step gives SLURM's names (the user exports ``MASTER_ADDR``,
    see docs/distributed.md); a hand-started process becomes rank 0 of 1 on a free local port.
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        env.setdefault("LOCAL_RANK", "0")
        return
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        env["RANK"] = env["SLURM_PROCID"]
        env["WORLD_SIZE"] = env["SLURM_NTASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        if "MASTER_ADDR" not in env:
            raise ValueError(
                "under srun without torchrun, export MASTER_ADDR (the first node of the allocation) and "
                "MASTER_PORT; see docs/distributed.md"
            )
        env.setdefault("MASTER_PORT", "29500")
        return
    added = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": None,
    }
    for key, value in added.items():
        if key not in env:
            env[key] = value if value is not None else str(free_port())
            _ADDED_ENV.append(key)


# variables _fill_rank_env invented for a hand-started single process; destroy() removes them, so a later
# launch from the same process (e.g. `klppo train` relaunching under torchrun) is not mistaken for a rank
_ADDED_ENV: list[str] = []


def info() -> DistInfo:
    """The :class:`DistInfo` of the initialised group (asserts that one exists)."""
    assert dist.is_initialized(), "init_distributed() first"
    backend = dist.get_backend()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def init_distributed(device: str, timeout_s: float) -> DistInfo:
    """Join (or create) the default process group.

    ``device`` is "cuda" (NCCL, one GPU per local rank) or "cpu" (gloo). ``timeout_s`` bounds every
    collective: a rank waiting longer fails instead of hanging forever. The start-up rendezvous (torchrun's
    ``MASTER_ADDR``/``MASTER_PORT`` store) waits at least :data:`RENDEZVOUS_MIN_S` for every rank to join,
    so a short collective timeout does not fail a start whose ranks import slowly. Idempotent.
    """
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if dist.is_initialized():
        return info()
    _fill_rank_env()
    local_rank = int(os.environ["LOCAL_RANK"])
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device=cuda but no CUDA device is visible; use device=cpu")
        torch.cuda.set_device(local_rank)
        backend, dev = "nccl", torch.device("cuda", local_rank)
        kwargs = {"device_id": dev}
    else:
        backend, dev, kwargs = "gloo", torch.device("cpu"), {}
    # the rendezvous waits for late ranks (slow imports, nodes that start late) at least RENDEZVOUS_MIN_S,
    # whatever the collective timeout; then the store and the collectives use timeout_s
    store, rank, world_size = next(
        dist.rendezvous("env://", timeout=timedelta(seconds=max(timeout_s, RENDEZVOUS_MIN_S)))
    )
    store.set_timeout(timedelta(seconds=timeout_s))
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("default_pg", store),  # as init_method="env://" does
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,
    )
    result = DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, dev, backend)
    setup_rank_logging(result.rank)
    if backend == "nccl" and result.rank == 0:
        _warn_watchdog_settings(os.environ)
    logger.info("process group: %s world_size=%d backend=%s", dev, result.world_size, backend)
    global _watch
    if result.world_size > 1:
        faulthandler.enable(all_threads=True)  # a watchdog abort prints every thread's Python stack
        _watch = PhaseWatch(
            0.8 * timeout_s,
            result.rank,
            act_after_s=timeout_s + stall_grace_s(timeout_s),
            timeout_s=timeout_s,
        ).start()
    return result


# settings with which NCCL's watchdog logs a timed-out collective but does not end the process (a hang)
_WATCHDOG_OFF = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0"}


def _warn_watchdog_settings(env) -> None:
    for key, off in _WATCHDOG_OFF.items():
        if env.get(key, "").strip() == off:
            logger.warning(
                "%s=%s: NCCL's watchdog will not end a rank whose collective times out on the GPU (the run "
                "hangs instead of failing at trainer.collective_timeout_s); unset it",
                key,
                off,
            )


def stall_grace_s(timeout_s: float) -> float:
    """How long after the collective timeout a rank still inside one collective call is ended by its
    :class:`PhaseWatch` (the backend's own error, raised at the timeout, comes first where it works):
    10% of the timeout, at least 2 s, at most 60 s."""
    return min(60.0, max(2.0, 0.1 * timeout_s))


def setup_rank_logging(rank: int) -> None:
    """Rank 0 logs at INFO; other ranks only WARNING and above, so messages are not printed K times."""
    if rank != 0:
        logging.getLogger("klppo").setLevel(logging.WARNING)


def current_phase() -> str:
    """The label of the innermost :func:`phase` being run ("startup" before any)."""
    return _current_phase


_COLLECTIVE_ERRORS = (dist.DistError, RuntimeError)
_TIMEOUT_WORDS = ("timed out", "timeout", "connection closed", "connection reset", "nccl", "gloo")


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Label a stretch of work (``with phase("rollout"): ...``), nestable.

    A ``torch.distributed`` error escaping the block is re-raised as :class:`CollectiveTimeoutError`
    whose message names the phase and the rank.
    """
    global _current_phase, _phase_since
    previous, _current_phase = _current_phase, name
    _phase_stack.append(name)
    _phase_since = time.monotonic()
    path = phase_path()
    os.environ["KLPPO_PHASE"] = name
    logger.debug("phase=%s", name)
    try:
        yield
    except CollectiveTimeoutError:
        raise
    except _COLLECTIVE_ERRORS as e:
        text = str(e).lower()
        if isinstance(e, dist.DistError) or any(w in text for w in _TIMEOUT_WORDS):
            rank = dist.get_rank() if dist.is_initialized() else 0
            raise CollectiveTimeoutError(
                f"rank {rank}: a collective failed or timed out during phase {name!r} ({path}) (another rank "
                f"probably crashed or is stuck; its traceback is the root cause): {e}"
            ) from e
        raise
    finally:
        _phase_stack.pop()
        _current_phase = previous
        _phase_since = time.monotonic()
        os.environ["KLPPO_PHASE"] = previous


def phase_path() -> str:
    """The enclosing phases, outermost first (``"step > update_actor"``), or the current label."""
    return " > ".join(_phase_stack) or _current_phase


class PhaseWatch:
    """A daemon thread that watches this rank's phase and its main thread's collective calls.

    - A rank that stays in one phase for ``warn_after_s`` prints one line naming it (once per phase entry).
    - With ``act_after_s``: a rank whose main thread has been inside one call of a ``torch.distributed``
      collective (a frame of :data:`COLLECTIVE_FILES`, the same invocation at the same instruction) for
      ``act_after_s`` is ended: one line naming the phase and the call, every thread's Python stack, the
      line in torchrun's error file, then ``os._exit(COLLECTIVE_STALL_EXIT)`` (no interpreter teardown,
      which could wait on the stuck collective). Normal collectives cost nothing: the thread looks at the
      main thread's top frame every ``poll_s`` (every 0.25 s while one call looks stuck), and holds a frame
      only once two looks ``poll_s`` apart found the same call.
    """

    def __init__(
        self,
        warn_after_s: float,
        rank: int,
        poll_s: float | None = None,
        stream=None,
        *,
        act_after_s: float | None = None,
        timeout_s: float | None = None,
        collective_files: tuple[str, ...] = COLLECTIVE_FILES,
        exit_fn=os._exit,
    ) -> None:
        self.warn_after_s, self.rank = float(warn_after_s), rank
        self.poll_s = poll_s if poll_s is not None else min(5.0, self.warn_after_s / 4)
        self.stream = stream
        self.act_after_s = act_after_s
        self.timeout_s = timeout_s if timeout_s is not None else act_after_s
        self.collective_files = collective_files
        self.exit_fn = exit_fn
        # (address and instruction of a frame, first seen at); (the frame itself, its instruction, first seen
        # at)
        self._candidate: tuple[tuple[int, int], float] | None = None
        self._held: tuple[object, int, float] | None = None
        self._main_ident = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="klppo-phase-watch", daemon=True)

    def start(self) -> PhaseWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._held = None

    def check(self, now: float | None = None, warned: float | None = None) -> float | None:
        """Print the line if the current phase is overdue and not yet reported; returns the phase's start
        time when reported (``warned``: the start time already reported)."""
        since, label, path = _phase_since, _current_phase, phase_path()
        held = (time.monotonic() if now is None else now) - since
        if held < self.warn_after_s or warned == since:
            return warned
        stream = self.stream or sys.stderr
        print(
            f"klppo: rank {self.rank} has been in phase {label!r} ({path}) for {held:.0f} s; a collective "
            "that waits on it times out at trainer.collective_timeout_s (another rank stalled here, or this "
            f"rank waits in a collective)",
            file=stream,
            flush=True,
        )
        return since

    def in_collective(self, frame) -> bool:
        """Whether ``frame`` (a thread's innermost Python frame) is a function of a collective file."""
        if frame is None:
            return False
        return frame.f_code.co_filename.replace(os.sep, "/").endswith(self.collective_files)

    def observe(self, frame, now: float) -> float | None:
        """Track the main thread's innermost frame ``frame`` seen at ``now``; returns how long it has been
        inside one collective call (None when it is not in one).

        A frame is only referenced once two looks found the same frame address at the same instruction
        (the address alone can be reused by the next call of the same function); from then on, identity
        is exact, and the reference is dropped at the first look that finds another frame."""
        if not self.in_collective(frame):
            self._candidate = self._held = None
            return None
        if self._held is not None:
            held_frame, lasti, since = self._held
            if frame is held_frame and frame.f_lasti == lasti:
                return now - since
            self._held = None
        key = (id(frame), frame.f_lasti)
        if self._candidate is not None and self._candidate[0] == key:
            since = self._candidate[1]
            self._held, self._candidate = (frame, frame.f_lasti, since), None
            return now - since
        self._candidate = (key, now)
        return 0.0

    def stall_message(self, frame, waited_s: float) -> str:
        code = frame.f_code
        where = f"{code.co_name}, {_short_path(code.co_filename)}:{frame.f_lineno}"
        timeout = f" ({self.timeout_s:g} s)" if self.timeout_s is not None else ""
        return (
            f"klppo: rank {self.rank} has waited {waited_s:.0f} s in one collective call ({where}) during "
            f"phase {_current_phase!r} ({phase_path()}), past trainer.collective_timeout_s{timeout}, and the "
            f"backend did not end it: this rank stops with exit code {COLLECTIVE_STALL_EXIT} (a peer never "
            "joined the collective: the rank whose own line names another phase is the cause)"
        )

    def act(self, frame, waited_s: float) -> None:
        """End this rank: the line, every thread's stack, torchrun's error file, ``exit_fn``."""
        stream = self.stream or sys.stderr
        message = self.stall_message(frame, waited_s)
        stack = "".join(traceback.format_stack(frame))
        try:
            print(message, file=stream, flush=True)
            print(f"klppo: rank {self.rank}: Python stacks of every thread:", file=stream, flush=True)
            _dump_stacks(stream)
            _write_torchrun_error(message, stack)
        finally:
            self.exit_fn(COLLECTIVE_STALL_EXIT)

    def tick(self, now: float, warned: float | None) -> float | None:
        """One look: the phase line, then the main thread's collective call (ended past ``act_after_s``)."""
        warned = self.check(now=now, warned=warned)
        if self.act_after_s is None:
            return warned
        frame = sys._current_frames().get(self._main_ident)
        try:
            waited = self.observe(frame, now)
            if waited is not None and waited >= self.act_after_s:
                self.act(frame, waited)
        finally:
            del frame
        return warned

    def _run(self) -> None:
        warned = None
        while not self._stop.wait(0.25 if self._held is not None else self.poll_s):
            warned = self.tick(time.monotonic(), warned)


def _short_path(filename: str) -> str:
    path = filename.replace(os.sep, "/")
    return path[path.index("torch/") :] if "/torch/" in path else path


def _dump_stacks(stream) -> None:
    """Every thread's Python stack to ``stream``: faulthandler's (safe whatever the threads hold) when the
    stream is a real file, else the traceback module's."""
    try:
        faulthandler.dump_traceback(file=stream, all_threads=True)
        return
    except (AttributeError, ValueError, OSError):  # no fileno (a StringIO in tests)
        pass
    for ident, top in sys._current_frames().items():
        print(f"Thread 0x{ident:x}:", file=stream)
        print("".join(traceback.format_stack(top)), file=stream, end="", flush=True)


def _write_torchrun_error(message: str, stack: str) -> None:
    """The stall in torchrun's per-rank error file: its failure summary shows it (the console shows only
    local rank 0's output under `klppo train`)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {
        "message": {
            "message": f"CollectiveStall: {message}",
            "extraInfo": {"py_callstack": stack, "timestamp": str(int(time.time()))},
        }
    }
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass


_watch: PhaseWatch | None = None


def barrier() -> None:
    """A barrier on the default group (CPU tensors with gloo, the local GPU with NCCL)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def destroy() -> None:
    """Tear the default group down (no-op when none)."""
    global _watch
    if _watch is not None:
        _watch.stop()
        _watch = None
    if dist.is_initialized():
        dist.destroy_process_group()
    while _ADDED_ENV:
        os.environ.pop(_ADDED_ENV.pop(), None)
