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
