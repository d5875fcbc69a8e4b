"""A local Python code-execution tool: each call runs the model's code in a fresh child process.

Limits of each run (the tool's ``config``): ``timeout_s`` of wall-clock time (the process group is killed),
``memory_limit_mb`` of address space and ``cpu_time_s`` of CPU time (``resource.setrlimit``: ``RLIMIT_AS``,
``RLIMIT_CPU``), files up to ``max_file_mb`` (``RLIMIT_FSIZE``), a fresh temporary directory as working and
home directory (deleted afterwards), an environment holding only ``PATH``, ``HOME`` and ``TMPDIR``, Python in
isolated mode (``-I``: no user site, no ``PYTHON*`` variables), stdin closed, and output cut to
``max_output_chars``. Network: the child first enters new user and network namespaces (``unshare``, Linux,
where unprivileged user namespaces are allowed), so it has no interface but loopback; in any case ``socket``
connections and name lookups are refused inside Python (best effort, for where namespaces are not allowed).

What it does NOT protect against: reading any file the training user can read and writing any file it can
write (no filesystem isolation: the temporary directory is only the default place), sockets opened through
``ctypes`` or a subprocess where the namespaces could not be entered, fork bombs (no ``RLIMIT_NPROC``: it
counts every process of the user), CPU use by child processes the code starts, and kernel exploits. Run it
only on trusted machines, or inside a container that provides the isolation.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import resource
import signal
import sys
import tempfile
from typing import Any

from klppo.tools.base import BaseTool, FunctionSpec, ToolResponse, ToolSchema

SCHEMA = ToolSchema(
    FunctionSpec(
        name="code_interpreter",
        description="Run Python code and return what it prints (stdout, then stderr).",
        parameters={
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python code to run."}},
            "required": ["code"],
        },
    )
)
DEFAULTS = {
    "timeout_s": 10.0,
    "memory_limit_mb": 1024,
    "cpu_time_s": 10,
    "max_file_mb": 16,
    "max_output_chars": 4096,
    "python": sys.executable,
}
_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
# run before the model's code
_NO_SOCKETS = (
    "import socket as _s\n"
    "def _refuse(*a, **k):\n    raise OSError('network access is disabled in this sandbox')\n"
    "_s.socket.connect = _refuse\n_s.socket.connect_ex = _refuse\n_s.create_connection = _refuse\n"
    "_s.getaddrinfo = _refuse\ndel _s, _refuse\n"
)


def _limit(memory_mb: int, cpu_s: int, file_mb: int):
    """The child's set-up between fork and exec: resource limits, then a network namespace if allowed."""

    def setup() -> None:
        mb = 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb * mb, memory_mb * mb))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb * mb, file_mb * mb))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        try:  # no network interface but loopback where unprivileged user namespaces are allowed
            ctypes.CDLL(None, use_errno=True).unshare(_CLONE_NEWUSER | _CLONE_NEWNET)
        except (OSError, AttributeError):
            pass

    return setup


async def run_python(code: str, **limits: Any) -> tuple[str, int | None, bool]:
    """Run ``code`` under the limits (``DEFAULTS`` keys) → (stdout + stderr cut, exit code, timed out)."""
    lim = {**DEFAULTS, **limits}
    with tempfile.TemporaryDirectory(prefix="klppo-sandbox-") as tmp:
        script = os.path.join(tmp, "main.py")
        with open(script, "w") as f:
            f.write(code)
        runner = (
            _NO_SOCKETS + "__file__ = 'main.py'\nexec(compile(open('main.py').read(), 'main.py', 'exec'))\n"
        )
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tmp, "TMPDIR": tmp}
        proc = await asyncio.create_subprocess_exec(
            str(lim["python"]),
            "-I",
            "-c",
            runner,
            cwd=tmp,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_limit(int(lim["memory_limit_mb"]), int(lim["cpu_time_s"]), int(lim["max_file_mb"])),
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout=float(lim["timeout_s"]))
            timed_out = False
        except asyncio.TimeoutError:
            _kill_group(proc.pid)
            out, _ = await proc.communicate()
            timed_out = True
        text = out.decode("utf-8", errors="replace")
        cap = int(lim["max_output_chars"])
        if len(text) > cap:
            text = text[:cap] + f"\n...(output cut at {cap} characters)"
        return text, proc.returncode, timed_out


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class PythonTool(BaseTool):
    """``code_interpreter(code)`` → what the code printed, with the exit status when it failed or timed
    out."""

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: ToolSchema | None = None) -> None:
        super().__init__(config or {}, tool_schema or SCHEMA)
        unknown = set(self.config) - set(DEFAULTS) - {"type"}
        if unknown:
            raise ValueError(f"PythonTool config: unknown keys {sorted(unknown)}; known: {sorted(DEFAULTS)}")
        self.limits = {k: v for k, v in self.config.items() if k in DEFAULTS}

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        code = parameters.get("code")
        if not isinstance(code, str):
            return ToolResponse(text="error: expected a string argument 'code'"), 0.0, {"error": 1}
        text, status, timed_out = await run_python(code, **self.limits)
        if timed_out:
            text += f"\n(killed: ran past {self.limits.get('timeout_s', DEFAULTS['timeout_s'])} s)"
        elif status:
            text += f"\n(exit status {status})"
        return ToolResponse(text=text), 0.0, {"error": int(bool(status) or timed_out)}
