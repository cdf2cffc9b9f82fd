"""A synthetic background load for ``hf-specdec bench --background-load``.

Speculative decoding is sold on CPU time it saves, and a shared machine takes CPU time away: the adaptive draft
length follows measured costs, and a plain loop and a speculative one do not slow down alike when another process
takes a core. :func:`background_load` reproduces that on purpose, so that a bench can report its figures with and
without a busy neighbour in the same invocation.

The load is one separate process per core asked for (``multiprocessing``, ``daemon=True``) running a pure-Python
busy loop: no torch, no threads of its own, no memory traffic to speak of, so it takes one core's worth of time
slices and nothing else. The processes are started when the block is entered and terminated when it is left,
whatever way it is left (an exception or ``KeyboardInterrupt`` included); a daemon process also dies with its
parent, and each one stops by itself when it notices that its parent is gone.

Example::

    from hf_specdec.bench.load import background_load

    with background_load() as procs:   # one core kept busy
        out = model.generate(**inputs, max_new_tokens=64)
    assert not any(p.is_alive() for p in procs)
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import warnings

PROCESS_NAME = "hf_specdec-background-load"


def _busy_loop(parent_pid: int) -> None:
    """Spin on one core until terminated, or until the parent process is gone."""
    count = 0
    while True:
        count += 1
        if count % 5_000_000 == 0 and os.getppid() != parent_pid:
            return


def _context():
    # fork (where there is one) starts the child without re-importing hf_specdec and torch; the child runs
    # nothing but the pure-Python loop above, so forking a multi-threaded parent is safe here
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else None)


def _stop(proc, timeout: float = 5.0) -> None:
    if proc.pid is None:  # never started
        return
    if proc.is_alive():
        proc.terminate()
    proc.join(timeout)
    if proc.is_alive():  # pragma: no cover - terminate() is enough for a pure-Python loop
        proc.kill()
        proc.join(timeout)


@contextlib.contextmanager
def background_load(processes: int = 1):
    """Keep ``processes`` CPU cores busy for the duration of the ``with`` block.

    Yields the list of ``multiprocessing.Process`` objects (named :data:`PROCESS_NAME`); all of them are
    terminated and joined when the block is left, also on an error or ``KeyboardInterrupt``.

    Example:
        >>> with background_load() as procs:
        ...     [p.is_alive() for p in procs]
        [True]
        >>> [p.is_alive() for p in procs]
        [False]
    """
    if processes < 1:
        raise ValueError(f"background_load needs at least one process, got {processes}.")
    ctx = _context()
    procs = [ctx.Process(target=_busy_loop, args=(os.getpid(),), name=PROCESS_NAME, daemon=True)
             for _ in range(processes)]
    try:
        with warnings.catch_warnings():
            # Python 3.12+ warns that fork() in a multi-threaded process may deadlock the child; ours runs no
            # code that takes a lock
            warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
            for proc in procs:
                proc.start()
        yield procs
    finally:
        for proc in procs:
            _stop(proc)
