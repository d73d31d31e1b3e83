"""A process that imports torch, Lightning and the package once, then forks one fresh rank per request.

A rank started with ``python`` spends about 5 s of CPU importing Lightning (2.3 s of it because Lightning's version
checks import torchmetrics, which imports transformers), and the suite starts hundreds of ranks on 2 cores. Forking
from a process that has done those imports costs milliseconds. A forked rank is still a real process of its own: its
own pid and session, stdout and stderr going to its own files, the environment and working directory the launcher
gives it, and it ends as ``worker.py`` says (``atexit`` handlers such as the strategy's exit handler run; the
modules' teardown only for the tests of how a rank exits). The server itself starts no thread and no
process group, so nothing but the imports is inherited.

Protocol, one JSON object per line: the launcher writes ``{"argv", "env", "cwd", "stdout", "stderr"}`` to the
server's stdin; the server answers ``{"pid": P}`` on its stdout once it has forked, and ``{"pid": P, "returncode":
C}`` when that rank has exited (``C`` negative for a signal, as ``subprocess.Popen.returncode``). The server exits
when its stdin closes.

``FABRIC_HSDP_TEST_FRESH_PROCESSES=1`` makes ``launch()`` start every rank with a fresh ``python`` instead.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import runpy
import select
import signal
import sys
from typing import Any

# What ranks import anyway; each is skipped if it is not installed.
PRELOAD = (
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "lightning",
    "fabric_hsdp",
    "fabric_hsdp.strategy",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "litgpt.model",
    "torch._inductor.compile_fx",  # what torch.compile imports on its first call: 5 s of CPU a rank on a busy core
    "pytest",  # a test module holds the bodies its tests launch, and imports pytest
    "tests.helpers.training",
)


def _preload() -> None:
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def _reply(message: dict[str, Any]) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _reply({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})


def serve() -> dict[str, Any] | None:
    """Answer requests until stdin closes. Returns the request in a forked child, ``None`` in the server at the end."""
    pending = b""
    while True:
        _reap()
        readable, _, _ = select.select([0], [], [], 0.02)
        if not readable:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return None
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                return request
            _reply({"pid": pid})


def become(request: dict[str, Any]) -> None:
    """In the forked child: take the rank's session, files, environment and arguments, and run its script."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(file, fd)
        os.close(file)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = list(request["argv"])
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    _preload()
    # what the imports created stays out of every later collection (in the ranks too): a forked rank's gc.collect()
    # and its interpreter shutdown then only walk what the rank itself created (the usual prefork-server practice)
    gc.freeze()
    _reply({"ready": True})
    request = serve()
    if request is not None:
        become(request)  # then the interpreter exits as it does at the end of any script
