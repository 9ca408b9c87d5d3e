"""The ``hdet-track`` command line."""

from __future__ import annotations

import argparse
import sys

from . import __version__


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _spread(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hdet-track", description="Hyperparameter-Divergent Ensemble Training")
    parser.add_argument("--version", action="version", version=f"hdet-track {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="train an MLP on scikit-learn's digits with N local gloo replicas and print each replica's LR and loss",
    )
    demo.add_argument("--replicas", type=_positive_int, default=4, help="number of gloo processes (default 4)")
    demo.add_argument("--steps", type=_positive_int, default=300, help="optimizer steps (default 300)")
    demo.add_argument("--sync-every", type=_positive_int, default=25, help="steps between averagings (default 25)")
    demo.add_argument("--spread", type=_spread, default=0.3, help="LR spread alpha in [0, 1) (default 0.3)")
    demo.add_argument("--max-lr", type=float, default=0.2, help="OneCycle max_lr (default 0.2)")
    demo.add_argument("--no-auto-lr", action="store_true", help="fan-out and converge only, no controller")
    demo.add_argument("--seed", type=int, default=0)
    dash = sub.add_parser(
        "dashboard",
        help="open the Streamlit dashboard on an MLflow tracking URI or a W&B directory (read-only)",
    )
    dash.add_argument(
        "source",
        nargs="?",
        default=None,
        help="MLflow tracking URI (sqlite:///mlflow.db, http://127.0.0.1:5000) or a W&B directory; "
        "default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db",
    )
    dash.add_argument("--port", type=_port, default=8501, help="port (default 8501)")
    dash.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    return parser


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 1..65535, got {value}")
    return value


def run_dashboard(source: str | None, host: str, port: int) -> int:
    """Start Streamlit on the packaged app; returns its exit code."""
    import os
    import socket
    import subprocess
    from pathlib import Path

    from .readers import default_source

    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            print(
                f"hdet-track dashboard: cannot listen on {host}:{port} ({exc.strerror}); pick another with --port",
                file=sys.stderr,
            )
            return 2
    source = source or default_source()
    if "://" not in source and not Path(source).exists():
        print(f"hdet-track dashboard: {source} is neither a tracking URI nor an existing directory", file=sys.stderr)
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
    print(f"hdet-track dashboard on http://{host}:{port} reading {source}", flush=True)
    try:
        return subprocess.call(cmd, env=env)
    except KeyboardInterrupt:
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .examples.digits import DigitsConfig, launch

        if args.steps < args.sync_every:
            parser.error(f"--steps ({args.steps}) must be at least --sync-every ({args.sync_every})")
        cfg = DigitsConfig(
            steps=args.steps,
            sync_every=args.sync_every,
            spread=args.spread,
            max_lr=args.max_lr,
            auto_lr=not args.no_auto_lr,
            auto_lr_warmup=args.steps // 4,
            seed=args.seed,
        )
        launch(cfg, replicas=args.replicas)
        return 0
    if args.command == "dashboard":
        return run_dashboard(args.source, args.host, args.port)
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
