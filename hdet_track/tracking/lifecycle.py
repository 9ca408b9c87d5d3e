"""How a tracked run ends: by what the job did, not by how its process ended.

A run is FINISHED only when the job reached ``total_steps`` or closed it (``close()``, the context
manager). A process that ends before that leaves it FAILED (an uncaught exception, also through
``torch.multiprocessing.spawn``'s wrapper; a non-zero exit; the exit code and the last step are in
the ``hdet.error`` tag) or KILLED (SIGTERM, SIGINT, SIGHUP, torchrun tearing the survivors down).
A run left open after its last step (for final metrics) is ended FINISHED as soon as the process
starts another tracked run, as ``wandb.init`` ends the previous run: what goes wrong in a later run
of a sweep is not this one's failure. Until then an exception, a signal or a non-zero exit of the
process is its failure.
When another rank failed first (torchrun then tears this one down), the run is FAILED with that
rank's error: every rank that fails leaves a note in torch.distributed's own key-value store.

The runs end at the process's exit, after its non-daemon threads (a job may train in one), and
before any other exit handler: when the main thread is done, hdet-track's handler is moved to the
front of the queue, ahead of those a backend registered after it (W&B's, when hdet-track's writer
thread set W&B up, perhaps while the job was already failing). A run that MLflow's fluent API holds
as its active run is ended there with the same status (MLflow's own exit handler would end it
FINISHED).

Installed once per process by the first :class:`~hdet_track.tracking.recorder.Recorder`. Nothing
here raises into the training loop.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import signal
import sys
import threading
import traceback
from typing import Any

__all__ = [
    "install",
    "register",
    "registered",
    "unregister",
    "exit_status",
    "end_runs_first_at_exit",
    "end_fluent_mlflow_run",
    "caught_failure",
]

logger = logging.getLogger(__name__)

_RECORDERS: set = set()  # strong: a job's scheduler may be gone before its process ends
_STATE: dict[str, Any] = {
    "installed": False,
    "rank": 0,
    "failure": None,
    "exit_code": None,
    "signal": None,
    "interrupted": False,  # SIGINT came (its KeyboardInterrupt may be swallowed: torch's spawn does)
}
_NOTE = "hdet/failure/rank"


def register(recorder: Any) -> None:
    """End ``recorder``'s run by these rules when the process ends (it has ``end_with_process``).

    A new run: the runs still open after their last step (``finished_open()``) are ended FINISHED
    now (``end_finished()``) and forgotten, with their schedulers and models."""
    for earlier in list(_RECORDERS):
        try:
            if earlier.finished_open():
                earlier.end_finished()
        except Exception:  # noqa: BLE001 - never in the way of the next run
            logger.warning("hdet-track: could not end the previous run:\n%s", traceback.format_exc())
    _STATE["interrupted"] = False  # a Ctrl-C that an earlier trial of a sweep caught is not this run's
    _RECORDERS.add(recorder)


def registered() -> list:
    """The recorders whose runs the process's exit would still end."""
    return list(_RECORDERS)


def unregister(recorder: Any) -> None:
    """``recorder``'s run has ended (and its writer stopped): nothing left to do at exit."""
    _RECORDERS.discard(recorder)


def exit_status(reached_end: bool, last_step: int, total_steps: int) -> tuple[str, str | None]:
    """The status of a run whose process is ending, and why (None when it finished)."""
    if _STATE["failure"] is not None:
        return _STATE["failure"]
    if _STATE["signal"] is not None:
        status, text = _STATE["signal"]
        return status, text
    code = _STATE["exit_code"]
    failed_exit = code not in (None, 0)
    if reached_end and not failed_exit:
        return "FINISHED", None
    if reached_end:
        return "FAILED", f"the process exited with code {code} after the run's last step ({last_step} of {total_steps})"
    if _STATE["interrupted"]:
        return "KILLED", f"interrupted by SIGINT at step {last_step} of {total_steps}"
    return "FAILED", (
        f"the process ended at step {last_step} of {total_steps} without closing the run"
        + (f" (exit code {code})" if code is not None else "")
    )


def _close_all(reason: str) -> None:
    for recorder in list(_RECORDERS):
        try:
            status = recorder.end_with_process(reason)
            unregister(recorder)  # ended: a later exit handler (multiprocessing's) does not wait for it again
            if status not in (None, "FINISHED"):
                end_fluent_mlflow_run(recorder.run_ids(), status)
        except Exception:  # noqa: BLE001 - never in the way of an exiting process
            logger.warning("hdet-track: could not end the run at %s:\n%s", reason, traceback.format_exc())


def end_fluent_mlflow_run(run_ids: dict[str, str | None], status: str) -> None:
    """A run of this job that MLflow's fluent API holds as its active run (``$MLFLOW_RUN_ID``, the
    user's ``mlflow.start_run()``, Hugging Face's MLflow callback) is ended with ``status`` there too:
    MLflow's own exit handler ends an active run FINISHED, over hdet-track's FAILED or KILLED."""
    fluent = sys.modules.get("mlflow.tracking.fluent")  # never imported here: only if the job uses it
    if fluent is None:
        return
    active = fluent.active_run()
    if active is not None and active.info.run_id in {v for k, v in run_ids.items() if k.startswith("mlflow")}:
        fluent.end_run(status)


def _move_to_front() -> None:
    """The main thread is done (threading's own exit hook, before the non-daemon threads are joined
    and before every exit handler): hdet-track's exit handler goes to the front of the queue, ahead
    of those registered after it. Nothing is ended here: a job may still train in another thread."""
    if os.getpid() == _STATE["pid"]:  # not in a forked child (a DataLoader worker) on its way out
        end_runs_first_at_exit()


def _format(exc_type: type, exc: BaseException, tb: Any) -> str:
    return "".join(traceback.format_exception(exc_type, exc, tb))[-4000:]


def _record_exception(exc_type: type, exc: BaseException, tb: Any) -> None:
    killed = issubclass(exc_type, KeyboardInterrupt)
    text = _format(exc_type, exc, tb)
    if _STATE["failure"] is None:
        peer = None if killed else _peer_failure()
        _STATE["failure"] = ("KILLED" if killed else "FAILED", peer or text)
    _leave_note(text)


def caught_failure(exc: BaseException) -> tuple[str, str]:
    """The status and error a run ends with when a trainer caught ``exc`` in training (Lightning's
    ``on_exception``, Hugging Face's ``train()``): KILLED on ``KeyboardInterrupt``, else FAILED with
    the error; under torch.distributed this rank leaves a note first, and rank 0 takes the note of
    a rank that failed before it (it failed on a collective because that rank was gone), as an
    uncaught exception does."""
    text = _format(type(exc), exc, exc.__traceback__)
    if isinstance(exc, KeyboardInterrupt):
        return "KILLED", text
    _leave_note(text)  # rank 0 leaves none
    return "FAILED", (_peer_failure() if _STATE["rank"] == 0 else None) or text


def _store() -> Any:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001
        return None
    return None


def _leave_note(text: str) -> None:
    """This rank failed: say so in torch.distributed's store, for rank 0 to report; numbered in the
    order the ranks fail, once per process (its first failure: a later one, the same error
    propagating to the excepthook, or a collective failing after it, is not the cause)."""
    store = _store()
    if store is not None and _STATE["rank"] != 0 and not _STATE.get("noted"):
        try:
            order = store.add(f"{_NOTE}order", 1)
            store.set(f"{_NOTE}{_STATE['rank']}", f"{order}\n{text}")
            _STATE["noted"] = True
        except Exception:  # noqa: BLE001
            pass


def _peer_failure() -> str | None:
    """The failure note of the rank that failed first, if one was left (rank 0, when it is torn
    down or fails itself): with three ranks or more, the ranks the first failure took down leave
    notes too (their collective failed), after it."""
    store = _store()
    if store is None:
        return None
    previous = None
    try:
        import torch.distributed as dist

        previous = store.timeout
        store.set_timeout(datetime.timedelta(seconds=2))
        notes = []
        for rank in range(1, dist.get_world_size()):
            key = f"{_NOTE}{rank}"
            if store.check([key]):
                order, _, text = store.get(key).decode(errors="replace").partition("\n")
                notes.append((int(order) if order.isdigit() else sys.maxsize, rank, text))
        if not notes:
            return None
        _, rank, text = min(notes)
        return f"rank {rank} failed:\n" + text[-3900:]
    except Exception:  # noqa: BLE001
        return None
    finally:
        if previous is not None:
            try:
                store.set_timeout(previous)
            except Exception:  # noqa: BLE001
                pass


def install(rank: int) -> None:
    """Install the exit, exception and signal hooks (once per process)."""
    _STATE["rank"] = rank
    if _STATE["installed"]:
        return
    _STATE["installed"] = True
    _STATE["pid"] = os.getpid()
    atexit.register(_close_all, "exit")
    try:  # threading's hook for the end of the main thread (concurrent.futures' too, since 3.9)
        threading._register_atexit(_move_to_front)  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):  # another Python, or the interpreter is shutting down already
        pass
    # Processes started by multiprocessing leave through os._exit when forked: atexit never runs
    # there, multiprocessing's finalizers do.
    from multiprocessing import util as mp_util

    mp_util.Finalize(None, _close_all, args=("exit",), exitpriority=100)
    previous_hook = sys.excepthook

    def excepthook(exc_type, exc, tb):  # type: ignore[no-untyped-def]
        _record_exception(exc_type, exc, tb)
        if not (previous_hook is sys.__excepthook__ and _wandb_printed_it()):
            previous_hook(exc_type, exc, tb)

    sys.excepthook = excepthook
    real_exit = sys.exit

    def exit_with_code(code: Any = None) -> None:
        # torch.multiprocessing.spawn catches the training function's exception and calls
        # sys.exit(1) while handling it: no excepthook sees it, this does.
        _STATE["exit_code"] = code
        current = sys.exc_info()
        if current[1] is not None and not isinstance(current[1], SystemExit) and code not in (None, 0):
            _record_exception(*current)  # type: ignore[arg-type]
        elif code not in (None, 0):  # for rank 0, which torchrun may tear down before it gets there itself
            _leave_note(f"the process exited (exit code {code})")
        real_exit(code)

    sys.exit = exit_with_code
    import builtins

    for name in ("exit", "quit"):  # site's exit()/quit() raise SystemExit without sys.exit
        quitter = getattr(builtins, name, None)
        if quitter is not None:
            setattr(builtins, name, _Leave(quitter, exit_with_code))
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGHUP):
            try:
                if signal.getsignal(signum) in (signal.SIG_DFL, None):
                    signal.signal(signum, _on_signal)
            except (ValueError, OSError):  # pragma: no cover - not the main interpreter
                pass
        try:
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                signal.signal(signal.SIGINT, _on_interrupt)
        except (ValueError, OSError):  # pragma: no cover - not the main interpreter
            pass


class _Leave:
    """site's ``exit``/``quit`` that tells the run its code as ``sys.exit`` does (shown as site's own)."""

    def __init__(self, quitter: Any, exit_with_code: Any) -> None:
        self._quitter, self._exit = quitter, exit_with_code

    def __repr__(self) -> str:
        return repr(self._quitter)

    def __call__(self, code: Any = None) -> None:
        with contextlib.suppress(Exception):  # site's closes stdin first, as an interactive exit does
            sys.stdin.close()
        self._exit(code)


def end_runs_first_at_exit() -> None:
    """Make the process's exit end the tracked runs before any exit handler registered so far (a
    backend's: ``wandb.init`` registers one that would end the run first, without the status and
    error hdet-track gives it). Called when the main thread is done, and by a tracker after it set
    its backend up."""
    if _STATE["installed"]:
        atexit.unregister(_close_all)
        atexit.register(_close_all, "exit")


def _wandb_printed_it() -> bool:
    """Whether the hook that called ours is W&B's (``wandb.init`` wraps the excepthook it finds):
    it prints the traceback itself before calling the hook it wrapped, so ours must not print it
    again through Python's default hook."""
    owner = getattr(sys.excepthook, "__self__", None)
    return type(owner).__name__ == "ExitHooks" and type(owner).__module__.startswith("wandb")


def _on_interrupt(signum: int, frame: Any) -> None:
    """SIGINT (Ctrl-C) raises KeyboardInterrupt as Python's own handler does, and is remembered: a
    run left open by it ends KILLED even where the KeyboardInterrupt is swallowed on its way out
    (torch.multiprocessing.spawn's workers swallow it), not FAILED as a process that just ended."""
    _STATE["interrupted"] = True
    signal.default_int_handler(signum, frame)


def _on_signal(signum: int, frame: Any) -> None:
    name = signal.Signals(signum).name
    peer = _peer_failure()
    if peer is not None:  # torchrun tears the survivors down after a rank failed
        _STATE["signal"] = ("FAILED", peer)
    elif _STATE["exit_code"] not in (None, 0):
        pass  # torn down while leaving with a failing exit code of its own: FAILED by that code
    else:
        _STATE["signal"] = ("KILLED", f"terminated by {name}")
    _close_all(name)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # and die as the signal would have made it
