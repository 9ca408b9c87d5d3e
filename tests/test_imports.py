"""No import cycles in hdet_track (lazy imports inside functions count), checked from the source."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from .modgraph import cycles, edges, modules


def test_the_package_has_no_import_cycle():
    graph = edges()
    assert "hdet_track.scheduler" in graph["hdet_track.integrations.wrap"]  # the graph is read at all
    assert "hdet_track.compare" in graph["hdet_track.dashboard.app_pages.compare"]
    assert cycles(graph) == [], "import cycles (python -m tests.modgraph lists them)"


def test_the_checker_finds_lazy_relative_and_from_package_cycles(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import c  # lazy\n")
    (pkg / "c.py").write_text(
        "import pkg.sub.b\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import d\n"
    )
    (pkg / "d.py").write_text("from .c import x\n")
    mods = {
        "pkg": pkg / "__init__.py",
        "pkg.sub": pkg / "sub" / "__init__.py",
        "pkg.sub.b": pkg / "sub" / "b.py",
        "pkg.c": pkg / "c.py",
        "pkg.d": pkg / "d.py",
    }
    graph = edges(mods)
    assert graph["pkg"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.c"}
    assert graph["pkg.c"] == {"pkg.sub.b"}  # the TYPE_CHECKING import is not an edge
    assert graph["pkg.d"] == {"pkg.c"}
    assert cycles(graph) == [["pkg.c", "pkg.sub.b"]]
    assert set(modules()) >= {"hdet_track", "hdet_track.tracking.mlflow", "hdet_track.dashboard.app"}


# The architecture's one-way data flow (README, Layout): the math never imports a tracker, trackers
# never recompute the schedule and never import the UI, figures are pure functions of HDETRun.
MATH = {
    "schedule", "controller", "converge", "averager", "collectives", "fanout", "explore", "noise",
    "names", "record", "events", "checkpoint", "errors", "_checks", "window_record",
}  # fmt: skip
UI = {"streamlit", "plotly"}
TRACKERS = {"mlflow", "wandb"}


def third_party(path) -> set[str]:
    """Top-level names of the non-relative imports in ``path`` (lazy ones included)."""
    import ast

    from .modgraph import _imports

    out = set()
    for node in _imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out - {"hdet_track"}


def layer_violations(graph: dict[str, set[str]], imports: dict[str, set[str]]) -> list[str]:
    def short(m: str) -> str:
        return m.removeprefix("hdet_track.")

    bad = []
    for mod, targets in graph.items():
        name, deps = short(mod), {short(t) for t in targets}
        if name in MATH:
            bad += [f"{name} -> {d}" for d in deps if d not in MATH]
            bad += [f"{name} imports {p}" for p in imports[mod] & (UI | TRACKERS)]
        elif name.startswith("tracking"):
            bad += [f"{name} -> {d}" for d in deps if d in MATH - {"names", "record", "events", "errors", "_checks"}]
            bad += [f"{name} -> {d}" for d in deps if d.split(".")[0] in ("scheduler", "readers", "viz", "dashboard")]
            bad += [f"{name} imports {p}" for p in imports[mod] & UI]
        elif name.startswith("viz"):
            bad += [f"{name} -> {d}" for d in deps if d not in ("readers.base", "names") and not d.startswith("viz")]
            bad += [f"{name} imports {p}" for p in imports[mod] & ({"streamlit"} | TRACKERS)]
    return sorted(bad)


def test_the_layers_keep_the_data_flowing_one_way():
    mods = modules()
    graph = edges(mods)
    imports = {m: third_party(p) for m, p in mods.items()}
    assert "mlflow" in imports["hdet_track.tracking.mlflow"] and "plotly" in imports["hdet_track.viz.fanout"]
    assert layer_violations(graph, imports) == []
    # the rule itself catches each kind of violation
    graph["hdet_track.controller"].add("hdet_track.tracking.hub")
    graph["hdet_track.tracking.expand"].add("hdet_track.schedule")
    graph["hdet_track.viz.compare"].add("hdet_track.tracking.base")
    imports["hdet_track.averager"].add("wandb")
    imports["hdet_track.tracking.hub"].add("streamlit")
    assert layer_violations(graph, imports) == [
        "averager imports wandb",
        "controller -> tracking.hub",
        "tracking.expand -> schedule",
        "tracking.hub imports streamlit",
        "viz.compare -> tracking.base",
    ]


def _imported(code: str, cwd) -> list[str]:
    """Which of torch and mlflow a fresh interpreter has imported after running ``code``."""
    probe = code + "\nimport sys\nprint(sorted(m for m in ('torch', 'mlflow') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return eval(proc.stdout.strip().splitlines()[-1])  # noqa: S307 - our own probe's list of names


def test_reading_runs_does_not_import_torch_and_the_public_names_resolve(tmp_path):
    """compare, the readers and the MLflow writer process never use torch: importing them must not
    cost torch's import (seconds); the package's public names are resolved on first use."""
    readers = "import hdet_track, hdet_track.cli, hdet_track.compare, hdet_track.readers.mlflow"
    readers += ", hdet_track.readers.wandb, hdet_track.tracking.isolated, hdet_track.tracking.mlflow"
    assert "torch" not in _imported(readers, tmp_path)
    import hdet_track
    import hdet_track.scheduler

    assert hdet_track.HDETScheduler is hdet_track.scheduler.HDETScheduler
    script = "import hdet_track\nassert hdet_track.controller.DriftController is hdet_track.DriftController"
    assert "torch" in _imported(script, tmp_path)  # a submodule is an attribute, as before: loaded on use
    assert set(hdet_track.__all__) <= set(dir(hdet_track))
    assert all(getattr(hdet_track, name) is not None for name in hdet_track.__all__)
    try:
        hdet_track.HDETSchedular  # noqa: B018
    except AttributeError as exc:
        assert "'HDETSchedular'" in str(exc)
    else:
        raise AssertionError("an unknown name must raise AttributeError")


def test_a_training_process_tracked_to_mlflow_never_imports_mlflow(tmp_path):
    """MLflow's work happens in the writer process: the training process does not import MLflow
    (1-2 s of CPU and about 120 MB per rank), and the run is in the store all the same."""
    from hdet_track.readers.mlflow import MLflowReader

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    job = textwrap.dedent(f"""
        import torch
        from hdet_track import HDETScheduler
        from hdet_track.tracking.mlflow import MLflowTracker

        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = HDETScheduler(opt, 0.1, total_steps=12, sync_every=4, model=model,
                              track=MLflowTracker(tracking_uri={uri!r}, experiment="lean"))
        for _ in range(12):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step(); sched.step(loss)
        sched.close()
    """)
    assert _imported(job, tmp_path) == ["torch"]
    reader = MLflowReader(uri)
    (summary,) = reader.list_runs("lean")
    run = reader.read(summary.run_id)
    assert run.status == "FINISHED" and list(run.replica_series("lr", 0)[0]) == list(range(1, 13))
