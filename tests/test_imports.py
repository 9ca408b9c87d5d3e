"""No import cycles in hdet_track (lazy imports inside functions count), checked from the source."""

from __future__ import annotations

from .modgraph import cycles, edges, modules


def test_the_package_has_no_import_cycle():
    graph = edges()
    assert "hdet_track.scheduler" in graph["hdet_track"]  # the graph is read at all
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
    "names", "record", "events", "checkpoint", "errors", "_checks",
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
