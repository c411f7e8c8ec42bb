"""Helpers for the child processes tests start, without jax: a child imports them in a
moment."""
import os
import sys

# Run as `python -c _EXEC PARENT_PID CMD...`: sets Linux's PR_SET_PDEATHSIG, then replaces
# itself with CMD, which keeps the death signal (execve clears it only for set-user-ID
# binaries). A parent already gone before the prctl is caught by the getppid check.
_EXEC = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n")


def dying_with_its_parent(cmd: list[str]) -> list[str]:
    """``cmd`` wrapped so that the child gets SIGKILL when the process that started it dies:
    a test run stopped by SIGTERM or SIGINT, which runs no ``finally``, leaves none of its
    children behind. A wrapper rather than ``preexec_fn``: that makes ``subprocess`` fork
    through Python's fork hooks, and JAX's hook warns (an unraisable warning pytest fails)."""
    return [sys.executable, "-c", _EXEC, str(os.getpid()), *map(str, cmd)]
