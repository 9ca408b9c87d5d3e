"""Run a tracker in a child process, so that its CPU work (MLflow's SQLAlchemy store, protobuf
encoding...) never holds the training process's GIL. The hub's writer thread only waits on a pipe.

The child is ``python -c "...isolated import main; main()"`` (not a multiprocessing spawn: that would
re-import the user's training script, which rarely has a ``__main__`` guard); it talks over two
pipes with pickled messages between our own processes.

A failing call raises here, so the hub treats the backend as down (spill, replay) exactly as for
an in-process tracker. If the child itself dies (killed, out of memory, a crash in a library), the
call raises too, and the hub's next retry starts another child that carries on the same run: it
uploads the archive chunks the dead one had not, reopens the run as the first child had opened it
(:meth:`~hdet_track.tracking.base.Tracker.carry_on`) and is given again what the dead one held only
in memory (the batches since it last had nothing unwritten); the spilled batches follow, and
nothing is written twice. A backend that fails meanwhile leaves the new child to try again at the
next retry. Up to :data:`RESTARTS` deaths in a run are replaced; after the next one the batches
stay in the spill file for the next job on the store or ``hdet-track recover``.

The child outlives the training process: it runs in its own session and ignores SIGTERM, SIGINT
and SIGHUP (torchrun signals a worker's whole process group, and the training process decides
how its run ends), and when the training process vanishes without ending the run (SIGKILL, out
of memory, ``os._exit``) it ends the run KILLED itself, after writing what it had received.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

from ..events import RunEnd, RunStart
from ..owner import process_identity
from .base import BackendBroken, Batch, BatchRefused, Tracker, broken_backend
from .expand import materialize

__all__ = ["IsolatedTracker", "maybe_isolated"]

logger = logging.getLogger(__name__)
RESTARTS = 3  # this many deaths of the tracker process are replaced in a run; after the next it stays dead


def maybe_isolated(tracker: Tracker) -> Tracker:
    """``tracker`` in its own process when it asks for it (``isolate = True``), else itself."""
    return IsolatedTracker(tracker) if getattr(tracker, "isolate", False) else tracker


def _serve(conn_in: Connection, conn_out: Connection) -> None:
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    try:
        inner = conn_in.recv()
    except (EOFError, OSError):
        return
    # the run's owner is the training process; this one writes for it (a reader checks both)
    inner.owner = process_identity(os.getppid()) | {"writer": process_identity()}
    started, last_step = False, 0
    # a spill's replay (`hdet-track recover`): its process gone is not the job's end, which the
    # spill holds; the run stays as it is for the next replay (the claim on the spill is taken back)
    replay = bool(getattr(inner, "_replaying_spill", False))  # see MLflowTracker.replaying
    while True:
        try:
            method, args = conn_in.recv()
        except (EOFError, OSError):
            _vanished(inner, started and not replay, last_step)
            return
        if method == "detach":  # the caller gives up on this run for now and leaves it as it is
            conn_out.send((True, None, False))
            return
        try:
            if method == "upload_orphans":  # a child that died left chunks: they go before the run reopens
                try:
                    lines = inner.upload_left_behind()
                except Exception as exc:  # noqa: BLE001 - what is left stays for the next job on the store
                    lines = [
                        f"what gone processes left beside the store was not delivered ({type(exc).__name__}: {exc})"
                    ]
                conn_out.send((True, lines, _holds(inner)))  # a replacement asked again holds what it was given
                continue
            if method == "log":
                args = (materialize(args[0]),)
                last_step = max([last_step] + [p.step for p in args[0].points])
            started = started or method == "start"
            result = getattr(inner, method)(*args)
            reply = (True, (inner.run_id, inner.continuation()) if method == "start" else result)
        except Exception as exc:  # noqa: BLE001 - sent back and raised in the parent
            text = f"{type(exc).__name__}: {exc}"
            reply = (False, (text, method == "log" and inner.refuses(exc), broken_backend(exc)))
        reply += (_holds(inner),)
        try:
            conn_out.send(reply)
        except OSError:  # the training process died while this call ran
            _vanished(inner, started and method != "finish" and not replay, last_step)
            return
        if method == "finish":
            return


# The hub retries a backend that does not answer itself (every few seconds, its batches kept in a
# spill meanwhile). MLflow's client retries a request 7 times with a growing backoff (minutes for one
# call): that long the one writer thread, and every other tracker of the job, would wait. Unless the
# user chose them, the child's client gives up sooner.
CHILD_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}


def _holds(inner: Tracker) -> bool:
    try:
        return inner.holds()
    except Exception:  # noqa: BLE001 - cannot tell: it may hold data
        return True


def _child_environment() -> dict[str, str]:
    return CHILD_DEFAULTS | dict(os.environ)


def _vanished(inner: Tracker, started: bool, last_step: int) -> None:
    """The training process is gone: end the run it never ended KILLED (writing what ``inner`` holds)."""
    if started:
        text = f"the training process vanished after step {last_step} without ending its run"
        try:
            inner.finish(RunEnd(status="KILLED", step=last_step, error=text, time=time.time()))
        except Exception as exc:  # noqa: BLE001 - the backend is down too: the reader's owner check tells
            print(f"hdet-track: could not end the run KILLED ({type(exc).__name__}: {exc})", file=sys.stderr)


class IsolatedTracker(Tracker):
    """Wraps ``inner`` (which must pickle before it is started) and runs it in a spawned process.

    Records reach the child as they are (compact arrays) and are expanded there."""

    expands_records = True

    def __init__(self, inner: Tracker) -> None:
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]
        self._send: Connection | None = None
        self._recv: Connection | None = None
        self._proc: subprocess.Popen | None = None
        self._run_id: str | None = None
        self._dead = False  # no child to talk to: it ended the run, was let go or died
        self._died = False  # ... died: the next call starts another (RESTARTS deaths at most)
        self._deaths = 0
        self._run_start: RunStart | None = None
        self._continuation: dict[str, Any] = {}  # how the first child opened the run (Tracker.continuation)
        self._unsettled: list[Batch] = []  # batches the child may hold only in its memory
        self._carrying: list[Batch] | None = None  # a replacement's carry-on not done yet: batches to give it

    @property
    def run_id(self) -> str | None:
        return self._run_id

    def _call(self, method: str, *args: Any) -> Any:
        if self._dead:
            if not self._died:  # it ended the run, or was let go
                raise ConnectionError(f"the {self.name} tracker process has exited")
            if self._deaths > RESTARTS:
                self._close_child()  # reaped, once it is given up
                raise BackendBroken(
                    f"the {self.name} tracker process died {self._deaths} times in this run: not started again"
                )  # broken: the hub's shutdown does not wait for it
            self._replace()
        if self._proc is None:
            self._spawn()
        if self._carrying is not None:
            self._carry()
        return self._ask(method, *args)

    def _spawn(self) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(to_child_r), str(from_child_w)],
                pass_fds=(to_child_r, from_child_w),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=_child_environment(),
            )
        except BaseException:  # no process (out of memory, out of file descriptors): no pipe either
            for fd in (to_child_r, to_child_w, from_child_r, from_child_w):
                os.close(fd)
            raise
        os.close(to_child_r)
        os.close(from_child_w)
        self._send = Connection(to_child_w, readable=False)
        self._recv = Connection(from_child_r, writable=False)
        self._send.send(self.inner)

    def _ask(self, method: str, *args: Any) -> Any:
        assert self._send is not None and self._recv is not None
        try:
            self._send.send((method, args))
            ok, value, holds = self._recv.recv()
        except (EOFError, OSError) as exc:
            self._dead = self._died = True
            self._deaths += 1
            raise ConnectionError(f"the {self.name} tracker process died: {exc}") from None
        if not ok:
            text, refused, broken = value
            raise (BatchRefused if refused else BackendBroken if broken else RuntimeError)(text)
        if not holds:
            self._unsettled.clear()
        elif method == "log":
            self._unsettled.append(args[0])
        return value

    def _replace(self) -> None:
        """The child died: reap it and start another, which :meth:`_carry` brings up to date (a
        start that fails leaves it dead: the next retry tries again, with the same request)."""
        self._close_child()
        self._proc = None
        logger.warning(
            "hdet-track: the %s tracker process died; starting another (death %d of at most %d replaced in this run)%s",
            self.name, self._deaths, RESTARTS, f" to carry on run {self._run_id}" if self._run_id else "",
        )  # fmt: skip
        if self._run_id is None:  # it died before the run started: the caller's retry starts it
            self._dead = self._died = False
            return
        # what the dead child held only in memory (and what an unfinished carry-on had not given yet)
        self._carrying, self._unsettled = self._unsettled + (self._carrying or []), []
        self.inner.carry_on(self._run_id, self._continuation)
        try:
            self._spawn()  # the child gets the request with the tracker
        finally:
            self._adopt(self._run_id)  # the caller's tracker object: the request is used up (made again next time)
        self._dead = self._died = False

    def _carry(self) -> None:
        """Bring a replacement child up to date: the chunks the dead one left, the run reopened as
        it was, then what the dead one held only in memory (the reopened run skips what it holds).
        A call that fails leaves the rest for the next retry; a death, for the next replacement."""
        for line in self._ask("upload_orphans"):
            logger.warning("hdet-track: %s", line)
        assert self._run_start is not None and self._carrying is not None
        again, _ = self._ask("start", self._run_start)
        if again != self._run_id:  # never expected: rather the spill than another run
            self._deaths = RESTARTS + 1
            self._abandon()
            raise RuntimeError(f"the {self.name} tracker process started again in run {again}, not {self._run_id}")
        while self._carrying:
            self._ask("log", self._carrying[0])
            self._carrying.pop(0)
        self._carrying = None

    def _abandon(self) -> None:
        """Let the child go (killed if it lives) and take the tracker for dead."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        self._close_child()
        self._proc, self._dead, self._died = None, True, True

    def _adopt(self, run_id: str) -> None:
        adopt = getattr(self.inner, "_adopt_run_id", None)
        if adopt is not None:
            adopt(run_id)  # so that the caller's tracker object knows its run

    def resume(self, run_id: str) -> None:
        self.inner.resume(run_id)

    @property
    def pending_run_id(self) -> str | None:
        return self.inner.pending_run_id

    def replaying(self) -> None:
        self.inner.replaying()

    def spill_dir(self):  # noqa: ANN201
        return self.inner.spill_dir()

    def spill_settings(self) -> dict[str, Any]:
        return self.inner.spill_settings()

    def start(self, run_start: RunStart) -> None:
        # One wrapper (one child process) per scheduler's run: the child gets the caller's tracker
        # object as settings only (MLflowTracker.__getstate__), so a tracker object that logged an
        # earlier run starts a new one here, whatever run_id the caller's object still names.
        if self._run_id is None:
            self._run_start = run_start
            self._run_id, self._continuation = self._call("start", run_start)
            self._adopt(self._run_id)

    def log(self, batch: Batch) -> None:
        self._call("log", batch)

    def flush(self) -> None:
        self._call("flush")

    def heartbeat(self, beat: dict[str, float]) -> None:
        self._call("heartbeat", beat)

    def keep_alive(self) -> None:
        if self._proc is not None and not self._dead:
            self._call("keep_alive")

    def detach(self) -> None:
        """Let the writer process go without ending the run (a replay that stops half-way leaves
        the run for the next one); the run stays as it is."""
        if self._proc is not None and not self._dead:
            try:
                self._ask("detach")  # as it is: an unfinished carry-on is not run now
            except Exception:  # noqa: BLE001 - it is let go all the same
                pass
        self._dead, self._died = True, False  # let go: a child that died is not replaced, only reaped
        self._close_child()

    def finish(self, run_end: RunEnd) -> None:
        self._call("finish", run_end)
        self._dead, self._unsettled = True, []
        ended = getattr(self.inner, "_adopt_run_end", None)
        if ended is not None:
            ended()  # the caller's tracker object is free for a later scheduler's run
        self._close_child()

    def _close_child(self) -> None:
        if self._proc is not None:
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            for conn in (self._send, self._recv):
                if conn is not None:
                    conn.close()
            self._send = self._recv = None


def main(argv: list[str] | None = None) -> None:
    """The child's entry point: ``main([read_fd, write_fd])``."""
    fds = sys.argv[1:] if argv is None else argv
    _serve(Connection(int(fds[0]), writable=False), Connection(int(fds[1]), readable=False))


# ``-c``, not ``-m``: the package is already imported when ``-m`` runs this module a second time
_CHILD = "from hdet_track.tracking.isolated import main; main()"
