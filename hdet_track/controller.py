"""What decides the next learning rate: the auto-LR controllers.

At each sync the scheduler gathers every replica's per-step training losses and hands them, as a
:class:`WindowStats`, to a controller, which

1. judges the replicas' health (:meth:`Controller.health`): who is left out of the average and
   reset, and whether the consensus itself blew up (roll back);
2. updates the shared base of every explored hyperparameter (:meth:`Controller.update`);
3. gives the base of each target for any step (:meth:`Controller.base`), from a *reference*: plain
   OneCycleLR's LR for the learning rate, the initial value for other hyperparameters.

Two controllers:

- :class:`PaperController` (``controller="paper"``): the method as published. After
  ``auto_lr_warmup`` steps the base LR is taken over from OneCycle and held between syncs; at each
  sync replicas are weighted by ``softmax((mean(L) - L_r) / temperature)`` and the base moves to
  ``base * (1 - gamma) + meta_lr * velocity`` toward the better replicas' values.
- :class:`DriftController` (``controller="drift"``): the base is the reference times a drift that
  moves in log space, ``base = reference * exp(d)``, so the schedule keeps OneCycle's shape and
  nothing jumps when the controller starts. The drift moves on *evidence*: the slope of the
  replicas' window losses against their log multipliers, in units of its standard error (from the
  per-step losses inside the window), accumulated over syncs with forgetting. A guard leaves out
  replicas whose window loss blew up, cuts the drift when the highest-LR replicas did, and rolls
  every replica back to the last good consensus when all of them did. See docs/controller.md.

Pure math on numbers: nothing here imports torch.distributed or a tracker.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ._checks import check_bool, check_int, check_number, plain
from .record import ControllerUpdate, GuardAction
from .schedule import decay_gamma

logger = logging.getLogger(__name__)
STORM_SYNCS = 5  # the guard acting at this many syncs in a row earns one warning

__all__ = [
    "softmax_weights",
    "controller_update",
    "ControllerUpdate",
    "ControllerContext",
    "WindowStats",
    "Health",
    "Decision",
    "Controller",
    "PaperController",
    "DriftController",
    "window_noise",
    "trend_evidence",
    "blowup_health",
    "step_guard_reason",
    "window_start",
    "BlowupGuard",
    "Evidence",
    "Backoffs",
    "Ceiling",
    "make_controller",
    "CONTROLLERS",
]


# ---------------------------------------------------------------------- the paper's rule, pure functions
def softmax_weights(losses: Sequence[float], temperature: float) -> list[float]:
    """Weights of the replicas from their window losses: ``softmax((mean(L) - L_r) / temperature)``.

    Lower loss, higher weight. Subtracting the mean (and the max inside the softmax)
    changes nothing mathematically but keeps ``exp`` in range.

    Example:
        >>> softmax_weights([1.0, 1.0], 0.1)
        [0.5, 0.5]
    """
    if temperature <= 0:
        raise ValueError(f"Expected temperature > 0, but got {temperature!r}")
    if not losses:
        raise ValueError("Expected at least one loss, but got none")
    mean = math.fsum(losses) / len(losses)
    scores = [(mean - loss) / temperature for loss in losses]
    top = max(scores)
    exps = [math.exp(s - top) for s in scores]
    total = math.fsum(exps)
    return [e / total for e in exps]


def controller_update(
    values: Sequence[float],
    weights: Sequence[float],
    base: float,
    velocity: float,
    *,
    meta_lr: float,
    meta_momentum: float,
    gamma: float,
    bounds: tuple[float, float],
) -> ControllerUpdate:
    """The paper's update of one target: move ``base`` toward the values of the better replicas.

    ``delta = sum_r w_r * v_r - mean(v)``, ``velocity' = beta * velocity + (1 - beta) * delta``,
    ``base' = clip(base * (1 - gamma) + meta_lr * velocity', bounds)``.
    """
    if len(values) != len(weights) or not values:
        raise ValueError(f"Expected as many values as weights (at least one), but got {len(values)} and {len(weights)}")
    mean = math.fsum(values) / len(values)
    delta = math.fsum(w * v for w, v in zip(weights, values)) - mean
    new_velocity = meta_momentum * velocity + (1.0 - meta_momentum) * delta
    raw = base * (1.0 - gamma) + meta_lr * new_velocity
    low, high = bounds
    after = min(max(raw, low), high)
    return ControllerUpdate(delta, new_velocity, base, after, gamma, after != raw)


# ---------------------------------------------------------------------- what a controller sees
@dataclass(frozen=True)
class ControllerContext:
    """The job's facts a controller needs, given once (and again after ``wrap``/resume)."""

    names: list[str]  # "lr" first
    num_targets: dict[str, int]
    multipliers: dict[str, list[float]]  # rho by multiplier index
    bounds: dict[str, list[tuple[float, float]]]  # per target; for "lr" the resolved lr_bounds
    lr_bounds_given: bool
    world_size: int
    total_steps: int
    sync_every: int
    start_step: int
    div_factor: float
    final_div_factor: float


@dataclass(frozen=True)
class WindowStats:
    """One sync's evidence, identical on every rank.

    ``losses[r, i]``: replica r's loss at the window's i-th step (nan where none was given);
    ``counts[r]``/``sums[r]``: how many losses replica r gave and their float64 sum; ``finite[r]``:
    whether its parameters are finite; ``perms[name][r]``: its multiplier index during the window;
    ``values[name][r][t]``: its value of target t at the sync; ``references[name][t]``: the
    reference of target t at the sync; ``peaks[name][t]``: the highest reference of target t from
    this step to the end (OneCycle's max_lr during its ramp-up; None: the references themselves).
    """

    step: int
    losses: np.ndarray
    counts: list[int]
    sums: list[float]
    finite: list[bool]
    perms: dict[str, list[int]]
    values: dict[str, list[list[float]]]
    references: dict[str, list[float]]
    peaks: dict[str, list[float]] | None = None
    tripped: list[bool] | None = None  # replicas the local step guard reset during the window

    @property
    def window_losses(self) -> list[float]:
        return [s / c if c > 0 else math.nan for s, c in zip(self.sums, self.counts)]


@dataclass(frozen=True)
class Health:
    """Who takes part in the average (``healthy``), why the others do not, and whether to roll back."""

    healthy: list[bool]
    reasons: list[str]  # "" for healthy replicas
    rollback: bool = False


@dataclass(frozen=True)
class Decision:
    """A controller's output at one sync."""

    weights: list[float] | None = None
    updates: dict[str, list[ControllerUpdate]] = field(default_factory=dict)
    guard: list[GuardAction] = field(default_factory=list)


def nonfinite_health(stats: WindowStats) -> Health:
    """The basic rule: a replica with non-finite parameters or a non-finite window loss is left out."""
    healthy, reasons = [], []
    for finite, loss, count in zip(stats.finite, stats.window_losses, stats.counts):
        ok = finite and (count == 0 or math.isfinite(loss))
        healthy.append(ok)
        reasons.append("" if ok else "non-finite")
    return Health(healthy, reasons)


class Controller:
    """Base class: no updates, the basic health rule, the reference as base."""

    name = ""
    rollback = False  # whether the scheduler keeps the last good consensus for it
    rollbacks = 0  # consecutive rollbacks so far
    max_rollbacks = 0

    def bind(self, ctx: ControllerContext) -> None:
        self.ctx = ctx

    def health(self, stats: WindowStats) -> Health:
        return nonfinite_health(stats)

    def update(self, stats: WindowStats, health: Health) -> Decision:
        return Decision()

    step_guard: float | None = None  # when set, the scheduler gathers every step's losses for check_step
    step_guard_scope = "all"  # "local": each replica checks its own loss (check_own_step), no collective

    def resolve_scope(self, shared_gradients: bool) -> None:
        """``step_guard_scope="auto"``: the scheduler tells, once, whether the ranks' gradients are
        shared (DDP); the controller picks its step guard's scope from that: the collective check
        for shared gradients, the local one for independent replicas (only with ``rollback``: a
        replica resets itself to the kept consensus)."""
        if self.step_guard_scope == "auto":
            self.step_guard_scope = "local" if not shared_gradients and self.rollback else "all"

    def rolled_back(self, stats: WindowStats, reason: str | None = None) -> Decision:
        """Called instead of :meth:`update` when :meth:`health` (or :meth:`check_step`) asked for a rollback."""
        return Decision()

    def check_step(self, losses: Sequence[float], firsts: Sequence[float]) -> str | None:
        """Between syncs, with ``step_guard`` set: the replicas' losses at this step and at the
        window's first step; a reason to roll back now, or None."""
        return None

    def check_own_step(self, loss: float, first: float) -> str | None:
        """``step_guard_scope="local"``: this replica's loss at this step and at the window's first
        step; a reason to reset this replica now, or None (by default :meth:`check_step`'s rule
        applied to this replica alone)."""
        return self.check_step([loss], [first])

    def base(self, name: str, target: int, reference: float) -> float:
        return reference

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def settings(self) -> dict:
        """The constructor's arguments, as given (a checkpoint keeps them: a job resumes exactly only
        with the same ones)."""
        return plain(dict(getattr(self, "_settings", {})))  # NumPy scalars as numbers: weights_only=True


# ---------------------------------------------------------------------- the paper's controller
class PaperController(Controller):
    """The published controller, kept exactly for reproduction (see the module docstring).

    Args:
        warmup: steps of plain OneCycle before it starts; afterwards the LR is held between syncs.
        temperature: of the softmax over ``(mean(L) - L_r)``, in loss units.
        meta_lr: step size of the base update.
        meta_momentum: beta of the velocity.
    """

    name = "paper"

    def __init__(self, warmup: int = 0, temperature: float = 0.1, meta_lr: float = 0.5, meta_momentum: float = 0.9):
        self._settings = {
            "warmup": warmup,
            "temperature": temperature,
            "meta_lr": meta_lr,
            "meta_momentum": meta_momentum,
        }
        self.warmup = warmup
        self.temperature = temperature
        self.meta_lr = meta_lr
        self.meta_momentum = meta_momentum
        self._base: dict[str, list[float] | None] = {}
        self._velocity: dict[str, list[float]] = {}
        self.gamma: dict[str, float] = {}

    def bind(self, ctx: ControllerContext) -> None:
        super().bind(ctx)
        for name in ctx.names:
            self._base.setdefault(name, None)
            self._velocity.setdefault(name, [0.0] * ctx.num_targets[name])
        # The base decays by div_factor / final_div_factor over the syncs left once it takes over.
        first = max(self.warmup, ctx.start_step)
        self.gamma = {name: 0.0 for name in ctx.names}
        self.gamma["lr"] = decay_gamma(ctx.div_factor, ctx.final_div_factor, (ctx.total_steps - first) / ctx.sync_every)

    def update(self, stats: WindowStats, health: Health) -> Decision:
        ok = [r for r, h in enumerate(health.healthy) if h]
        losses = stats.window_losses
        if stats.step < self.warmup or not all(stats.counts[r] > 0 for r in ok):
            return Decision()
        w_ok = softmax_weights([losses[r] for r in ok], self.temperature)
        weights = [0.0] * len(losses)
        for r, w in zip(ok, w_ok):
            weights[r] = w
        updates = {}
        for name in self.ctx.names:
            refs = stats.references[name]
            base = [self.base(name, t, refs[t]) for t in range(len(refs))]
            results = [
                controller_update(
                    [stats.values[name][r][t] for r in ok],
                    w_ok,
                    base[t],
                    self._velocity[name][t],
                    meta_lr=self.meta_lr,
                    meta_momentum=self.meta_momentum,
                    gamma=self.gamma[name],
                    bounds=self.ctx.bounds[name][t],
                )._replace(reference=refs[t])
                for t in range(len(base))
            ]
            updates[name] = results
            self._base[name] = [u.base_after for u in results]
            self._velocity[name] = [u.velocity for u in results]
        return Decision(weights, updates)

    def base(self, name: str, target: int, reference: float) -> float:
        held = self._base.get(name)
        return reference if held is None else held[target]

    def state_dict(self) -> dict:
        # gamma too: it was bound to the step the controller started at (a job that took over a
        # schedule part-way), which a scheduler built to resume does not know
        return {"base": dict(self._base), "velocity": dict(self._velocity), "gamma": dict(self.gamma)}

    def load_state_dict(self, state: dict) -> None:
        self._base = {k: None if v is None else [float(x) for x in v] for k, v in state["base"].items()}
        self._velocity = {k: [float(x) for x in v] for k, v in state["velocity"].items()}
        if "gamma" in state:  # a checkpoint of an earlier version: the gamma bound here
            self.gamma = {k: float(v) for k, v in state["gamma"].items()}


# ---------------------------------------------------------------------- the drift controller
def window_noise(losses: np.ndarray) -> float:
    """The standard error of one replica's window-mean loss, from the per-step losses themselves.

    Each row's losses are detrended by a straight line (training moves the loss within a window);
    the residual variance is pooled over rows and inflated for lag-1 autocorrelation (AR(1):
    ``(1 + rho) / (1 - rho)``, rho clipped to [0, 0.8]). nan when the rows have fewer than 3
    finite losses.
    """
    variances, lag1 = [], []
    for row in np.atleast_2d(losses):
        y = row[np.isfinite(row)]
        if len(y) < 3:
            continue
        i = np.arange(len(y), dtype=float)
        resid = y - np.polyval(np.polyfit(i, y, 1), i)
        var = float(resid @ resid) / (len(y) - 2)
        variances.append(var)
        denom = float(resid @ resid)
        lag1.append(float(resid[1:] @ resid[:-1]) / denom if denom > 0 else 0.0)
    if not variances:
        return math.nan
    rho = min(max(float(np.mean(lag1)), 0.0), 0.8)
    per_step = float(np.mean(variances))
    count = int(np.isfinite(np.atleast_2d(losses)).sum(axis=1).max())
    return math.sqrt(per_step / count * (1 + rho) / (1 - rho))


def trend_evidence(log_multipliers: Sequence[float], window_losses: Sequence[float], standard_error: float) -> float:
    """The slope of the window losses against the log multipliers, in units of its standard error.

    ``z = sum_r x_r m_r / (se * sqrt(sum_r x_r^2))`` with x centred. Positive: higher values did
    worse. 0 when the multipliers do not differ; clipped to [-10, 10]. Multiplying every loss by a
    constant leaves z unchanged.
    """
    x = np.asarray(log_multipliers, dtype=float)
    m = np.asarray(window_losses, dtype=float)
    x = x - x.mean()
    sxx = float(x @ x)
    if len(x) < 2 or sxx <= 0:
        return 0.0
    num = float(x @ (m - m.mean()))
    if not math.isfinite(standard_error):
        return 0.0  # too few losses per window to tell signal from noise
    if standard_error <= 0:
        return 0.0 if num == 0 else math.copysign(10.0, num)
    return max(-10.0, min(10.0, num / (standard_error * math.sqrt(sxx))))


def window_start(stats: WindowStats) -> float:
    """The window's starting loss: the median of the replicas' first finite losses (all taken at the
    common consensus); nan when no replica gave one."""
    firsts = [row[np.isfinite(row)][0] for row in stats.losses if np.isfinite(row).any()]
    return float(np.median(firsts)) if firsts else math.nan


def blowup_health(stats: WindowStats, guard: float, rollback: bool, floor: float = 0.0) -> Health:
    """The drift controller's sync guard: a replica is unhealthy when its window loss is non-finite,
    when the local step guard reset it in the window, or when it exceeds ``guard`` times the
    smaller of the window's starting loss (the median of the replicas' first losses, all taken at
    the common consensus) and the median window loss, and ``floor`` (a loss the run has left
    behind: see ``DriftController(guard_floor=)``). Every replica unhealthy: roll back (with
    ``rollback``)."""
    basic = nonfinite_health(stats)
    means = stats.window_losses
    start = window_start(stats)
    finite_means = [m for m, ok in zip(means, basic.healthy) if ok and math.isfinite(m)]
    typical = float(np.median([m for m in means if math.isfinite(m)])) if finite_means else math.nan
    ref = min(start, typical) if math.isfinite(start) and math.isfinite(typical) else math.nan
    healthy, reasons = list(basic.healthy), list(basic.reasons)
    for r, tripped in enumerate(stats.tripped or []):
        if tripped:  # also when its window holds the non-finite loss it tripped on: a blow-up, not noise
            healthy[r] = False
            reasons[r] = "blown up: the local step guard reset it in the window"
    if math.isfinite(ref) and ref > 0:
        for r, m in enumerate(means):
            if healthy[r] and math.isfinite(m) and m > guard * ref and m > floor:
                healthy[r] = False
                reasons[r] = f"blown up: window loss {m:.4g} > {guard:g} x {ref:.4g}"
    return Health(healthy, reasons, rollback and not any(healthy))


def step_guard_reason(
    losses: Sequence[float], firsts: Sequence[float], step_guard: float, floor: float = 0.0
) -> str | None:
    """The collective step guard: every replica's loss at this step (``losses``) and at the
    window's first step (``firsts``); why to converge and roll back now, or None. A finite loss
    at or below ``floor`` is never a blow-up."""
    bad = [r for r, x in enumerate(losses) if not math.isfinite(x)]
    if bad:
        return f"step guard: replicas {bad} non-finite"
    start = [x for x in firsts if math.isfinite(x)]
    ref = float(np.median(start)) if start else math.nan
    if not (math.isfinite(ref) and ref > 0):
        return None  # the ratio test needs positive losses
    # Each replica against the higher of its own first loss and the median: replicas that see
    # different data (shards of unequal difficulty) start the window at different losses from
    # the same consensus, and a replica is never blown up at the consensus itself.
    refs = [max(f, ref) if math.isfinite(f) else ref for f in firsts]
    high = [r for r, x in enumerate(losses) if x > step_guard * refs[r] and x > floor]
    if high:
        r = max(high, key=lambda q: losses[q] / refs[q])
        return f"step guard: replicas {high} at loss {losses[r]:.4g} > {step_guard:g} x {refs[r]:.4g}"
    return None


class BlowupGuard:
    """What the drift controller calls *blown up*, at a sync and at every step, and what it
    remembers for that: the run's starting loss (for ``floor``) and how many syncs in a row it
    acted (to warn once about a storm). Its ratio tests are loss-scale-free; see
    :class:`DriftController` for the meaning of ``ratio`` (``guard``), ``step_ratio``
    (``step_guard``) and ``floor`` (``guard_floor``)."""

    def __init__(self, ratio: float, step_ratio: float | None, floor: float | None) -> None:
        self.ratio, self.step_ratio, self.floor = ratio, step_ratio, floor
        self.start_loss = math.nan  # L0: the median first loss of the run's first window (floor)
        self._storm, self._warned = 0, False  # syncs in a row at which the guard acted; warned once

    def state_dict(self) -> dict:
        return {"start_loss": self.start_loss, "storm": [self._storm, self._warned]}

    def load_state_dict(self, state: dict) -> None:
        self.start_loss = float(state.get("start_loss", math.nan))
        storm, warned = state.get("storm", [0, False])
        self._storm, self._warned = int(storm), bool(warned)

    def health(self, stats: WindowStats, rollback: bool) -> Health:
        """The sync guard (:func:`blowup_health`) with this run's floor."""
        self.note_start(stats)
        return blowup_health(stats, self.ratio, rollback, self._floor(self.start_loss))

    def note_start(self, stats: WindowStats) -> None:
        """The run's starting loss, from the first window a sync sees."""
        if math.isnan(self.start_loss):
            self.start_loss = window_start(stats)

    def _floor(self, fallback: float) -> float:
        """The loss at or below which nothing is a blow-up: ``floor`` times the run's starting loss
        (``fallback`` before the first sync); 0 without ``floor`` or a positive start."""
        start = self.start_loss if math.isfinite(self.start_loss) else fallback
        if self.floor is None or not (math.isfinite(start) and start > 0):
            return 0.0
        return self.floor * start

    def check_step(self, losses: Sequence[float], firsts: Sequence[float]) -> str | None:
        """The collective step guard (:func:`step_guard_reason`) with this run's floor."""
        if self.step_ratio is None:
            return None
        start = [x for x in firsts if math.isfinite(x)]
        floor = self._floor(float(np.median(start)) if start else math.nan)
        return step_guard_reason(losses, firsts, self.step_ratio, floor)

    def check_own_step(self, loss: float, first: float) -> str | None:
        """The local step guard: this replica's loss at this step and at the window's first step."""
        if self.step_ratio is None:
            return None
        if not math.isfinite(loss):
            return "step guard (local): non-finite loss"
        if math.isfinite(first) and first > 0 and loss > self.step_ratio * first and loss > self._floor(first):
            return f"step guard (local): loss {loss:.4g} > {self.step_ratio:g} x {first:.4g}"
        return None

    def acted(self, step: int, acted: bool) -> None:
        """Count the syncs in a row at which the guard acted; warn once at ``STORM_SYNCS``: near
        zero training loss its ratio tests can read noise as blow-ups (docs/controller.md)."""
        self._storm = self._storm + 1 if acted else 0
        if self._storm == STORM_SYNCS and not self._warned:
            self._warned = True
            logger.warning(
                "DriftController: the guard left replicas out or cut the LR at %d syncs in a row (step %d). "
                "If the training loss is near zero (a small dataset learned by heart), its ratio tests may be "
                "reading noise as blow-ups: a higher guard_floor (default 0.5) ignores more of them "
                "(docs/controller.md, rounds 9-10).",
                STORM_SYNCS,
                step,
            )


@dataclass
class Reading:
    """What :meth:`Evidence.add` makes of one sync's window: the accumulated evidence, the signed
    fractions of a full step to move, and (``revert_unconfirmed``) whether this window's move is
    provisional or the provisional moves before it are taken back."""

    evidence: float
    fractions: list[float]
    provisional: bool = False
    revert: bool = False


class Evidence:
    """What the windows say, accumulated per explored hyperparameter, and how far it moves the
    drift (see :class:`DriftController` for ``forget``, ``dead_zone``, ``full_step_at`` and
    ``skip_windows``). Each sync's slope ``z`` (standard errors) enters ``S <- forget * S + z``,
    ``V <- forget^2 * V + 1``; ``Z = S / sqrt(V)`` stays standard normal under pure noise."""

    def __init__(
        self,
        forget: float,
        dead_zone: float,
        full_step_at: float,
        skip_windows: int,
        confirm_skipped: bool = False,
        revert_unconfirmed: bool = False,
    ) -> None:
        inf = math.inf
        self.forget = check_number("forget", forget, 0.0, 1.0, low_open=False, high_open=True)
        self.dead_zone = check_number("dead_zone", dead_zone, 0.0, inf, low_open=False, high_open=True)
        self.full_step_at = check_number(
            "full_step_at", full_step_at, self.dead_zone, inf, low_open=True, high_open=True
        )
        self.skip_windows = check_int("skip_windows", skip_windows, 0)
        self.confirm_skipped = bool(confirm_skipped)
        self.revert_unconfirmed = bool(revert_unconfirmed)
        if self.confirm_skipped and self.revert_unconfirmed:
            raise ValueError(
                "Expected at most one of confirm_skipped and revert_unconfirmed (hold the skipped windows' "
                "evidence, or move on it and take it back), but got both True"
            )
        self.sums: dict[str, list[float]] = {}  # per name: [accumulated sum S, its variance V]
        self.held: dict[str, list[float]] = {}  # per name: the skipped windows' z, awaiting confirmation

    def add(self, name: str, z: float, step: int, sync_every: int, keep: bool = False) -> Reading:
        """Add a sync's ``z``; the :class:`Reading` says the accumulated ``Z``, the signed fractions
        of a full step the drift moves at this sync (:meth:`move`: this window's, after any held
        ones'), and whether earlier moves are provisional or taken back.

        The windows ending at or before ``skip_windows * sync_every`` (the initial transient) add
        nothing. With ``confirm_skipped`` their ``z`` are held instead: if the next window's own
        ``z`` passes the dead zone in the direction the held ones point, they are added first, in
        order, and their moves made now (up to ``skip_windows + 1`` full steps at that sync);
        otherwise they are dropped. With ``revert_unconfirmed`` they are used at once, as without
        skipping, but provisionally: unless the next window confirms them the same way, they are
        taken back (``revert``: the caller undoes their moves; the evidence restarts from that
        window, where ``skip_windows`` alone would stand). ``keep``: never taken back (the
        default's decisions; ``revert_unconfirmed="shared"`` with independent replicas)."""
        s, v = self.sums.setdefault(name, [0.0, 0.0])
        if step <= self.skip_windows * sync_every:
            if self.confirm_skipped or self.revert_unconfirmed:
                self.held.setdefault(name, []).append(float(z))  # judged by the next window
            if not self.revert_unconfirmed:
                return Reading(s / math.sqrt(v) if v > 0 else 0.0, [])
            s, v = self._accumulate(s, v, [z])  # and used now
            self.sums[name] = [s, v]
            return Reading(s / math.sqrt(v), [self.move(s / math.sqrt(v))], provisional=True)
        held = self.held.pop(name, [])
        pointed = self._accumulate(0.0, 0.0, held)[0]  # where the held windows point, from nothing
        confirmed = abs(z) >= self.dead_zone and pointed * z > 0
        revert = self.revert_unconfirmed and bool(held) and not confirmed and not keep
        if revert:
            s, v = 0.0, 0.0
        moves = []
        for h in (held if confirmed and not self.revert_unconfirmed else []) + [z]:
            s, v = self._accumulate(s, v, [h])
            moves.append(self.move(s / math.sqrt(v)))
        self.sums[name] = [s, v]
        return Reading(s / math.sqrt(v), moves, revert=revert)

    def _accumulate(self, s: float, v: float, zs: Sequence[float]) -> tuple[float, float]:
        for z in zs:
            s, v = self.forget * s + z, self.forget**2 * v + 1.0
        return s, v

    def move(self, evidence: float) -> float:
        """The signed fraction of a full step the drift moves on ``evidence``: against the slope,
        nothing inside the dead zone, a full step from ``full_step_at`` on."""
        excess = (abs(evidence) - self.dead_zone) / (self.full_step_at - self.dead_zone)
        return -math.copysign(min(max(excess, 0.0), 1.0), evidence)

    def drop_upward(self, name: str) -> None:
        """After a backoff: no evidence for a larger value carries over (a negative ``S``: larger
        values did better), nor any held window's. Before round 15 this kept the negative part
        instead, the opposite of what it was meant to do (docs/controller.md, round 15)."""
        self.sums[name][0] = max(self.sums[name][0], 0.0)
        self.held.pop(name, None)

    def reset(self) -> None:
        """After a rollback: the windows' evidence starts afresh."""
        for name in self.sums:
            self.sums[name] = [0.0, 0.0]
        self.held.clear()


class Backoffs:
    """How far the LR drift goes down when the guard acts: a *backoff* at a sync where replicas
    blew up, a *rollback* when the consensus did. ``x`` below are the replicas' log multipliers.

    Args:
        min_backoff: a rollback cuts the LR drift by at least this factor (and by the ratio of the
            highest to the lowest multiplier when that is larger).
        trip_backoff: the cut at the sync after the local step guard reset a replica (the healthy
            replicas keep their window either way): ``"ramp"`` (the default since round 8) when
            the reset replicas had the highest LR, by one notch plus the ramp-up still ahead (the
            log of OneCycle's peak ahead over its LR at the sync), so that the top multiplier at
            the peak runs at most at the highest LR a healthy replica just used (as far as
            ``max_drift`` and the LR bounds let the drift go), and one notch after the peak;
            ``"spread"``: a rollback's cut, whichever replica tripped; ``"notch"``: as for any
            blown-up replica, one notch when the reset replicas had the highest LR
            (docs/controller.md, rounds 4, 6 and 8 compare them).
        edge_backoff: ``"all"`` (or True): at every backoff in which a replica above every
            healthy one blew up (sync guard or local step guard) and at every rollback, cut at
            least so far that the base at OneCycle's peak ahead is half the LR the highest
            blown-up replica used at the sync (the quadratic model's best step is half its
            stability edge); the cuts above stay where they are larger (docs/controller.md, round
            12). ``"sync"``: the same, counting only the replicas the sync guard found blown up
            (a local trip's cut keeps ``trip_backoff``'s rule; the default since round 14). ``"off"``
            (or False): the notch and ``trip_backoff``'s rules only.

    A *notch* is how far the highest blown-up replica's log multiplier is above every healthy one's.
    """

    def __init__(self, min_backoff: float, trip_backoff: str, edge_backoff: bool | str) -> None:
        self.min_backoff = check_number("min_backoff", min_backoff, 1.0, math.inf, low_open=True, high_open=True)
        if trip_backoff not in ("notch", "spread", "ramp"):
            raise ValueError(f"Expected trip_backoff in ('notch', 'spread', 'ramp'), but got {trip_backoff!r}")
        self.trip_backoff = trip_backoff
        edge = ("all" if edge_backoff else "off") if isinstance(edge_backoff, (bool, np.bool_)) else edge_backoff
        if edge not in ("off", "sync", "all"):
            raise ValueError(f"Expected edge_backoff in ('off', 'sync', 'all') or a bool, but got {edge_backoff!r}")
        self.edge_backoff = edge

    def at_sync(
        self, x: list[float], ok: list[int], blown: list[int], stats: WindowStats
    ) -> tuple[float, list[int], str]:
        """The cut when the replicas ``blown`` blew up and ``ok`` are healthy: one notch (0 when no
        blown-up replica is above every healthy one), then ``trip_backoff``'s and ``edge_backoff``'s
        rules. Returns (cut, the replicas it names, why)."""
        top_ok = max(x[r] for r in ok)
        cut, why = max(0.0, max(x[r] for r in blown) - top_ok), "with the highest LR blew up"
        tripped = [r for r in blown if stats.tripped and stats.tripped[r]]
        named = blown
        if tripped and self.trip_backoff == "spread":
            cut, named, why = self.spread(x), tripped, "tripped the local step guard"
        elif tripped and self.trip_backoff == "ramp" and max(x[r] for r in tripped) > top_ok:
            # only a trip of a replica above every healthy one adds the ramp-up ahead
            ramp = max(x[r] for r in tripped) - top_ok + self.ramp_ahead(stats)
            cut, why = max(cut, ramp), "blew up or tripped the local step guard"
        edged = [x[r] for r in blown if self.edge_backoff == "all" or r not in tripped]
        x_edge = max(edged, default=-math.inf)
        edge = self.edge(x_edge, stats) if x_edge > top_ok else -math.inf
        if edge > cut:
            cut, why = edge, why + "; the peak's base cut to half its LR"
        return cut, named, why

    def at_rollback(self, x: list[float], stats: WindowStats) -> float:
        """The cut at a rollback: the spread's, or the edge's when that is larger."""
        return max(self.spread(x), self.edge(max(x), stats))

    def spread(self, x: list[float]) -> float:
        """The multipliers' log range, at least ``min_backoff``."""
        return max(max(x) - min(x), math.log(self.min_backoff))

    def edge(self, x_top: float, stats: WindowStats) -> float:
        """``edge_backoff``: the cut that puts the base at OneCycle's peak ahead at half the LR of
        the replica with log multiplier ``x_top`` at the sync (-inf when off)."""
        return self.ramp_ahead(stats) + math.log(2.0) - x_top if self.edge_backoff != "off" else -math.inf

    @staticmethod
    def ramp_ahead(stats: WindowStats) -> float:
        """The log of OneCycle's highest LR from this sync to the end over its LR at the sync (the
        largest over param groups; 0 after the peak)."""
        refs, peaks = stats.references["lr"], (stats.peaks or stats.references)["lr"]
        return max([math.log(p / r) for r, p in zip(refs, peaks) if r > 0 and p > r], default=0.0)


class Ceiling:
    """``ceiling``: the highest value per target that healthy replicas have trained with, and the
    highest LR drift that keeps every later base within it (OneCycle's peak during the ramp-up):
    the base only goes where a replica has been. The values are recorded whether or not the rule
    is on."""

    def __init__(self, on: bool) -> None:
        self.on = bool(on)
        self.tested: dict[str, list[float]] = {}  # per name: the highest value a healthy replica used

    def limits(self, name: str, n: int, stats: WindowStats, ok: list[int]) -> list[float]:
        """Record what the healthy replicas ``ok`` used; the highest drift per target (``inf``
        where the rule does not apply)."""
        tested = self.tested.setdefault(name, [0.0] * n)
        for r in ok:
            for t in range(n):
                v = stats.values[name][r][t]
                if math.isfinite(v):
                    tested[t] = max(tested[t], v)
        if not (self.on and name == "lr"):
            return [math.inf] * n
        peaks = (stats.peaks or stats.references)[name]
        return [math.log(tested[t] / peaks[t]) if tested[t] > 0 and peaks[t] > 0 else -math.inf for t in range(n)]


class Drift:
    """Where the log drift of every explored hyperparameter stands, per target, and how it moves:
    within ``[1 / max_drift, max_drift]``, the hyperparameter's bounds (the LR's only when
    ``lr_bounds`` were given) and, upward only, a ceiling."""

    def __init__(self, max_drift: float) -> None:
        self.max_drift = check_number("max_drift", max_drift, 1.0, math.inf, low_open=True, high_open=True)
        self.values: dict[str, list[float]] = {}
        self.ctx: ControllerContext | None = None

    def bind(self, ctx: ControllerContext) -> None:
        self.ctx = ctx
        for name in ctx.names:
            self.values.setdefault(name, [0.0] * ctx.num_targets[name])

    def move(
        self,
        name: str,
        change: float | list[float],
        refs: list[float],
        ceilings: list[float] | None = None,
        start: list[float] | None = None,
    ) -> list[tuple[float, float, bool]]:
        """Move every target by ``change`` (one for all, or one per target) from ``start`` (default:
        where it stands); returns ``(before, after, clipped)`` per target."""
        out = []
        for t, d in enumerate(self.values[name]):
            change_t = change[t] if isinstance(change, list) else change
            new, clipped = self.clamped(name, t, d if start is None else start[t], change_t, refs, ceilings)
            out.append((d, new, clipped))
            self.values[name][t] = new
        return out

    def clamped(
        self, name: str, t: int, d: float, change: float, refs: list[float], ceilings: list[float] | None = None
    ) -> tuple[float, bool]:
        """``d + change`` within the limits, and whether they clipped it."""
        cap = math.log(self.max_drift)
        low, high = -cap, cap
        if ceilings is not None and change > 0:
            high = min(high, max(d, ceilings[t]))
        if name != "lr" or self.ctx.lr_bounds_given:
            ref = refs[t]
            lo_b, hi_b = self.ctx.bounds[name][t]
            if ref > 0:
                low = max(low, math.log(lo_b / ref) if lo_b > 0 else -math.inf)
                high = min(high, math.log(hi_b / ref) if math.isfinite(hi_b) else math.inf)
        raw = d + change
        new = min(max(raw, low), high) if low <= high else d
        return new, new != raw

    def base(self, name: str, target: int, reference: float, drift: float | None = None) -> float:
        """``reference * exp(drift)``, within the bounds for hyperparameters other than the LR;
        without ``drift``: at the target's current drift (the reference itself while it is 0)."""
        if drift is None:
            drift = self.values[name][target] if name in self.values else 0.0  # 0 until bound
            if drift == 0.0:
                return reference
        value = reference * math.exp(drift)
        if name != "lr":
            lo, hi = self.ctx.bounds[name][target]
            value = min(max(value, lo), hi)
        return value


class DriftController(Controller):
    """Shape-keeping, loss-scale-free, guarded: ``base = reference * exp(drift)`` (see docs/controller.md).

    Args:
        guard: a replica whose window loss exceeds ``guard`` times the smaller of the window's
            starting loss (median of the replicas' first losses, all taken at the common
            consensus) and the median window loss is *blown up*: no weight, left out of the
            average, reset. When every replica is, the consensus blew up and is rolled back.
            Losses must be positive for this ratio test; otherwise only non-finite values count.
        forget: how much of the last sync's evidence carries over (lambda in [0, 1)).
        dead_zone: no move while the accumulated evidence is below this many standard errors.
        full_step_at: the evidence (standard errors) at which the drift moves a full step.
        step: a full step of the log drift; default half the log range of the multipliers.
        max_drift: the drift stays within ``[1 / max_drift, max_drift]``.
        rollback: keep the last good consensus and roll back to it when the consensus blows up
            (one copy of the parameters and buffers in memory and in checkpoints).
        min_backoff, trip_backoff, edge_backoff: how far the LR drift goes down when the guard
            acts (:class:`Backoffs`): a rollback cuts at least ``min_backoff``; after a local
            step-guard trip, ``"ramp"`` (the default), ``"spread"`` or ``"notch"``; ``edge_backoff``
            aims the peak's base at half the LR that blew up: ``"sync"`` (the default since round
            14) for the sync guard's blow-ups and every rollback, ``"all"`` also for local trips,
            ``"off"``.
        max_rollbacks: consecutive rollbacks after which training stops (NonFiniteReplicasError).
        warmup: steps before the drift starts moving (0: from the first sync); the guard acts
            from the first sync regardless.
        one_sided: the LR's drift goes up on evidence and down only when the guard acts (the
            other hyperparameters move both ways). Evidence that smaller steps did better within a
            window is biased (less noise now, less progress later; Wu et al., 2018), evidence that
            larger ones did better is not biased that way, and a blow-up is unambiguous.
        step_guard: check every step (one all-gather of two floats per rank): when a replica's loss
            is not finite or exceeds ``step_guard`` times the window's starting loss (the higher
            of its own first loss and the median of all replicas' first losses), converge at once
            and roll back (with shared gradients one replica's blow-up reaches
            every replica within a step, long before the next sync). None: syncs only. The
            default (10) was chosen on the development split (docs/controller.md, round 2).
        step_guard_scope: ``"auto"`` (the default): the scheduler compares the ranks' gradients
            (a fingerprint of sampled values, in the step guard's all-gather) at the first step
            after a spread step since the last consensus at which every rank has finite,
            non-zero gradients (never with ``sync_every=1``): any sampled tensor the same on every
            rank (DDP) -> ``"all"``, else ``"local"``. Until then, and without ``rollback``, the collective check runs.
            The choice is kept in the state (docs/controller.md, round 7). ``"all"``: the collective check above.
            ``"local"``: each replica checks only its own loss against its own first loss of the
            window, with no collective; a replica that trips restores the kept consensus into
            itself at once and is left out at the next sync like a replica the sync guard finds
            blown up. For replicas that train independently between syncs: under DDP a blow-up
            reaches every replica through the gradients before a local check fires.
        guard_floor: a loss counts as blown up (step guard and sync guard alike) only if it also
            exceeds ``guard_floor`` times the run's starting loss (the median of the replicas'
            first losses in the run's first window); non-finite losses always count. None: no
            floor. Near-zero training losses (a small dataset learned by heart) are noisy by ratio:
            one batch at 10x the window's first loss is noise there, not a blow-up (the default
            since round 10, docs/controller.md).
        skip_windows: the windows that end at or before step ``skip_windows * sync_every`` of the
            schedule (1: the first window of a run started from scratch) may measure the initial
            transient (the loss falls from its starting value and the larger step is ahead at
            every max_lr), not where the peak should be (docs/controller.md, round 11). What
            happens to their evidence: ``revert_unconfirmed`` (the default: used at once, taken
            back with shared gradients unless the next window confirms it), ``confirm_skipped``
            (held until the next window confirms it), or, with both off, not used at all (no move,
            no accumulation). The guard acts regardless. A resumed or wrapped schedule past those
            steps is not affected; ``skip_windows=0`` uses every window as it comes.
        confirm_skipped: the skipped windows' evidence is held, not dropped: it is used (accumulated
            and its moves made) at the next sync if that window's own evidence passes the dead zone
            in the same direction, else dropped (docs/controller.md, round 15).
        revert_unconfirmed: the skipped windows' evidence is used at once, as without
            ``skip_windows``, but provisionally: unless the next window's own evidence passes the
            dead zone in the same direction, their moves are undone at that sync (the drift goes
            back to where ``skip_windows`` alone stands) and their evidence dropped; a backoff at
            that sync cuts from the drift the replicas trained with and the lower of the two stands
            (docs/controller.md, round 16). At most one of this and ``confirm_skipped``.
            ``"shared"``: only when the ranks' gradients were found shared (DDP; decided by
            ``step_guard_scope="auto"``, see there); with independent replicas, or undecided, the
            provisional moves are kept (docs/controller.md, round 17). None (the default since
            round 17): ``"shared"``, or False with ``confirm_skipped``.
        ceiling: the LR's drift never rises so far that the base LR at a later step would exceed
            the highest LR a healthy replica has trained with so far (:class:`Ceiling`).
    """

    name = "drift"

    def __init__(
        self,
        guard: float = 2.0,
        forget: float = 0.5,
        dead_zone: float = 1.5,
        full_step_at: float = 3.5,
        step: float | None = None,
        max_drift: float = 100.0,
        rollback: bool = True,
        min_backoff: float = 2.0,
        max_rollbacks: int = 8,
        warmup: int = 0,
        one_sided: bool = True,
        ceiling: bool = False,
        step_guard: float | None = 10.0,
        step_guard_scope: str = "auto",
        trip_backoff: str = "ramp",
        guard_floor: float | None = 0.5,
        skip_windows: int = 1,
        edge_backoff: bool | str = "sync",
        confirm_skipped: bool = False,
        revert_unconfirmed: bool | str | None = None,
    ) -> None:
        self._settings = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        inf = math.inf
        guard = check_number("guard", guard, 1.0, inf, low_open=True, high_open=True)
        check_bool("ceiling", ceiling)
        check_bool("confirm_skipped", confirm_skipped)
        if revert_unconfirmed is None:  # the default since round 17, unless the skipped windows are held
            revert_unconfirmed = False if confirm_skipped else "shared"
        if revert_unconfirmed not in (False, True, "shared"):
            raise ValueError(
                f"Expected revert_unconfirmed in (False, True, 'shared') or None, but got {revert_unconfirmed!r}"
            )
        self.revert_unconfirmed = revert_unconfirmed
        self.shared_gradients: bool | None = None  # told once by the scheduler (resolve_scope)
        self.evidence = Evidence(
            forget, dead_zone, full_step_at, skip_windows, confirm_skipped, bool(revert_unconfirmed)
        )
        self.step = None if step is None else check_number("step", step, 0.0, inf, low_open=True, high_open=True)
        self.drifts = Drift(max_drift)
        self.max_rollbacks = check_int("max_rollbacks", max_rollbacks, 0)
        self.warmup = check_int("warmup", warmup, 0)
        self.rollback = check_bool("rollback", rollback)
        self.one_sided = check_bool("one_sided", one_sided)
        self.ceilings = Ceiling(ceiling)
        step_guard = (
            None
            if step_guard is None
            else check_number("step_guard", step_guard, 1.0, inf, low_open=True, high_open=True)
        )
        if step_guard_scope not in ("all", "local", "auto"):
            raise ValueError(f"Expected step_guard_scope in ('all', 'local', 'auto'), but got {step_guard_scope!r}")
        if step_guard_scope == "local" and not rollback:
            raise ValueError(
                "Expected rollback=True with step_guard_scope='local' (a replica resets itself to the kept "
                "consensus), but got rollback=False"
            )
        self.step_guard_scope = "all" if step_guard_scope == "auto" and not rollback else step_guard_scope
        self.backoffs = Backoffs(min_backoff, trip_backoff, edge_backoff)
        guard_floor = (
            None
            if guard_floor is None
            else check_number("guard_floor", guard_floor, 0.0, inf, low_open=False, high_open=True)
        )
        self.blowups = BlowupGuard(guard, step_guard, guard_floor)
        self._provisional: dict[str, list[float]] = {}  # revert_unconfirmed: the moves it may take back
        self.rollbacks = 0  # consecutive
        self.guard_events = 0  # backoffs and rollbacks so far: each halves the LR's upward step (at most 8x)

    def bind(self, ctx: ControllerContext) -> None:
        super().bind(ctx)
        self.drifts.bind(ctx)
        for name in ctx.names:
            self.evidence.sums.setdefault(name, [0.0, 0.0])

    # -- health (BlowupGuard) ------------------------------------------------------------------
    guard = property(lambda self: self.blowups.ratio, doc="The sync guard's ratio (``guard``).")
    step_guard = property(lambda self: self.blowups.step_ratio, doc="The step guard's ratio (None: off).")
    guard_floor = property(lambda self: self.blowups.floor, doc="``guard_floor`` (None: off).")
    ceiling = property(lambda self: self.ceilings.on, doc="``ceiling`` (:class:`Ceiling`).")
    min_backoff = property(lambda self: self.backoffs.min_backoff, doc="``min_backoff`` (:class:`Backoffs`).")
    trip_backoff = property(lambda self: self.backoffs.trip_backoff, doc="``trip_backoff`` (:class:`Backoffs`).")
    edge_backoff = property(lambda self: self.backoffs.edge_backoff, doc="``edge_backoff`` (:class:`Backoffs`).")
    max_drift = property(lambda self: self.drifts.max_drift, doc="``max_drift`` (:class:`Drift`).")

    def health(self, stats: WindowStats) -> Health:
        return self.blowups.health(stats, self.rollback)

    def resolve_scope(self, shared_gradients: bool) -> None:
        if self.step_guard_scope == "auto" and self.shared_gradients is None:
            self.shared_gradients = bool(shared_gradients)
        super().resolve_scope(shared_gradients)

    def check_step(self, losses: Sequence[float], firsts: Sequence[float]) -> str | None:
        return self.blowups.check_step(losses, firsts)

    def check_own_step(self, loss: float, first: float) -> str | None:
        """``step_guard_scope="local"``: this replica's loss at this step and at the window's first
        step; a reason to reset this replica now, or None."""
        return self.blowups.check_own_step(loss, first)

    # -- the drift ----------------------------------------------------------------------------
    def _log_mults(self, name: str, stats: WindowStats) -> list[float]:
        rho = self.ctx.multipliers[name]
        return [math.log(rho[i]) for i in stats.perms[name]]

    def _full_step(self, name: str) -> float:
        if self.step is not None:
            return float(self.step)
        logs = [math.log(m) for m in self.ctx.multipliers[name]]
        return (max(logs) - min(logs)) / 2

    def window_evidence(self, name: str, x: list[float], ok: list[int], stats: WindowStats, se: float) -> float:
        """One sync's ``z`` for ``name``: the healthy replicas' window losses against their log
        multipliers ``x``, in standard errors ``se`` (:func:`trend_evidence`). A subclass may read
        another signal here (docs/controller.md, round 18)."""
        means = stats.window_losses
        return trend_evidence([x[r] for r in ok], [means[r] for r in ok], se) if len(ok) > 1 else 0.0

    def update(self, stats: WindowStats, health: Health) -> Decision:
        self.rollbacks = 0
        ok = [r for r, h in enumerate(health.healthy) if h]
        if stats.step < self.warmup:
            self.ceilings.limits("lr", self.ctx.num_targets["lr"], stats, ok)  # counts from the first sync
            return Decision()
        means = stats.window_losses
        se = window_noise(stats.losses[ok]) if ok else math.nan
        z_ok = [(means[r] - float(np.mean([means[q] for q in ok]))) / se if se > 0 else 0.0 for r in ok]
        weights = [0.0] * len(means)
        if ok:
            for r, w in zip(ok, softmax_weights([-z for z in z_ok], 1.0) if z_ok else []):
                weights[r] = w
        guard: list[GuardAction] = []
        left = [r for r, h in enumerate(health.healthy) if not h]
        updates = {}
        keep = self.revert_unconfirmed == "shared" and self.shared_gradients is not True  # provisional moves stay
        for name in self.ctx.names:
            x = self._log_mults(name, stats)
            z = self.window_evidence(name, x, ok, stats, se)
            read = self.evidence.add(name, z, stats.step, self.ctx.sync_every, keep)
            evidence, fractions = read.evidence, read.fractions
            if name == "lr" and self.one_sided:
                # a window's loss favours the smaller step (short-horizon bias): only blow-ups lower the LR
                fractions = [max(f, 0.0) for f in fractions]
            upward = name == "lr" and sum(fractions) > 0  # each backoff or rollback halves the LR's later upward steps
            step = self._full_step(name) * (0.5 ** min(self.guard_events, 3) if upward else 1.0)
            refs = stats.references[name]
            # revert_unconfirmed: where skip_windows alone would stand (no move in the provisional windows)
            now = self.drifts.values[name]
            unmoved = self._provisional.pop(name, list(now))
            start = unmoved if read.revert else None  # taken back: this sync moves from there
            undone = [d - u for d, u in zip(now, unmoved)] if read.revert else [0.0] * len(unmoved)
            change = [step * sum(fractions)] * len(unmoved)
            blown = [r for r in left if health.reasons[r].startswith("blown") or health.reasons[r] == "non-finite"]
            backed_off = False
            if name == "lr" and blown and ok:
                cut, blown, why = self.backoffs.at_sync(x, ok, blown, stats)
                if cut > 0:  # cut from the drift the replicas trained with, taken back or not
                    change = [min(c, u - cut) for c, u in zip(change, undone)]
                    self.evidence.drop_upward(name)  # and the held windows: nothing provisional is left
                    backed_off = True
                    self.guard_events += 1
                    moved_by = min(c - u for c, u in zip(change, undone))  # from the drift trained with
                    guard.append(GuardAction("backoff", blown, f"replicas {blown} {why}", moved_by))
            ceilings = self.ceilings.limits(name, self.ctx.num_targets[name], stats, ok)
            moved = self.drifts.move(name, change, refs, ceilings, start)
            if read.provisional and not backed_off:
                self._provisional[name] = [self.drifts.clamped(name, t, u, 0.0, refs)[0] for t, u in enumerate(unmoved)]
            updates[name] = [
                ControllerUpdate(
                    delta=after - before,
                    velocity=evidence,
                    base_before=self.drifts.base(name, t, refs[t], before),
                    base_after=self.drifts.base(name, t, refs[t], after),
                    gamma=0.0,
                    clipped=clipped,
                    reference=refs[t],
                )
                for t, (before, after, clipped) in enumerate(moved)
            ]
        self.blowups.acted(stats.step, bool(guard) or bool(left))
        return Decision(weights, updates, guard)

    def rolled_back(self, stats: WindowStats, reason: str | None = None) -> Decision:
        self.blowups.note_start(stats)
        self.rollbacks += 1
        self.guard_events += 1
        x = self._log_mults("lr", stats)
        cut = self.backoffs.at_rollback(x, stats)
        refs = stats.references["lr"]
        moved = self.drifts.move("lr", -cut, refs)
        self.evidence.reset()
        self._provisional.clear()
        updates = {
            "lr": [
                ControllerUpdate(
                    after - before, 0.0, refs[t] * math.exp(before), refs[t] * math.exp(after), 0.0, clipped, refs[t]
                )
                for t, (before, after, clipped) in enumerate(moved)
            ]
        }
        n = len(stats.counts)
        reason = f"{reason or 'every replica blown up or non-finite'} (rollback {self.rollbacks} in a row)"
        self.blowups.acted(stats.step, True)
        return Decision(None, updates, [GuardAction("rollback", list(range(n)), reason, -cut)])

    def base(self, name: str, target: int, reference: float) -> float:
        return self.drifts.base(name, target, reference)

    @property
    def drift(self) -> dict[str, list[float]]:
        """The current log drift per hyperparameter and target."""
        return {k: list(v) for k, v in self.drifts.values.items()}

    def state_dict(self) -> dict:
        return {
            "drift": self.drift,
            "evidence": {k: list(v) for k, v in self.evidence.sums.items()},
            "held": {k: list(v) for k, v in self.evidence.held.items()},
            "provisional": {k: list(v) for k, v in self._provisional.items()},
            "rollbacks": self.rollbacks,
            "guard_events": self.guard_events,
            "tested": dict(self.ceilings.tested),
            "step_guard_scope": self.step_guard_scope,  # "auto" once resolved from the gradients
            "shared_gradients": self.shared_gradients,
            **self.blowups.state_dict(),  # the run's starting loss, the guard-storm warning's count
        }

    def load_state_dict(self, state: dict) -> None:
        self.drifts.values = {k: [float(x) for x in v] for k, v in state["drift"].items()}
        self.evidence.sums = {k: [float(x) for x in v] for k, v in state["evidence"].items()}
        self.evidence.held = {k: [float(x) for x in v] for k, v in state.get("held", {}).items()}
        self._provisional = {k: [float(x) for x in v] for k, v in state.get("provisional", {}).items()}
        self.rollbacks = int(state.get("rollbacks", 0))
        self.guard_events = int(state.get("guard_events", 0))
        self.ceilings.tested = {k: [float(x) for x in v] for k, v in state.get("tested", {}).items()}
        self.blowups.load_state_dict(state)
        shared = state.get("shared_gradients")
        self.shared_gradients = None if shared is None else bool(shared)
        if self.step_guard_scope == "auto" and state.get("step_guard_scope") in ("all", "local"):
            self.step_guard_scope = state["step_guard_scope"]


CONTROLLERS = {"paper": PaperController, "drift": DriftController}


def make_controller(spec: str | Controller, **paper_kwargs: float) -> Controller:
    """A controller from ``controller=``: a name in :data:`CONTROLLERS` or an instance. The paper
    controller takes ``paper_kwargs``; the drift controller only their ``warmup``."""
    if isinstance(spec, Controller):
        return spec
    if spec == "paper":
        return PaperController(**paper_kwargs)  # type: ignore[arg-type]
    if spec == "drift":
        return DriftController(warmup=int(paper_kwargs.get("warmup", 0)))
    raise ValueError(f"Expected controller to be one of {sorted(CONTROLLERS)} or a Controller, but got {spec!r}")
