"""The ``hdet-track`` command line."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
from collections.abc import Iterator

from . import __version__


def _number(kind: type, what: str, ok) -> object:
    """An argparse type: ``kind(text)`` that satisfies ``ok``, else a message saying ``what`` is expected."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(
                f"expected {what}, got {value!r}" if isinstance(value, str) else f"expected {what}, got {value}"
            )
        return value

    return parse


_positive_int = _number(int, "a positive integer", lambda v: v >= 1)
_positive_float = _number(float, "a positive finite number", lambda v: 0 < v < float("inf"))
_spread = _number(float, "a number in [0, 1)", lambda v: 0.0 <= v < 1.0)
_port = _number(int, "a port in 1..65535", lambda v: 1 <= v <= 65535)
_seed = _number(int, "an integer in [0, 2**63)", lambda v: 0 <= v < 2**63)
_nonempty = _number(str, "a non-empty value (leave the option out for its default)", lambda v: v != "")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hdet-track", description="Hyperparameter-Divergent Ensemble Training")
    parser.add_argument("--version", action="version", version=f"hdet-track {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="train OneCycle and HDET side by side on real data with N local gloo replicas, logged to MLflow",
        description="The paper's ablation on one machine: OneCycle at a conservative and at an aggressive "
        "max_lr, HDET without auto-LR and full HDET (--quick: aggressive OneCycle vs full HDET), same data "
        "order, seed and step budget, every run logged to one experiment and compared at the end.",
    )
    demo.add_argument(
        "--dataset",
        choices=["digits", "fashion-mnist", "text"],
        default="digits",
        help="digits (scikit-learn's bundled 8x8 digits, default), fashion-mnist (idx files) or text "
        "(character-level language model on --text-file, default the Python standard library's sources)",
    )
    demo.add_argument("--data-dir", default=None, help="directory with the Fashion-MNIST idx files")
    demo.add_argument("--text-file", default=None, help="UTF-8 text for --dataset text (default: stdlib sources)")
    demo.add_argument("--replicas", type=_positive_int, default=4, help="replica processes per run (default 4)")
    demo.add_argument(
        "--steps", type=_positive_int, default=None, help="optimizer steps per run (default 600, --quick 200)"
    )
    demo.add_argument("--sync-every", type=_positive_int, default=25, help="steps between averagings (default 25)")
    demo.add_argument("--quick", action="store_true", help="only baseline-high vs full HDET, 200 steps")
    demo.add_argument("--tracker", choices=["mlflow", "wandb"], default="mlflow")
    demo.add_argument(
        "--grad-mode",
        choices=["shared", "independent"],
        default="shared",
        help="shared: DDP gradients every step (the paper); independent: local-SGD replicas",
    )
    demo.add_argument(
        "--low-lr", type=_positive_float, default=None, help="conservative max_lr (default 0.05; text 0.002)"
    )
    demo.add_argument(
        "--high-lr",
        type=_positive_float,
        default=None,
        help="aggressive max_lr (default: digits 1, fashion-mnist 0.5, text 0.02)",
    )
    demo.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto: nccl on the GPUs when there is one per replica, else gloo on the CPU",
    )
    demo.add_argument("--spread", type=_spread, default=0.5, help="HDET's LR spread alpha in [0, 1) (default 0.5)")
    demo.add_argument("--group", type=_nonempty, default=None, help="compare group of the runs (default: a fresh one)")
    demo.add_argument("--seed", type=_seed, default=0)
    demo.set_defaults(subparser=demo)  # run_demo's own errors read "usage: hdet-track demo ..."
    cmp = sub.add_parser("compare", help="the comparison table (paper's Table 1) from runs already logged")
    cmp.add_argument(
        "--tracking-uri",
        type=_nonempty,
        default=None,
        help="an MLflow tracking URI or a W&B directory (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)",
    )
    cmp.add_argument(
        "--experiment",
        type=_nonempty,
        default=None,
        help="default: the experiment the demo writes to ($MLFLOW_EXPERIMENT_NAME or hdet); "
        "for a W&B directory, the W&B project ($WANDB_PROJECT or hdet)",
    )
    cmp.add_argument(
        "--group",
        type=_nonempty,
        default=None,
        help="compare group (default: the group of the newest run that has one); a group spans experiments "
        "unless --experiment is given",
    )
    cmp.add_argument("--format", choices=["table", "markdown", "json"], default="table")
    dash = sub.add_parser(
        "dashboard",
        help="open the Streamlit dashboard on an MLflow tracking URI or a W&B directory (read-only)",
    )
    dash.add_argument(
        "source",
        nargs="?",
        default=None,
        help="MLflow tracking URI (sqlite:///mlflow.db, http://127.0.0.1:5000) or a W&B directory; "
        "default: $HDET_DASHBOARD_SOURCE, else $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db",
    )
    dash.add_argument("--port", type=_port, default=8501, help="port (default 8501)")
    dash.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    rec = sub.add_parser(
        "recover",
        help="deliver what a crashed job could not log (its spill files) to the store",
        description="A job that ended while its tracking backend was unreachable leaves its unsent batches "
        "in a spill directory of the store (see hdet_track/tracking/spill.py); the next job that logs to the "
        "same store delivers them, or this command does.",
    )
    rec.add_argument(
        "source",
        nargs="?",
        default=None,
        help="MLflow tracking URI, a W&B directory or a .hdet-spill directory; "
        "default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db",
    )
    return parser


def _fail(message: str) -> int:
    print(f"hdet-track: {message}", file=sys.stderr)
    return 2


def _unwritable_store(tracker: str, uri: str) -> str | None:
    """Why the demo could not write its runs (a message naming the place and the fix), or None."""
    import os
    from pathlib import Path

    if tracker == "wandb":
        from .tracking.wandb import _MODES

        mode = os.environ.get("WANDB_MODE")
        if mode is not None and mode not in _MODES:
            return f"WANDB_MODE={mode!r} is no W&B mode; expected one of {_MODES} or unset (offline)"
        if mode == "disabled":
            return "WANDB_MODE=disabled writes no W&B run, and the demo reads its runs back: unset it or use WANDB_MODE=offline"
        given = os.environ.get("WANDB_DIR")
        where = Path(given or os.getcwd())
        if given and not where.is_dir():
            return f"WANDB_DIR={given!r} is not a directory: create it, or point WANDB_DIR at one"
        if not os.access(where, os.W_OK):
            fix = (
                "point WANDB_DIR at a writable directory" if given else "run from a writable directory or set WANDB_DIR"
            )
            return f"cannot write W&B's run files in {where}: {fix}"
        return None
    from .tracking.spill import uri_scheme

    if uri and uri_scheme(uri) in (None, "file"):
        return (
            f"MLFLOW_TRACKING_URI={uri!r} is an MLflow file store, which cannot hold HDET's nested metric "
            "names: use a database (sqlite:///PATH) or a tracking server (http://HOST:PORT)"
        )
    if uri and not uri.startswith("sqlite:"):
        return None  # a server or another store: it reports its own errors
    db = Path(uri[len("sqlite:///") :] if uri else "mlflow.db").absolute()
    target = db if db.exists() else db.parent
    if not os.access(target, os.W_OK):
        fix = (
            "use a writable path in MLFLOW_TRACKING_URI"
            if uri
            else "run from a writable directory or set MLFLOW_TRACKING_URI"
        )
        return f"cannot write the MLflow store {db}: {fix}"
    return None


def run_demo(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Run the ablation; ``parser`` is the ``demo`` subparser (its usage line goes with argument errors)."""
    import os
    import uuid

    from .examples.ablation import AblationConfig, DataError, choose_device, run_ablation

    for flag, value, dataset in (
        ("--data-dir", args.data_dir, "fashion-mnist"),
        ("--text-file", args.text_file, "text"),
    ):
        if value is not None and args.dataset != dataset:
            parser.error(f"{flag} {value!r} is for --dataset {dataset}, not --dataset {args.dataset}")
    if args.quick and args.low_lr is not None:
        parser.error(f"--low-lr {args.low_lr:g} is for the full demo: --quick runs no conservative baseline")
    steps = args.steps or (200 if args.quick else 600)
    if steps < args.sync_every:
        parser.error(f"--steps ({steps}) must be at least --sync-every ({args.sync_every})")
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    problem = _unwritable_store(args.tracker, uri)
    if problem:
        return _fail(problem)
    try:
        device = choose_device(args.device, args.replicas)
    except ValueError as exc:
        return _fail(str(exc))
    group = args.group or f"demo-{uuid.uuid4().hex[:8]}"
    cfg = AblationConfig(
        dataset=args.dataset,
        data_dir=args.data_dir,
        text_file=args.text_file,
        device=device,
        replicas=args.replicas,
        steps=steps,
        sync_every=args.sync_every,
        low_lr=args.low_lr,
        high_lr=args.high_lr,
        spread=args.spread,
        grad_mode=args.grad_mode,
        tracker=args.tracker,
        compare_group=group,
        seed=args.seed,
    )
    try:
        cfg.task()  # the data must be readable before any run is created
    except (DataError, ImportError) as exc:
        return _fail(str(exc))
    specs = cfg.ablation(args.quick)
    backend = "nccl" if device == "cuda" else "gloo"
    lrs = " / ".join(f"{lr:g}" for lr in sorted({s.max_lr for s in specs}))  # only the runs that run
    print(
        f"hdet-track demo: {args.dataset}, {args.replicas} {backend} replicas ({args.grad_mode} gradients), "
        f"{steps} steps, max_lr {lrs}, runs: {', '.join(s.name for s in specs)}; compare group {group}",
        flush=True,
    )

    def failed(name: str, why: str) -> None:  # one line, and the next run starts
        print(f"\nhdet-track demo: run {name} failed: {why}; going on with the other runs", file=sys.stderr, flush=True)

    started = time.time()
    try:
        with _quiet_worker_deaths():
            results = run_ablation(cfg, args.quick, on_failure=failed)
    except (KeyboardInterrupt, _signal_exception()) as exc:  # Ctrl-C, or the launcher's SIGTERM/SIGHUP
        signum = int(getattr(exc, "sigval", signal.SIGINT))
        name = signal.Signals(signum).name
        print(f"\nhdet-track demo: stopped by {name}; the run in progress ends KILLED", file=sys.stderr, flush=True)
        return 128 + signum
    any_failed = any(r.get("failed") for r in results)
    if args.tracker == "mlflow":
        print()
        code = run_compare(None, None, group, "table")
        print()
        for line in closing_hints(uri or "sqlite:///mlflow.db", "mlflow"):
            print(line)
        return 1 if any_failed else code
    # W&B writes its runs into a wandb/ folder of $WANDB_DIR (default: here); the hints name that
    # folder, not its parent, which may hold an mlflow.db (bin/demo's) that would be read instead
    wandb_dir = os.environ.get("WANDB_DIR") or "."
    runs_dir = os.path.normpath(os.path.join(wandb_dir, "wandb"))
    print()
    code = _wandb_table(runs_dir, results, group, started)
    print()
    for line in closing_hints(runs_dir, "wandb"):
        print(line)
    return 1 if any_failed else code


def _signal_exception() -> type[BaseException]:
    """What torch's elastic launcher raises in its process on SIGINT, SIGTERM and SIGHUP."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    return SignalException


@contextlib.contextmanager
def _quiet_worker_deaths() -> Iterator[None]:
    """Within: torch's elastic launcher logs no traceback of its own polling for a worker that died of
    a signal (the demo says which rank died, and how, in one line); a worker's own exception (its
    traceback) is still logged."""
    import logging

    from torch.multiprocessing import ProcessExitedException

    def keep(record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], ProcessExitedException))

    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def _wandb_table(wandb_dir: str, results: list[dict], group: str | None = None, since: float = 0.0) -> int:
    """Print the comparison table of the demo's W&B runs, read back from ``wandb_dir`` as ``compare``
    reads MLflow runs (the same rows, "diverged" included); 2 when a run cannot be read back. A run
    whose processes failed (no run id came back) is found by its name in ``group`` among the runs
    started at ``since`` or later (not an earlier demo's of the same name), when it logged."""
    from .compare import comparison_rows, format_rows
    from .readers import ReaderError
    from .readers.wandb import WandbReader

    runs, missing = [], []
    listed = None
    for r in results:
        run_id = (r.get("run_ids") or {}).get("wandb")
        try:
            if run_id is None and r.get("failed"):
                if listed is None:
                    try:
                        listed = WandbReader(wandb_dir).list_runs(compare_group=group, limit=None) if group else []
                    except ReaderError:
                        listed = []  # no W&B directory: no run got as far as W&B
                found = (s.run_id for s in listed if s.name == r["name"] and s.start_time >= since)
                run_id = next(found, None)  # newest first
                if run_id is None:
                    continue  # it died before its run was created: nothing to show
            if run_id is None:
                raise ReaderError("its tracker reported no run id")
            runs.append(WandbReader(wandb_dir).read(run_id, max_rows=sys.maxsize))  # as compare reads them
        except ReaderError as exc:
            missing.append(f"hdet-track: could not read run {r['name']} back from {wandb_dir}: {exc}")
    if runs:
        print(format_rows(comparison_rows(runs), "table"))
    for line in missing:
        print(line, file=sys.stderr)
    return 2 if missing else 0


def command_for(script: str, module: str) -> str:
    """How to type console script ``script`` (from this interpreter's environment) in the working directory.

    The bare name when ``PATH`` finds this environment's copy; else its path (relative when it lies under
    the working directory, as ``.venv/bin/hdet-track`` does right after ``bash bin/demo`` in a fresh clone);
    else ``python -m module`` with this interpreter.
    """
    import os
    import shlex
    import shutil
    import sysconfig

    def typed(path: str) -> str:
        rel = os.path.relpath(path)
        if rel.startswith(os.pardir):
            return shlex.quote(path)
        return shlex.quote(rel if os.sep in rel else os.path.join(os.curdir, rel))  # never a bare name

    scripts = sysconfig.get_path("scripts")
    ours = shutil.which(script, path=scripts) if scripts else None
    on_path = shutil.which(script)
    if on_path and (ours is None or os.path.samefile(on_path, ours)):
        return script
    if ours:
        return typed(ours)
    return f"{typed(sys.executable)} -m {module}"


def closing_hints(source: str, tracker: str) -> list[str]:
    """The demo's last lines: commands that open its runs, ready to paste in the working directory."""
    import shlex

    source = shlex.quote(source)
    lines = [f"Open the dashboard:  {command_for('hdet-track', 'hdet_track.cli')} dashboard {source}"]
    if tracker == "mlflow" and source.startswith(("http://", "https://")):
        lines.append(f"Open MLflow's UI:    {source} (the server's own page)")
    elif tracker == "mlflow":
        mlflow = command_for("mlflow", "mlflow")
        lines.append(f"Open MLflow's UI:    {mlflow} ui --backend-store-uri {source} --host 127.0.0.1")
    return lines


def _store(given: str | None) -> str:
    """``--tracking-uri`` / SOURCE of compare and recover: as given, else ``$MLFLOW_TRACKING_URI``,
    else ``sqlite:///mlflow.db`` (``$HDET_DASHBOARD_SOURCE`` is the dashboard's alone)."""
    import os

    return given or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"


def run_compare(tracking_uri: str | None, experiment: str | None, group: str | None, fmt: str) -> int:
    import os

    from .compare import comparison_rows, format_rows
    from .readers import ReaderError, open_reader, resolve_source

    given = tracking_uri is not None
    tracking_uri = _store(tracking_uri)
    bad = _unknown_scheme(tracking_uri, given, name="--tracking-uri")
    if bad:  # MLflow's own error for it is about its model registry
        return _fail(bad)
    try:
        wandb = "://" not in resolve_source(tracking_uri)
        default = os.environ.get("WANDB_PROJECT" if wandb else "MLFLOW_EXPERIMENT_NAME")
        named = experiment is not None  # --experiment given: look there only
        experiment = experiment or default or "hdet"
        reader = open_reader(tracking_uri)
        scope: str | None = experiment  # where the runs are looked for; None: every experiment (project)
        if not wandb and experiment not in (experiments := reader.experiments()):
            if named or group is None:
                return _fail(_no_experiment(experiment, named, tracking_uri, experiments))
            scope = None  # --group alone: the group may be anywhere (an attached HF/Lightning run is in "Default")
        if group is None:  # the newest run's group
            newest = reader.list_runs(scope)
            group = next((r.compare_group for r in newest if r.compare_group), None)
        if group is not None and not named:
            scope = None  # a group spans experiments: runs HDET attached to (Hugging Face's, Lightning's) are in theirs
        chosen = reader.list_runs(scope, compare_group=group, limit=None if group else 1000)
        if not chosen:
            return _fail(_no_runs(reader, wandb, tracking_uri, experiment, named, scope, group))
    except ReaderError as exc:
        return _fail(str(exc))
    except Exception as exc:  # noqa: BLE001 - MLflow's or SQLAlchemy's own errors: name the argument
        return _fail(
            f"cannot read --tracking-uri {tracking_uri!r} (expected an MLflow tracking URI such as "
            f"sqlite:///PATH or http://HOST:PORT, or a W&B directory): {type(exc).__name__}: {exc}"
        )
    runs, unreadable = [], []
    for summary in reversed(chosen):  # oldest first
        try:  # every row at full resolution: a run read as an overview has bucket means, not its last values
            runs.append(reader.read(summary.run_id, max_rows=sys.maxsize))
        except Exception as exc:  # noqa: BLE001 - one run's damage: the others' rows still come
            unreadable.append(f"run {summary.name or summary.run_id} ({summary.run_id}): {type(exc).__name__}: {exc}")
    if runs:
        print(format_rows(comparison_rows(runs), fmt))
    for run in runs:
        for warning in run.warnings:
            print(f"hdet-track compare: run {run.name or run.run_id}: {warning}", file=sys.stderr)
    for line in unreadable:
        print(f"hdet-track compare: cannot read {line}; left out of the table", file=sys.stderr)
    return 2 if unreadable else 0


def _choices(values) -> str:
    """``'a', 'b', 'c'`` (the first 20, then how many more)."""
    values = sorted(values)
    shown = ", ".join(repr(v) for v in values[:20])
    return shown + (f" and {len(values) - 20} more" if len(values) > 20 else "")


def _experiment_arg(named: bool, wandb: bool) -> str:
    if named:
        return "--experiment"
    return f"--experiment (default: ${'WANDB_PROJECT' if wandb else 'MLFLOW_EXPERIMENT_NAME'}, else hdet)"


def _no_experiment(experiment: str, named: bool, uri: str, experiments: list[str]) -> str:
    """compare's error for an MLflow experiment that does not exist."""
    allowed = f"expected one of {_choices(experiments)}" if experiments else "it has no experiments"
    return f"{_experiment_arg(named, False)} {experiment!r}: no experiment of that name at {uri}; {allowed}"


def _no_runs(reader, wandb: bool, uri: str, experiment: str, named: bool, scope: str | None, group: str | None) -> str:
    """compare's error when nothing matched: the argument and value that found nothing, and what exists."""
    kind = "W&B project" if wandb else "experiment"
    where = f" in {uri} (read as a W&B directory: it holds no mlflow.db)" if wandb else f" at {uri}"
    if group is not None:
        inside = f"{kind} {experiment!r}" + ("" if scope is not None else f" or any other {kind}")
        groups = {r.compare_group for r in reader.list_runs(scope, limit=None) if r.compare_group}
        allowed = f"expected one of {_choices(groups)}" if groups else "no run there has a compare group"
        return f"--group {group!r}: no runs with that compare group in {inside}{where}; {allowed}"
    everywhere = reader.list_runs(None, limit=None)
    if not everywhere:  # not the experiment's fault: the store holds no run at all
        return f"--tracking-uri {uri!r}: no runs{where}; expected a store (or W&B directory) a job has logged to"
    others = {r.experiment for r in everywhere if r.experiment} - {experiment}
    if others:
        allowed = f"expected one of the {kind}s with runs: {_choices(others)}"
    else:
        allowed = "it holds no W&B runs" if wandb else "no experiment there has runs"
    return f"{_experiment_arg(named, wandb)} {experiment!r}: no runs in {kind} {experiment!r}{where}; {allowed}"


_FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP")
STOP_SECONDS = 10.0  # how long the dashboard's Streamlit child gets to stop after a forwarded signal


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the child gets SIGTERM when this process dies, even by SIGKILL (best effort elsewhere)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _run_child(cmd: list[str], env: dict[str, str]) -> int:
    """Run ``cmd`` until it exits; SIGTERM, SIGINT and SIGHUP sent to this process are passed on to
    it and waited for (killed after ``STOP_SECONDS``), so that it never outlives the CLI holding
    its port. Returns its exit code; 0 after a Ctrl-C, 128 + the signal after another signal."""
    import signal
    import subprocess
    import time

    received: list[int] = []
    proc = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent if sys.platform == "linux" else None)

    def forward(signum: int, _frame) -> None:
        received.append(signum)
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {}
    for name in _FORWARDED:
        if hasattr(signal, name):
            signum = getattr(signal, name)
            previous[signum] = signal.signal(signum, forward)
    try:
        deadline = None
        while True:
            try:
                code = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if received and deadline is None:
                    deadline = time.monotonic() + STOP_SECONDS
                if deadline is not None and time.monotonic() > deadline:
                    proc.kill()
    finally:
        if proc.poll() is None:  # an error in this loop: never leave the child behind
            proc.kill()
            proc.wait()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if not received:
        return code
    return 0 if received[0] == signal.SIGINT else 128 + received[0]


def run_dashboard(source: str | None, host: str, port: int) -> int:
    """Start Streamlit on the packaged app and wait for it; returns its exit code. Signals that stop
    this process (SIGTERM, SIGINT, SIGHUP) stop Streamlit too, so the port is free again."""
    import os
    import socket
    from pathlib import Path

    from .readers import ReaderError, resolve_source
    from .readers.mlflow import StoreNotReady, check_store_exists, pending_store

    try:  # the host's own address family: an IPv6 address (::1) is bound as one
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except OSError:
        family = socket.AF_INET  # the bind below says why
    with socket.socket(family) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            import errno

            bad_host = isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL
            print(
                f"hdet-track dashboard: cannot listen on {host}:{port} ({exc.strerror}); "
                + ("--host must be an address of this machine, e.g. 127.0.0.1" if bad_host else "pick another --port"),
                file=sys.stderr,
            )
            return 2
    given = source is not None
    try:  # a directory holding mlflow.db, or a sqlite file: its sqlite:/// URI; a missing path: an error
        source = resolve_source(source)
    except ReaderError as exc:
        origin = "" if given else " (SOURCE from $HDET_DASHBOARD_SOURCE or $MLFLOW_TRACKING_URI)"
        print(f"hdet-track dashboard: {exc}{origin}", file=sys.stderr)
        return 2
    bad = _unknown_scheme(source, given)
    if bad:  # compare refuses it too (MLflow has no store for it): before a server starts on it
        print(f"hdet-track dashboard: {bad}", file=sys.stderr)
        return 2
    from .tracking.spill import check_store_uri

    try:  # a server's URI with no usable host or port: said before a server starts on it
        check_store_uri(source, "SOURCE" if given else "SOURCE (from $HDET_DASHBOARD_SOURCE or $MLFLOW_TRACKING_URI)")
    except ValueError as exc:
        print(f"hdet-track dashboard: {exc}", file=sys.stderr)
        return 2
    db = pending_store(source)
    if db is not None:  # read-only, and ready before the first job: the runs appear once a job creates it
        print(
            f"hdet-track dashboard: no store at {source} yet ({db.absolute()} does not exist); the dashboard "
            "waits for a job to log there and never creates it",
            file=sys.stderr,
        )
    else:
        try:
            check_store_exists(source)  # a sqlite file in a directory that does not exist: a typo
        except StoreNotReady as exc:  # a job is creating it: the page waits for it
            print(f"hdet-track dashboard: {exc}", file=sys.stderr)
        except ReaderError as exc:
            print(f"hdet-track dashboard: {exc}", file=sys.stderr)
            return 2
    import hdet_track.dashboard

    app = Path(hdet_track.dashboard.__file__).with_name("app.py")  # dashboard/ ships as hdet_track.dashboard
    env = dict(os.environ, HDET_DASHBOARD_SOURCE=source)
    cmd = [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(app),
        "--server.address",
        host,
        "--server.port",
        str(port),
        "--server.headless",
        "true",
        "--browser.gatherUsageStats",
        "false",
        "--server.fileWatcherType",
        "none",
        "--client.toolbarMode",
        "minimal",
    ]
    shown = f"[{host}]" if ":" in host else host  # an IPv6 address in a URL
    print(f"hdet-track dashboard on http://{shown}:{port} reading {source}", flush=True)
    return _run_child(cmd, env)


def _unknown_scheme(source: str, given: bool, spills: bool = False, name: str = "SOURCE") -> str | None:
    """Why ``source`` (SOURCE of dashboard and recover; ``given``: typed, else from the environment) is
    refused: a URI whose scheme is no store's (MLflow has none for it, so no job logged there), else None."""
    from .tracking.spill import unknown_scheme

    scheme = unknown_scheme(source)
    if scheme is None:
        return None
    what = name if given else f"the default {name} (from the environment)"
    paths = "a W&B directory, a directory holding mlflow.db, a sqlite file" + (
        ", a .hdet-spill directory" if spills else ""
    )
    return (
        f"{what} {source!r} has the URI scheme '{scheme}://', which is no MLflow store's; expected a path "
        f"({paths}) or an MLflow tracking URI (sqlite:///PATH, file:///PATH, http(s)://HOST:PORT, "
        "postgresql://, mysql://, mssql://, databricks://)"
    )


def run_recover(source: str | None) -> int:
    """Deliver every orphaned spill of ``source``; 1 when something could not be delivered yet (the
    backend is down: kept for a later try), 2 when ``source`` is no store (a malformed URI, a
    directory or a file that is no store) or when a spill cannot be delivered as it is (its header
    unreadable, its run deleted for good): it needs a person."""
    from pathlib import Path
    from urllib.parse import urlparse

    from .readers import ReaderError, resolve_source
    from .readers.mlflow import sqlite_file
    from .tracking.base import mask_secrets
    from .tracking.spill import Attention, check_store_uri, recover, spill_dirs, uri_scheme

    given = source is not None
    source = _store(source)
    shown = mask_secrets(source) or source
    bad = _unknown_scheme(source, given, spills=True)
    if bad:
        return _fail(f"recover: {bad}")
    try:
        check_store_uri(source, "SOURCE" if given else "the default SOURCE (from the environment)")
    except ValueError as exc:
        return _fail(f"recover: {exc}")
    if uri_scheme(source) is None and not Path(source).exists():
        return _fail(
            f"recover: {source} does not exist; expected an MLflow tracking URI, a W&B directory or a "
            ".hdet-spill directory"
        )
    if Path(source).is_file():  # a bare sqlite file: its sqlite:/// URI, as compare takes it
        try:
            source = resolve_source(source)
        except ReaderError as exc:
            return _fail(f"recover: {exc}")
    spills = any(d.exists() for d in spill_dirs(source))
    db = sqlite_file(source)
    if db is not None and db.is_dir():
        return _fail(
            f"recover: SOURCE {shown!r} names a directory ({db.absolute()}), not a sqlite file; expected "
            "sqlite:///PATH of the store's database file, or the directory itself as a path"
        )
    if db is not None and db.is_file() and db.stat().st_size:
        try:
            resolve_source(str(db))  # a file that is no sqlite database
        except ReaderError as exc:
            return _fail(f"recover: {exc}")
    if db is not None and not db.exists() and not spills:
        return _fail(f"recover: no MLflow store at {shown} ({db.absolute()} does not exist) and no spill beside it")
    if uri_scheme(source) == "file" and "://" in source and not Path(urlparse(source).path).is_dir() and not spills:
        return _fail(
            f"recover: no MLflow store at {shown} ({urlparse(source).path} is no directory) and no spill beside it"
        )
    try:
        lines = recover(source)
    except KeyboardInterrupt:  # a spill being delivered stays claimed until the next recover takes it back
        print(
            "\nhdet-track recover: interrupted; run it again to deliver the rest (a spill it was delivering is "
            "taken back, and its run goes on where it stopped)",
            file=sys.stderr,
        )
        return 130
    if not lines:
        looked = " and ".join(str(d) for d in spill_dirs(source))
        print(f"hdet-track recover: nothing to deliver for {shown} (looked in {looked})")
        return 0
    for line in lines:
        print(line)
    if any(isinstance(line, Attention) for line in lines):
        return 2
    return 1 if any(line.endswith("; kept") for line in lines) else 0


def main(argv: list[str] | None = None) -> int:
    import os

    # MLflow draws a progress bar per downloaded artifact; the readers fetch many small event chunks
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _dispatch(parser, args)
    except BrokenPipeError:
        try:
            sys.stdout.flush()
        except BrokenPipeError:  # `hdet-track compare ... | head`: the reader left; nothing more to say
            with contextlib.suppress(OSError, ValueError):  # Python's flush at exit must not fail again
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1  # as Python's own on EPIPE
        raise  # another pipe's (a worker's, a socket's): not the output's


def _empty_store(args: argparse.Namespace) -> str | None:
    """Why the SOURCE given is no store: an empty one (``recover "$STORE"`` with the variable unset)
    used to fall back to the default store, as if none were given (compare's option refuses it)."""
    value = args.source
    if value is None or value.strip():
        return None
    return (
        f"{args.command}: SOURCE is empty ({value!r}); expected an MLflow tracking URI (sqlite:///PATH, "
        "http(s)://HOST:PORT), a W&B directory or a store's directory; leave it out for the default "
        "($MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)"
    )


def _dispatch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    empty = _empty_store(args) if args.command in ("dashboard", "recover") else None
    if empty:
        return _fail(empty)
    if args.command == "demo":
        return run_demo(args.subparser, args)
    if args.command == "compare":
        return run_compare(args.tracking_uri, args.experiment, args.group, args.format)
    if args.command == "dashboard":
        return run_dashboard(args.source, args.host, args.port)
    if args.command == "recover":
        return run_recover(args.source)
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
