"""Helpers for the child processes tests start, without jax: a child imports them in a
moment."""


def dies_with_its_parent():
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets SIGKILL when the process that
    started it dies (Linux's ``PR_SET_PDEATHSIG``), so that a test run stopped by SIGTERM or
    SIGINT, which runs no ``finally``, leaves none of its children behind."""
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1

    def set_death_signal():
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    return set_death_signal
