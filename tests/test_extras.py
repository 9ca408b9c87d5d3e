"""Every extra declares what it imports: each is installed alone into a fresh virtual environment and
does what it promises there (``hdet-track compare`` with ``[mlflow]`` alone, a W&B offline run read
back with ``[wandb]`` alone, ...).

The fresh environment is built from the distributions this machine already has (the test's own
environment, set up by ``bin/setup`` with every extra), not from the registry, so it takes seconds
instead of minutes of pip: the project's requirements for that one extra are resolved from the
installed metadata (``Requires-Dist`` with its markers and extras, transitively), and exactly those
distributions are linked file by file (their ``RECORD``) into a new ``venv``'s site-packages, with
their console scripts. Anything the extra forgot to declare is simply not there; the last test
checks that on purpose.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
import sysconfig
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(sysconfig.get_paths()["purelib"])
PROJECT = "hdet-track"

# What each extra promises, as a script run in an environment holding the project and that extra only.
TRAIN = """
import torch
from hdet_track import HDETScheduler
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sched = HDETScheduler(opt, 0.1, total_steps=20, sync_every=5, track=TRACK)
for _ in range(20):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step(); sched.step(loss)
import time; ended = time.monotonic()
sched.close()
closed = time.monotonic()
"""
PROMISES = {
    "": TRAIN.replace("TRACK", "False")
    + "import hdet_track.compare, hdet_track.readers\n"
    + textwrap.dedent(
        """
        from hdet_track.tracking.mlflow import MLflowTracker
        try:  # no MLflow here: a clear error when the tracker is made, not at the first step
            MLflowTracker()
        except ImportError as exc:
            assert "pip install mlflow (or hdet-track's 'mlflow' extra: pip install -e '.[mlflow]'" in str(exc), exc
        else:
            raise AssertionError("MLflowTracker() without MLflow must raise ImportError")
        """
    ),
    "mlflow": TRAIN.replace("TRACK", "'mlflow'")
    + textwrap.dedent(
        """
        import subprocess, sys, os
        from pathlib import Path
        out = subprocess.run([str(Path(sys.executable).with_name('hdet-track')), 'compare',
                              '--tracking-uri', os.environ['MLFLOW_TRACKING_URI']],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert 'onecycle' in out.stdout and 'final train loss' in out.stdout, out.stdout
        """
    ),
    "wandb": TRAIN.replace("TRACK", "'wandb'")
    + textwrap.dedent(
        """
        import os
        from pathlib import Path
        from hdet_track.readers.wandb import WandbReader
        (run,) = WandbReader(os.environ['WANDB_DIR']).list_runs()
        files = {str(p): p.stat().st_size for p in Path(os.environ['WANDB_DIR'], 'wandb').rglob('*.wandb')}
        assert run.status == 'FINISHED', (run, files, f'close took {closed - ended:.1f} s')
        """
    ),
    "dashboard": "import streamlit, plotly\nimport hdet_track.viz, hdet_track.dashboard.state, hdet_track.readers.mlflow\n",
    "demo": "from hdet_track.examples.tasks import load_task\nassert load_task('digits').kind == 'image'\n"
    "import hdet_track.tracking.mlflow, hdet_track.cli\n",
    "lightning": "import hdet_track.integrations.lightning\n",
    "hf": "import hdet_track.integrations.transformers\n",
    "bench": "import matplotlib, schedulefree, prodigyopt, sklearn\nimport hdet_track.readers.mlflow\n",
}


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


INSTALLED = {_canon(d.metadata["Name"]): d for d in md.distributions(path=[str(SITE)])}


def closure(requirements: list[str], extra: str = "") -> list[md.Distribution]:
    """The installed distributions that ``requirements`` (as declared for ``extra``) pull in,
    transitively, following each requirement's markers and requested extras."""
    found: dict[str, md.Distribution] = {}
    todo = [(r, {extra}) for r in requirements]
    seen: set[tuple[str, frozenset]] = set()
    while todo:
        text, extras = todo.pop()
        req = Requirement(text)
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in extras or {""}):
            continue
        name = _canon(req.name)
        key = (name, frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        dist = INSTALLED.get(name)
        assert dist is not None, f"{req} is required but not installed here (run bin/setup)"
        assert req.specifier.contains(dist.version, prereleases=True), f"{req}: installed {dist.version}"
        found[name] = dist
        todo += [(r, set(req.extras) | {""}) for r in dist.requires or []]
    return list(found.values())


def _project() -> dict:
    """pyproject.toml's [project] table: the source, not a possibly stale install's metadata."""
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def project_requirements(extra: str) -> list[str]:
    """What pyproject.toml declares for the project with ``extra``."""
    project = _project()
    return list(project["dependencies"]) + (list(project["optional-dependencies"][extra]) if extra else [])


def extra_closure(extra: str) -> list[md.Distribution]:
    """The project (its editable install) with ``extra``, or alone, and everything that pulls in."""
    return [INSTALLED[PROJECT], *closure(project_requirements(extra))]


def make_env(dists: list[md.Distribution], env_dir: Path) -> Path:
    """A fresh venv (no pip) holding exactly ``dists``: their files linked from this environment,
    their console scripts written for the new interpreter. Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    for dist in dists:
        assert dist.files is not None, f"{dist.metadata['Name']} has no RECORD"
        for rel in dist.files:
            src = (SITE / rel).resolve() if not Path(rel).is_absolute() else Path(rel)
            if ".." in Path(rel).parts or not src.is_file():
                continue  # scripts: written below
            # byte code too: its header records the source's mtime and size, which a link keeps
            dst = site / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if not dst.exists():
                dst.symlink_to(src)
        for ep in dist.entry_points.select(group="console_scripts"):
            module, _, attr = ep.value.partition(":")
            script = env_dir / "bin" / ep.name
            script.write_text(f"#!{python}\nimport sys\nfrom {module} import {attr}\nsys.exit({attr}())\n")
            script.chmod(0o755)
    return python


def _promise(extra: str, work: Path) -> str:
    python = make_env(extra_closure(extra), work / "venv")
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "MLFLOW_", "WANDB_", "VIRTUAL_ENV", "HDET_"))
    }
    env.update(
        MLFLOW_TRACKING_URI=f"sqlite:///{work / 'store.db'}",
        WANDB_DIR=str(work),
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        HOME=str(work),
        PATH=f"{python.parent}:{os.environ.get('PATH', '')}",
    )
    script = work / "promise.py"
    script.write_text(PROMISES[extra])
    proc = subprocess.run([str(python), str(script)], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"[{extra}]:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return extra


def test_each_extra_alone_delivers_what_it_promises(tmp_path):
    assert set(PROMISES) - {""} == set(_project()["optional-dependencies"]) - {"dev", "all"}, (
        "every extra needs a promise here"
    )
    extras = sorted(PROMISES)
    for e in extras:
        (tmp_path / (e or "core")).mkdir()
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(lambda e: _promise(e, tmp_path / (e or "core")), extras))
    assert done == extras


def test_an_extra_s_environment_holds_its_closure_and_nothing_else():
    core = {_canon(d.metadata["Name"]) for d in extra_closure("")}
    assert {"hdet-track", "torch", "numpy"} <= core
    assert not core & {"mlflow", "wandb", "streamlit", "plotly", "pyarrow", "lightning", "transformers"}
    with_mlflow = {_canon(d.metadata["Name"]) for d in extra_closure("mlflow")}
    assert {"mlflow", "pyarrow", "sqlalchemy"} <= with_mlflow and "streamlit" not in with_mlflow
    assert "plotly" not in with_mlflow  # hdet-track compare must work without it (issue #12)


def test_an_undeclared_import_fails_in_its_environment(tmp_path):
    """The check can fail: an environment built for requirements that leave pyarrow out cannot
    import it, although this test's own environment can."""
    import pyarrow  # noqa: F401

    python = make_env(closure(["numpy"]), tmp_path / "venv")
    ok = subprocess.run([str(python), "-c", "import numpy"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    missing = subprocess.run([str(python), "-c", "import pyarrow"], capture_output=True, text=True)
    assert missing.returncode != 0 and "No module named 'pyarrow'" in missing.stderr


def test_project_requirements_follow_the_requested_extra():
    reqs = project_requirements("wandb")
    assert any(r.startswith("wandb") for r in reqs) and not any(r.startswith("mlflow") for r in reqs)
    assert any(r.startswith("torch") for r in reqs)  # the core comes with every extra
