"""PyTorch Lightning: ``callbacks=[HDETCallback(...)]`` or ``hdet_track.wrap(pl.Trainer(...), ...)``.

The callback takes over the module's ``OneCycleLR`` (from ``configure_optimizers``), or builds
one from ``max_lr`` over ``trainer.estimated_stepping_batches``; it steps HDET once per optimizer
step with the training loss (so gradient accumulation counts once), averages across Lightning's
DDP ranks (Lightning initialises ``torch.distributed``; gloo on CPU, nccl on GPU), and logs into
the run of Lightning's ``MLFlowLogger`` or ``WandbLogger`` when one is configured, through the
project's tracker otherwise.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler, OneCycleLR, ReduceLROnPlateau

from ..arguments import onecycle_arguments
from ..errors import needs_extra
from ..scheduler import HDETScheduler, check_hdet_kwargs
from ..tracking import lifecycle
from ..tracking._common import warn_resumed_elsewhere

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Checkpoint
except ImportError:  # pragma: no cover - the standalone package name
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]
        from pytorch_lightning.callbacks import Checkpoint  # type: ignore[no-redef]
    except ImportError as exc:
        raise ImportError(needs_extra("hdet_track.integrations.lightning", "lightning", "lightning")) from exc

__all__ = ["HDETCallback", "wrap_trainer"]

logger = logging.getLogger(__name__)

# How long rank 0 holds off Lightning's SIGKILL of every rank (its launcher's child-process observer,
# after another rank died): while the fit still runs, long enough for rank 0 to fail on the dead
# rank's collective and start ending the run; while it ends the run, for the tracker's writer.
_FAIL_GRACE_S = 10.0
_END_GRACE_S = 60.0


def _tracker_for(trainer: Any, track: Any) -> Any:
    """The runs of Lightning's own loggers when there are any (an ``MLFlowLogger`` or a
    ``WandbLogger``, or a subclass: one tracker for each, so that ``logger=[MLFlowLogger(...),
    WandbLogger(...)]`` gets HDET's series in both runs), else ``track``."""
    if track is False or track is None:
        return False
    trackers: list[Any] = []
    for logger_ in getattr(trainer, "loggers", []) or []:
        kinds = {cls.__name__ for cls in type(logger_).__mro__}
        if "MLFlowLogger" in kinds:
            from ..tracking.mlflow import MLflowTracker

            run_id = logger_.run_id if trainer.global_rank == 0 else None
            trackers.append(MLflowTracker(tracking_uri=getattr(logger_, "_tracking_uri", None), run_id=run_id))
        elif "WandbLogger" in kinds:
            from ..tracking.wandb import WandbTracker

            trackers.append(WandbTracker(run=logger_.experiment if trainer.global_rank == 0 else None))
    if not trackers:
        return track
    return trackers[0] if len(trackers) == 1 else trackers


def _warn_if_split(trainer: Any, resumed: dict[str, str]) -> None:
    """A fit resumed from a checkpoint whose runs (``resumed``) are not the ones its loggers opened:
    the run is split in two (a fresh ``MLFlowLogger()`` opens a new run), as Hugging Face's warns."""
    if trainer.global_rank != 0:
        return
    for logger_ in getattr(trainer, "loggers", []) or []:
        kinds = {cls.__name__ for cls in type(logger_).__mro__}
        if "MLFlowLogger" in kinds:
            backend, run_id, how = "mlflow", logger_.run_id, "pass MLFlowLogger(run_id={!r})"
        elif "WandbLogger" in kinds:
            backend, run_id, how = "wandb", logger_.experiment.id, "pass WandbLogger(id={!r}, resume='allow')"
        else:
            continue
        earlier = resumed.get(backend)
        if earlier and run_id and earlier != run_id:
            warn_resumed_elsewhere(
                backend, earlier, run_id, f"Lightning's {type(logger_).__name__}", how.format(earlier)
            )


class _HDETInLightning:
    """What ``trainer.lr_scheduler_configs`` holds in place of the module's OneCycleLR once HDET took
    it over (the same config, at the same place in the list):

    - ``step()`` does nothing: HDET steps itself, once per optimizer step, with the loss. Lightning
      calls it under automatic optimization, and Lightning's manual pattern
      (``self.lr_schedulers().step()`` in ``training_step``) may stay.
    - ``get_last_lr()``, ``last_epoch`` and ``optimizer`` are HDET's (this replica's learning rates).
    - ``state_dict()`` is a OneCycleLR's state at HDET's step: the checkpoint's ``lr_schedulers``
      keep their length and order, and a checkpoint written with HDET and resumed without it
      continues the module's OneCycleLR at that step. HDET's own state is the callback's.
    - ``hdet``: the :class:`HDETScheduler`.
    """

    def __init__(self, hdet: HDETScheduler) -> None:
        self.hdet = hdet
        self.optimizer = hdet.optimizer

    @property
    def last_epoch(self) -> int:
        return self.hdet.last_epoch

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: HDET steps itself, once per optimizer step."""

    def get_last_lr(self) -> list[float]:
        return self.hdet.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        hdet = self.hdet
        return {k: hdet.__dict__[k] for k in sorted(hdet._onecycle_keys)}  # OneCycleLR's own state, as HDET keeps it

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing: Lightning restores a checkpoint's schedulers before HDET takes over, and HDET's
        state comes back from the callback's."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(step {self.hdet.last_epoch} of {self.hdet.total_steps}: HDET steps itself)"


class HDETCallback(pl.Callback):
    """Run a Lightning fit with HDET.

    Args:
        max_lr: build a OneCycle schedule with this peak over ``trainer.estimated_stepping_batches``
            for a module that configures no scheduler (the Trainer must know the fit's length:
            ``max_steps``, or ``max_epochs`` over a DataLoader with a length).
        track: as for :class:`HDETScheduler` (``True`` by default); Lightning's MLflow/W&B logger
            wins when configured.
        **hdet_kwargs: HDET's arguments (``spread``, ``sync_every``, ``auto_lr``, ...).

    ``configure_optimizers`` returns one optimizer, and either a OneCycleLR on it (HDET takes it
    over; under automatic optimization with ``interval="step"``; its ``total_steps`` must cover
    ``trainer.estimated_stepping_batches``) or, with ``max_lr``, no learning-rate scheduler.
    Anything else is refused when training starts, naming what was found: two optimizers (a GAN's:
    Lightning counts both optimizers' steps in ``trainer.global_step`` and
    ``estimated_stepping_batches``, HDET one, so the schedule would end at the fit's midpoint),
    ``max_lr`` with a scheduler (one of the two would be ignored), another learning-rate scheduler
    (Lightning would step it while HDET sets the learning rates), a OneCycleLR shorter than the fit
    (HDET could neither step nor average after its last step). A fit that goes on past the
    schedule's last step anyway (its length unknown at the start) fails at the next batch, with the
    replicas still averaged at that last step, as plain Lightning's OneCycleLR fails there.

    HDET steps once per optimizer step with that step's training loss (with gradient accumulation:
    the mean over its micro-batches). A step whose ``training_step`` returned None for every
    micro-batch (Lightning's "skip this batch"; with 16-bit AMP, for its last micro-batch) trains
    nothing: the optimizer has no gradient, or AMP skips it. Lightning still counts it in
    ``trainer.global_step``; HDET does not, so such a fit ends a little short of the schedule's
    last step, converged (as a fit stopped early). Under manual optimization ``training_step`` must
    return the loss it backpropagated (``return loss``): a step without one fails with
    ``auto_lr=True`` and is logged without a loss otherwise (with a warning, once).

    In ``trainer.lr_scheduler_configs`` (``self.lr_schedulers()``) HDET's OneCycleLR is replaced by
    a stand-in whose ``step()`` does nothing, whose ``get_last_lr()`` is HDET's and whose
    ``state_dict()`` is OneCycleLR's at HDET's step. Every checkpoint the fit writes
    (``ModelCheckpoint``, any ``trainer.save_checkpoint``, weights-only ones included) is converged
    first, so it holds the consensus every replica resumes from; with a
    ``ModelCheckpoint(monitor=...)`` the validation that decides the save is converged first too,
    so the metric is the saved weights'. HDET's state is part of Lightning's checkpoints, and
    ``trainer.fit(..., ckpt_path=...)`` resumes the schedule where it stopped; from a checkpoint
    written without HDET the schedule starts at the checkpoint's ``trainer.global_step``. A fit stopped early converges before it ends its run. A fit that fails
    ends its run FAILED; under DDP with the error of the rank that failed first, which leaves a
    note for rank 0 (as :mod:`hdet_track.tracking.lifecycle` does for plain loops).

    ``scheduler`` is the last fit's :class:`HDETScheduler` in this process. With
    ``strategy="ddp_spawn"`` (or ``ddp_fork``, ``ddp_notebook``) the fit runs in worker processes,
    each with its own copy of this callback: in the process that called ``fit()`` it stays None, and
    the run ends with the workers; log final metrics from inside the fit (``on_fit_end``).

    Example:
        >>> trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp",
        ...                      callbacks=[HDETCallback(spread=0.2, sync_every=100, auto_lr=True)])
    """

    def __init__(self, *, max_lr: float | None = None, track: Any = True, **hdet_kwargs: Any) -> None:
        super().__init__()
        check_hdet_kwargs("HDETCallback", hdet_kwargs, taken=("track",))
        self.max_lr = max_lr
        self.track = track
        self.hdet_kwargs = hdet_kwargs
        self.scheduler: HDETScheduler | None = None
        self._fitting = False  # a fit's training owns self.scheduler's run (from on_train_start)
        self._closing = False  # ending the run after an exception or at the fit's end
        self._last_global_step = 0
        self._losses: list[torch.Tensor | float] = []  # this optimizer step's micro-batch losses
        self._restored: dict[str, Any] | None = None
        self._warned_no_loss = False

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        if self.scheduler is not None:
            self.scheduler.close()  # the previous fit's run, left open for final metrics (idempotent)
        _run_before_checkpoints(trainer, self)
        _converge_before_saves(trainer, self)
        _hold_kill(self)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # state restored by validate/test/predict(ckpt_path=...) is not the next fit's to resume
        self._restored = None
        _restore_saves(trainer)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        optimizer, onecycle_config, total_steps = _check_fit(
            trainer, pl_module, self.max_lr
        )  # before anything is built
        kwargs = dict(self.hdet_kwargs)
        kwargs.setdefault("model", pl_module)
        kwargs["track"] = _tracker_for(trainer, self.track)
        kwargs.setdefault("close_at_end", False)
        if onecycle_config is not None:
            onecycle = onecycle_config.scheduler
            if self._restored is not None:
                # HDET's state, loaded below, puts the schedule at its step: built as the saved job's was
                # (the OneCycleLR holds that step too, from the checkpoint: see _HDETInLightning)
                sched = HDETScheduler(onecycle.optimizer, **onecycle_arguments(onecycle), **kwargs)
            else:
                sched = HDETScheduler.from_onecycle(onecycle, **kwargs)  # at the OneCycleLR's progress
            # Lightning keeps its config (the checkpoint's lr_schedulers keep their order), with a
            # stand-in that it may step: HDET steps once per optimizer step, with the loss.
            onecycle_config.scheduler = _HDETInLightning(sched)
        else:
            sched = HDETScheduler(optimizer, self.max_lr, total_steps=total_steps, **kwargs)
            if self._restored is None and trainer.global_step > 0:
                # a checkpoint written without HDET: max_lr's schedule spans the fit's optimizer
                # steps from 0 (estimated_stepping_batches counts the resumed ones too), so it goes
                # on at the checkpoint's step, as a module's OneCycleLR, restored, would
                sched._start_at(min(trainer.global_step, sched.total_steps))
        self.scheduler = sched
        self._fitting = True
        if self._restored is not None:  # resuming from a Lightning checkpoint (ckpt_path=...)
            sched.load_state_dict(self._restored)
            self._restored = None
            if kwargs["track"] is not False:
                _warn_if_split(trainer, sched._resumed_runs)
        self._last_global_step = trainer.global_step
        self._losses = []
        self._warned_no_loss = False

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        sched = self.scheduler
        if sched is not None and self._fitting and sched.last_epoch >= sched.total_steps:
            raise ValueError(_past_the_end(trainer, sched))  # the replicas are still the last sync's consensus

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        sched = self.scheduler
        if sched is None or not self._fitting:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self._losses.append(loss.detach())
        elif loss is not None:
            self._losses.append(float(loss))
        steps = trainer.global_step - self._last_global_step
        if steps <= 0:
            return  # no optimizer step in this batch (gradient accumulation, or a manual one that did not step)
        self._last_global_step = trainer.global_step
        losses, self._losses = self._losses, []
        if pl_module.automatic_optimization and (not losses or (loss is None and _amp_skips_none(trainer))):
            # training_step returned None: Lightning still calls the optimizer (and counts a step), but
            # there is no gradient (every micro-batch None), or 16-bit AMP skips the step (the last one None)
            return
        step_loss = _step_loss(losses, trainer, pl_module)
        if step_loss is None:
            self._no_loss(trainer, pl_module, sched)
        for _ in range(steps):  # manual optimization may step more than once in a batch
            if sched.last_epoch >= sched.total_steps:
                raise ValueError(_past_the_end(trainer, sched))
            sched.step(step_loss)

    def _no_loss(self, trainer: Any, pl_module: Any, sched: HDETScheduler) -> None:
        """An optimizer step without a loss (manual optimization whose training_step returned none)."""
        hint = (
            "Expected training_step to return the training loss (a tensor, or a dict with 'loss'), which "
            "HDETCallback hands to HDET at every optimizer step, but the step that took trainer.global_step to "
            f"{trainer.global_step} had none"
            + (
                ": under manual optimization, end training_step with `return loss` (the loss you backpropagated)"
                if not pl_module.automatic_optimization
                else ""
            )
        )
        if sched.auto_lr:
            raise ValueError(hint + " (auto_lr=True weighs the replicas by it)")
        if not self._warned_no_loss:
            self._warned_no_loss = True
            logger.warning("hdet-track: %s; this run's steps have no training loss", hint)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        # Every rank validates after the same step. A validation whose metric picks a checkpoint
        # runs on the consensus that checkpoint will hold; any other gets the last sync's record
        # into tracking first.
        if self.scheduler is None or not self._fitting:
            return
        if not trainer.sanity_checking and any(getattr(c, "monitor", None) for c in trainer.checkpoint_callbacks):
            self.scheduler.sync_now()
        else:
            self.scheduler.gather_pending()

    def state_dict(self) -> dict[str, Any]:
        # Lightning asks every rank while it checkpoints (the saves converge first, see
        # _converge_before_saves; this covers a dump that bypasses trainer.save_checkpoint).
        if self.scheduler is None:
            return {}
        if self._fitting:
            self.scheduler.sync_now()
        return {"scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict.get("scheduler")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        # A fit that reached the schedule's last step (synced there) leaves the run open for final
        # metrics (callback.scheduler.log_metrics(...)), as a plain scheduler does: it ends FINISHED
        # at the next fit, close() or the process's exit. A fit stopped early (max_epochs, early
        # stopping, steps skipped by a training_step that returned None) converges the replicas it
        # leaves (a collective: every rank is here) and ends the run now: the process's exit would
        # take the unfinished schedule for a failure.
        sched = self.scheduler
        self._closing = True
        self._fitting = False
        try:
            if sched is not None and sched.last_epoch < sched.total_steps:
                try:
                    sched.sync_now()
                except BaseException as exc:  # a peer gone in this collective: on_exception sees no fit
                    sched.close(*lifecycle.caught_failure(exc))
                    raise
                sched.close()
        finally:
            self._closing = False

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Lightning calls this for an exception in fit, validate, test or predict; only a failing
        # fit's training ends its run FAILED (a failed test() after a finished fit does not).
        self._restored = None
        _restore_saves(trainer)  # Lightning calls no teardown hook here
        sched = self.scheduler
        if not self._fitting or sched is None:
            return
        self._closing = True
        self._fitting = False
        try:
            # under DDP the rank that fails first takes the others down (they fail on a collective
            # once its process is gone): it leaves a note, and rank 0 ends the run with that error
            sched.close(*lifecycle.caught_failure(exception))
        finally:
            self._closing = False


def _check_fit(trainer: Any, pl_module: Any, max_lr: Any) -> tuple[Any, Any, int]:
    """What HDETCallback (``max_lr``: its argument) would take over, checked: the optimizer, the
    OneCycleLR's config (None with ``max_lr``) and, with ``max_lr``, the schedule's length."""
    optimizers = list(trainer.optimizers)
    if len(optimizers) != 1:
        raise ValueError(
            f"Expected configure_optimizers to return one optimizer with HDETCallback, but got "
            f"{len(optimizers)} ({_names(optimizers)}): HDET drives one optimizer's learning rates, once per "
            "step of it, while trainer.global_step and trainer.estimated_stepping_batches count every "
            "optimizer's steps (a GAN's two optimizers: two per batch), so the schedule would end at the "
            "fit's midpoint. Put the parameters in one optimizer (param groups), or drive an HDETScheduler "
            "yourself in training_step"
        )
    configs = list(trainer.lr_scheduler_configs)
    onecycles = [c for c in configs if isinstance(c.scheduler, OneCycleLR)]
    others = [
        c
        for c in configs
        if isinstance(c.scheduler, (LRScheduler, ReduceLROnPlateau)) and not isinstance(c.scheduler, OneCycleLR)
    ]
    # not torch's (a timm-style scheduler Lightning steps through lr_scheduler_step): what it
    # schedules cannot be told (a loss weight, or a learning rate HDET would overwrite)
    foreign = [c for c in configs if not isinstance(c.scheduler, (LRScheduler, ReduceLROnPlateau))]
    if foreign and (onecycles or max_lr is not None):
        logger.warning(
            "hdet-track: HDETCallback sets the optimizer's learning rates at every step; %s from "
            "configure_optimizers is stepped by Lightning too: if it sets learning rates, HDET overwrites them",
            _names(c.scheduler for c in foreign),
        )
    if max_lr is not None:
        if onecycles:
            onecycle = onecycles[0].scheduler
            peaks = [g["max_lr"] for g in onecycle.optimizer.param_groups]
            raise ValueError(
                f"Expected either HDETCallback(max_lr=...) or a OneCycleLR from configure_optimizers, but got "
                f"both: max_lr={max_lr!r} and OneCycleLR(max_lr={peaks[0] if len(peaks) == 1 else peaks}, "
                f"total_steps={onecycle.total_steps}), and HDET would follow one and ignore the other. Drop "
                "max_lr= to take over the module's OneCycleLR, or return no scheduler to schedule with max_lr="
            )
        if others:
            raise ValueError(
                f"Expected no learning-rate scheduler from configure_optimizers with HDETCallback(max_lr="
                f"{max_lr!r}), but got {_names(c.scheduler for c in others)}: Lightning would go on "
                "stepping it while HDET sets the optimizer's learning rates at every step. Return the "
                "optimizer alone, or a OneCycleLR and no max_lr="
            )
        return optimizers[0], None, _fit_steps(trainer)
    if not onecycles:
        got = _names(c.scheduler for c in others + foreign) or "no scheduler"
        raise ValueError(
            "Expected configure_optimizers to return a OneCycleLR (stepped every optimizer step), or "
            f"HDETCallback(max_lr=...) and no scheduler, but got {got}"
        )
    if len(onecycles) > 1 or others:
        raise ValueError(
            "Expected the OneCycleLR to be the only learning-rate scheduler of the optimizer HDET drives, but "
            f"configure_optimizers returned {_names(c.scheduler for c in onecycles + others)}: Lightning would "
            "go on stepping the others while HDET sets the learning rates at every step"
        )
    config = onecycles[0]
    if pl_module.automatic_optimization and (config.interval != "step" or config.frequency != 1):
        raise ValueError(
            "Expected the OneCycleLR from configure_optimizers to step every optimizer step "
            f"(interval='step', frequency=1), but got interval={config.interval!r}, "
            f"frequency={config.frequency!r}: HDET steps once per optimizer step"
        )
    total = config.scheduler.total_steps
    fit = trainer.estimated_stepping_batches
    if _known(fit) and fit > total:
        raise ValueError(
            f"Expected the module's OneCycleLR to last the fit, total_steps >= "
            f"trainer.estimated_stepping_batches={int(fit)}, but got total_steps={total}: after step {total} "
            "HDET could neither step nor average, and each replica would train on alone (plain Lightning "
            f"fails at step {total + 1}). Build it with total_steps=self.trainer.estimated_stepping_batches, "
            f"or end the fit there: Trainer(max_steps={total})"
        )
    return optimizers[0], config, total


def _names(objects: Any) -> str:
    return ", ".join(type(o).__name__ for o in objects)


def _known(steps: Any) -> bool:
    """Whether ``trainer.estimated_stepping_batches`` counts the fit's steps (inf when the Trainer
    cannot know them, -1 for a DataLoader without a length and no max_steps)."""
    return isinstance(steps, (int, float)) and not isinstance(steps, bool) and math.isfinite(steps) and steps >= 1


def _fit_steps(trainer: Any) -> int:
    """The fit's optimizer steps, which ``max_lr``'s schedule spans."""
    steps = trainer.estimated_stepping_batches
    if not _known(steps):
        raise ValueError(
            f"Expected a finite trainer.estimated_stepping_batches >= 1 with HDETCallback(max_lr=...), whose "
            f"schedule spans the fit's optimizer steps, but got {steps!r}: the Trainer cannot count them "
            f"(max_steps={trainer.max_steps}, max_epochs={trainer.max_epochs}: no max_steps, and max_epochs=-1 "
            "or a training DataLoader without a length). Pass Trainer(max_steps=...)"
        )
    return int(steps)


def _past_the_end(trainer: Any, sched: HDETScheduler) -> str:
    return (
        f"Expected the fit to end by the last step of HDET's schedule (total_steps={sched.total_steps}), but it "
        f"goes on at trainer.global_step={trainer.global_step} (trainer.estimated_stepping_batches="
        f"{trainer.estimated_stepping_batches!r}): HDET could neither step nor average, and each replica would "
        "train on alone (the replicas are the consensus of that last step). Give the schedule total_steps for "
        f"the whole fit, or end the fit there: Trainer(max_steps={sched.total_steps})"
    )


def _amp_skips_none(trainer: Any) -> bool:
    """Whether a step whose last micro-batch returned None is skipped (Lightning's 16-bit AMP does
    not call its GradScaler then, whatever the earlier micro-batches left)."""
    return getattr(getattr(trainer, "precision_plugin", None), "scaler", None) is not None


def _step_loss(losses: list[torch.Tensor | float], trainer: Any, pl_module: Any) -> torch.Tensor | float | None:
    """The optimizer step's training loss: the mean of its micro-batches' losses. Under automatic
    optimization Lightning hands each as its loss divided by ``accumulate_grad_batches``."""
    if not losses:
        return None
    scale = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
    if all(isinstance(v, torch.Tensor) for v in losses):
        return torch.stack([v.reshape(()).float() for v in losses]).mean() * scale
    return sum(float(v) for v in losses) / len(losses) * scale


def _hold_kill(callback: HDETCallback) -> None:
    """Rank 0 of ``strategy="ddp"``: Lightning's launcher watches the ranks it started (a thread of
    rank 0's process that polls them every 5 s) and SIGKILLs rank 0 as soon as one of them exited
    with an error. Rank 0 then is about to end the run (the failed rank's exit fails its next
    collective under gloo), and a kill would leave the run open, without its end or its last rows.
    The kill (of every rank) waits while this callback's fit runs, at most ``_FAIL_GRACE_S`` (a
    rank 0 that does not fail by then, blocked in an nccl collective, is killed as before), and
    while it ends its run, at most ``_END_GRACE_S`` in all. This leans on that thread's private
    names (``_ChildProcessObserver._terminate_all``, lightning.fabric): without them nothing
    changes."""
    for thread in threading.enumerate():
        terminate = getattr(thread, "_terminate_all", None)
        if type(thread).__name__ != "_ChildProcessObserver" or not callable(terminate):
            continue
        holder = getattr(thread, "_hdet_holder", None)
        if holder is not None:
            holder[0] = callback  # a later fit's callback
            continue
        holder = [callback]

        def terminate_all(terminate: Any = terminate, holder: list = holder) -> None:
            start = time.monotonic()
            while True:
                waited, callback = time.monotonic() - start, holder[0]
                if not (
                    (callback._closing and waited < _END_GRACE_S) or (callback._fitting and waited < _FAIL_GRACE_S)
                ):
                    break
                time.sleep(0.05)
            terminate()

        thread._terminate_all = terminate_all  # type: ignore[attr-defined]
        thread._hdet_holder = holder  # type: ignore[attr-defined]


def _run_before_checkpoints(trainer: Any, callback: HDETCallback) -> None:
    """HDET steps before any checkpoint callback saves at the same step (Lightning puts its own
    checkpoint callbacks last at construction; one added later, e.g. by ``wrap``, is not)."""
    callbacks = trainer.callbacks
    first = next((i for i, c in enumerate(callbacks) if isinstance(c, Checkpoint)), None)
    mine = callbacks.index(callback) if callback in callbacks else None
    if first is not None and mine is not None and mine > first:
        callbacks.insert(first, callbacks.pop(mine))


def _converge_before_saves(trainer: Any, callback: HDETCallback) -> None:
    """Every checkpoint written during the fit (every rank calls ``trainer.save_checkpoint``)
    converges first: the model's weights, collected before any callback hook runs, and weights-only
    checkpoints (which call no callback hook) then hold the consensus. Wraps whatever
    ``trainer.save_checkpoint`` is (someone else's wrapper too); :func:`_restore_saves` undoes it."""
    save = trainer.save_checkpoint
    if getattr(save, "_hdet_callback", None) is callback:
        return

    def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
        if callback._fitting and callback.scheduler is not None:
            callback.scheduler.sync_now()
        return save(*args, **kwargs)

    save_checkpoint._hdet_callback = callback  # type: ignore[attr-defined]
    save_checkpoint._hdet_previous = trainer.__dict__.get("save_checkpoint")  # type: ignore[attr-defined]
    trainer.save_checkpoint = save_checkpoint


def _restore_saves(trainer: Any) -> None:
    current = trainer.__dict__.get("save_checkpoint")
    if getattr(current, "_hdet_callback", None) is None:
        return
    previous = current._hdet_previous
    if previous is None:
        del trainer.__dict__["save_checkpoint"]
    else:
        trainer.save_checkpoint = previous


def wrap_trainer(trainer: Any, **hdet_kwargs: Any) -> Any:
    """Add an :class:`HDETCallback` to a ``pl.Trainer`` (before its checkpoint callbacks); returns the trainer."""
    callback = HDETCallback(**hdet_kwargs)
    trainer.callbacks.append(callback)
    _run_before_checkpoints(trainer, callback)
    return trainer
