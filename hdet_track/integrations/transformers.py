"""Hugging Face ``Trainer``: ``hdet_track.wrap(transformers.Trainer(...), spread=..., ...)``.

The trainer's scheduler becomes an ``HDETScheduler`` (OneCycle-shaped: each param group peaks at
its own LR, ``args.learning_rate`` for the Trainer's optimizer; warm-up as the Trainer computes it
(``warmup_steps``, a ratio below 1 in transformers 5; ``warmup_ratio`` in transformers 4), over
the trainer's optimizer steps; one HDET step per
optimizer step, so gradient accumulation counts once), fed with this rank's training loss of
that step. It honours ``report_to``: with ``mlflow`` or ``wandb`` it logs into the run Hugging
Face's own callback opened (a new one at each ``train()``, also a resumed one, unless
``MLFLOW_RUN_ID``/``WANDB_RUN_ID`` names one); otherwise through the project's tracker when
``track`` asks for one. Under ``torchrun`` the replicas are the DDP ranks.

The run stays open after training reached its last step, for final metrics
(``trainer.lr_scheduler.log_metrics(...)``), as a plain scheduler's does: it ends FINISHED at the
next ``train()``, ``trainer.lr_scheduler.close()`` or the process's exit. A training stopped early
(``EarlyStoppingCallback``, ``control.should_training_stop``) ends it FINISHED when ``train()``
returns. With ``wrap``, an exception out of ``train()`` (even one raised after the last step, e.g.
by the final evaluation's ``compute_metrics``, and caught by a sweep loop) ends it FAILED with the
error (KILLED for ``KeyboardInterrupt``) before it propagates unchanged.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

import torch

from ..errors import needs_extra
from ..scheduler import HDETScheduler, check_hdet_kwargs
from ..tracking import lifecycle
from ..tracking._common import warn_resumed_elsewhere

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover
    raise ImportError(needs_extra("hdet_track.integrations.transformers", "transformers", "hf")) from exc

__all__ = ["HDETTrainerCallback", "wrap_trainer"]

logger = logging.getLogger(__name__)


class _LossFedScheduler(HDETScheduler):
    """HDET stepped by the Trainer without arguments; the loss comes from the wrapped training_step
    or the model's output, in one of three forms: ``_fed``, this optimizer step's micro-batch losses
    as the Trainer returns them, summed; ``_fed_mean``, per micro-batch means over its own items,
    averaged; ``_fed_items``, (summed loss, item count) of each micro-batch of this rank, whose
    ratio is this rank's mean (where the Trainer normalised by every rank's items together)."""

    _no_loss_hint: str | None = None  # the callback form: why a step may come without a loss

    def step(self, loss: Any = None, epoch: Any = None) -> None:  # type: ignore[override]
        if loss is None and getattr(self, "_hdet_ready", False):
            summed, averaged = self.__dict__.get("_fed", []), self.__dict__.get("_fed_mean", [])
            counted = self.__dict__.get("_fed_items", [])
            parts = [torch.stack([p.reshape(()).double() for p in summed]).sum()] if summed else []
            parts += [torch.stack([p.reshape(()).double() for p in averaged]).mean()] if averaged else []
            if counted:  # a rank whose items were all masked out has a loss of 0, as its summed losses do
                total, items = (
                    torch.stack([torch.as_tensor(x).reshape(()).double().cpu() for x in xs]).sum()
                    for xs in zip(*counted)
                )
                parts.append(total / items.clamp(min=1))
            loss = sum(parts) if parts else None
            for pending in (summed, averaged, counted):
                pending.clear()
            if loss is None and self._no_loss_hint is not None:
                if self.auto_lr:
                    raise ValueError(self._no_loss_hint)
                logger.warning("hdet-track: %s; its runs have no training loss", self._no_loss_hint)
                self._no_loss_hint = None  # said once
        super().step(loss, epoch)

    def drop_pending(self) -> None:
        """An optimizer step begins: a loss left from the last one (a step the optimizer skipped,
        e.g. fp16's GradScaler on an overflow, so the Trainer did not step the scheduler) is not this one's."""
        for key in ("_fed", "_fed_mean", "_fed_items"):
            self.__dict__.get(key, []).clear()

    def state_dict(self, all_ranks: bool = False) -> dict[str, Any]:
        """HDET's state in the callback form's layout (the Trainer's ``scheduler.pt``): a checkpoint
        of either form resumes with either. ``lr_lambdas`` is what torch's ``LambdaLR`` (the
        callback form's scheduler object, which the Trainer loads it into) needs to load it."""
        return {"lr_lambdas": [None] * len(self.optimizer.param_groups), _STATE_KEY: super().state_dict(all_ranks)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if isinstance(state_dict, dict) and _STATE_KEY in state_dict:
            state_dict = state_dict[_STATE_KEY]  # either form's checkpoint
        elif isinstance(state_dict, dict) and "lr_lambdas" in state_dict:
            raise ValueError(_NOT_HDET.format(step=state_dict.get("last_epoch")))
        super().load_state_dict(state_dict)


_NOT_HDET = (
    "Expected a checkpoint written with HDET to resume from, but the Trainer resumed at step {step} from one "
    "whose scheduler.pt holds no HDET state (a run without HDET?): HDET would start its schedule again at "
    "step 0. Resume from a checkpoint of an HDET run, or train from the start"
)


def _items(labels: Any, shift_labels: Any, shifts: bool) -> Any:
    """This rank's item count of a micro-batch, as the Trainer counts them for ``num_items_in_batch``
    (labels other than -100; without the first position of each row for a loss that shifts them);
    None when it has no labels to count."""
    if isinstance(shift_labels, torch.Tensor):
        return shift_labels.ne(-100).sum()
    if not isinstance(labels, torch.Tensor):
        return None
    return (labels[..., 1:] if shifts else labels).ne(-100).sum()


def _shifts_labels(model: Any) -> bool:
    """Whether ``model``'s loss shifts its labels (a causal LM's; the Trainer's own test)."""
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:  # pragma: no cover - an older transformers, which counted every label
        return False
    config = getattr(model, "config", None)
    return LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss and not getattr(
        config, "is_encoder_decoder", False
    )


def _across_ranks(args: Any, num_items_in_batch: Any) -> bool:
    """Whether the Trainer normalised this micro-batch's loss by every rank's items together (and
    scaled it by the world size): then this rank's own mean needs its own item count."""
    return num_items_in_batch is not None and bool(args.average_tokens_across_devices) and args.world_size > 1


# The key of HDET's state inside the Trainer's own scheduler.pt (the callback form; see _drive)
_STATE_KEY = "hdet_scheduler"


def before_pause(args: Any, control: Any, sched: HDETScheduler) -> None:
    """A checkpoint is about to be written (rank 0's model and optimizer only): converge first, so
    that it holds the one consensus every replica resumes from. With ``save_strategy="best"`` an
    evaluation decides whether a checkpoint follows, with no callback in between: converge before
    it, so that the metric that picks the best checkpoint is the weights that checkpoint holds. Any
    other evaluation: hand the last sync's record to tracking first, so that it is in the tracker
    while it runs. Called at each step's and each epoch's end."""
    if control.should_save or (control.should_evaluate and _saves_best(args)):
        sched.sync_now()
    elif control.should_evaluate:
        sched.gather_pending()


def after_evaluation(args: Any, sched: HDETScheduler) -> None:
    """``save_strategy="best"`` and an evaluation that :func:`before_pause` did not see coming (a
    callback after this one asked for it): converge before the save that may follow."""
    if _saves_best(args):
        sched.sync_now()


def _saves_best(args: Any) -> bool:
    return str(getattr(args.save_strategy, "value", args.save_strategy)) == "best"


def _drive(lr_scheduler: Any, sched: HDETScheduler) -> None:
    """The callback form: the Trainer keeps calling its own scheduler, so its ``step`` and
    ``get_last_lr`` become HDET's. The Trainer also saves that object's ``state_dict()`` as the
    checkpoint's ``scheduler.pt`` and loads it on ``resume_from_checkpoint`` (before
    ``on_train_begin``): that state carries HDET's under ``hdet_scheduler``, so it lies in the
    checkpoint the Trainer writes and comes back from the one it resumes, wherever that is."""
    cls = type(lr_scheduler)
    patched = ("step", "get_last_lr", "state_dict", "load_state_dict")

    def state_dict() -> dict[str, Any]:  # its own state without these methods (it must pickle), plus HDET's
        own = {k: v for k, v in cls.state_dict(lr_scheduler).items() if k not in patched}
        return own | {_STATE_KEY: HDETScheduler.state_dict(sched)}  # HDET's own layout, not nested in ours

    def load_state_dict(state: dict[str, Any]) -> None:
        cls.load_state_dict(lr_scheduler, {k: v for k, v in state.items() if k not in patched})

    lr_scheduler.step = sched.step
    lr_scheduler.get_last_lr = sched.get_last_lr
    lr_scheduler.state_dict = state_dict
    lr_scheduler.load_state_dict = load_state_dict


def end_of_training(sched: HDETScheduler) -> None:
    """``train()`` returned: the run stays open for final metrics when the schedule reached its
    end (the process's exit ends it FINISHED); a training stopped early (or short of its last
    scheduler step: a skipped optimizer step) converges first, on every rank, so that the model
    the Trainer saves next is the consensus, and ends it FINISHED now."""
    if sched.last_epoch < sched.total_steps:
        sched.sync_now()
        sched.close()


def _end_failed(sched: HDETScheduler, args: Any, exc: BaseException) -> None:
    """``train()`` raised ``exc``: the run ends FAILED (KILLED on ``KeyboardInterrupt``) with the error."""
    status, text = lifecycle.caught_failure(exc)  # under torchrun: the error of the rank that failed first
    sched.close(status, text)
    if _reports_to(args, "mlflow"):
        # Hugging Face's MLflow callback opened this run and ends it only in on_train_end, which an
        # exception skips: MLflow's own exit hook would then end it FINISHED.
        lifecycle.end_fluent_mlflow_run(sched.run_ids, status)


def _reports_to(args: Any, backend: str) -> bool:
    """Whether the Trainer's ``report_to`` names ``backend`` (``"mlflow"``, ``"wandb"``)."""
    return backend in (args.report_to if isinstance(args.report_to, (list, tuple)) else [args.report_to])


def _mlflow_open(args: Any) -> bool:
    """Whether Hugging Face's MLflow callback has a run open (``report_to`` MLflow, this rank)."""
    if not _reports_to(args, "mlflow"):
        return False
    import mlflow

    return mlflow.active_run() is not None


def _report_tracker(args: Any, track: Any, resumed: dict[str, str] | None = None, again: bool = False) -> Any:
    """The runs Hugging Face's reporting callbacks opened (``report_to``: one tracker for each of
    MLflow and W&B reported to), else ``track`` as given. ``resumed``: the runs of the checkpoint
    being resumed (a warning when Hugging Face opened another one). ``again``: a later ``train()``
    of a Trainer whose MLflow callback opened a run at an earlier one. ``track=False`` (or None)
    tracks nothing, whatever ``report_to`` names."""
    if track is False or track is None:
        return track
    trackers: list[Any] = []
    opened: dict[str, str] = {}
    if _reports_to(args, "mlflow"):
        import mlflow

        from ..tracking.mlflow import MLflowTracker

        active = mlflow.active_run()
        earlier = (resumed or {}).get("mlflow")
        if active is None and again and getattr(args, "process_index", 0) == 0:
            # Hugging Face's MLflowCallback opens its run at its first train() only: at a later one its
            # metrics would go to a run MLflow starts by itself, and HDET's to another. One run for both
            # (the checkpoint's on a resume), which the callback ends at on_train_end as it did the first.
            active = mlflow.start_run(run_id=earlier) if earlier else mlflow.start_run(run_name=args.run_name)
        # the store Hugging Face opened it in: MLflow's own (mlflow.set_tracking_uri() wins over
        # $MLFLOW_TRACKING_URI there), not the environment's alone
        uri = mlflow.get_tracking_uri() if active is not None else None
        trackers.append(MLflowTracker(tracking_uri=uri, run_id=active.info.run_id if active is not None else None))
        if active is not None:
            opened["mlflow"] = active.info.run_id
    if _reports_to(args, "wandb"):
        import wandb

        from ..tracking.wandb import WandbTracker

        trackers.append(WandbTracker(run=wandb.run) if wandb.run is not None else "wandb")
        if wandb.run is not None:
            opened["wandb"] = wandb.run.id
    for backend, run_id in opened.items():
        earlier = (resumed or {}).get(backend)
        if earlier and earlier != run_id:
            variable = "MLFLOW_RUN_ID" if backend == "mlflow" else "WANDB_RUN_ID"
            warn_resumed_elsewhere(
                backend,
                earlier,
                run_id,
                f"Hugging Face (a new run at each train() unless ${variable} names one)",
                f"set {variable}={earlier} before train()",
            )
    if not trackers:
        return track
    return trackers[0] if len(trackers) == 1 else trackers


class _TrackingCallback(TrainerCallback):
    """Starts tracking once Hugging Face's reporting callbacks opened their runs."""

    def __init__(
        self, trainer: Any, track: Any, log_every: int, compare_group: str | None, run_name: str | None
    ) -> None:
        self.trainer = trainer
        self.track = track
        self.log_every = log_every
        self.compare_group = compare_group
        self.run_name = run_name
        self.scheduler: HDETScheduler | None = None  # the last train()'s, whose run may still be open
        self.began = False  # this train() call reached on_train_begin (its scheduler is self.scheduler)
        self._mlflow_opened = False  # Hugging Face's MLflow callback opened a run at an earlier train()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        sched = self.trainer.lr_scheduler
        if self.scheduler is not None and self.scheduler is not sched:
            self.scheduler.close()  # the previous train()'s run, left open for final metrics
        self.scheduler = sched if isinstance(sched, HDETScheduler) else None
        self.began = True
        if isinstance(sched, HDETScheduler) and not sched.tracking:
            track = _report_tracker(args, self.track, sched._resumed_runs, again=self._mlflow_opened)
            self._mlflow_opened = self._mlflow_opened or _mlflow_open(args)
            if track not in (False, None):
                run_name = self.run_name or args.run_name
                sched.start_tracking(
                    track, log_every=self.log_every, compare_group=self.compare_group, run_name=run_name
                )

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        sched = self.trainer.lr_scheduler
        if isinstance(sched, _LossFedScheduler):
            sched.drop_pending()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        sched = self.trainer.lr_scheduler
        if isinstance(sched, HDETScheduler):
            before_pause(args, control, sched)

    on_epoch_end = on_step_end

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        sched = self.trainer.lr_scheduler
        if isinstance(sched, HDETScheduler) and state.global_step > 0:
            after_evaluation(args, sched)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.scheduler is not None:
            end_of_training(self.scheduler)

    def on_failure(self, exc: BaseException) -> None:
        """``train()`` raised: end this call's run FAILED (not an earlier call's, left open)."""
        if self.began and self.scheduler is not None:
            _end_failed(self.scheduler, self.trainer.args, exc)


def wrap_trainer(
    trainer: Any, *, track: Any = True, log_every: int = 1, compare_group: str | None = None, **hdet_kwargs: Any
) -> Any:
    """Make ``trainer`` train with HDET; returns it."""
    taken = ("track", "log_every", "compare_group", "close_at_end")
    check_hdet_kwargs(
        "hdet_track.wrap(Trainer)", hdet_kwargs, taken=taken, log_every=log_every, compare_group=compare_group
    )
    if trainer.lr_scheduler is not None and not getattr(trainer, "_created_lr_scheduler", False):
        raise ValueError(
            f"Expected a Trainer that makes its own scheduler (HDET takes its place), but it was given "
            f"{type(trainer.lr_scheduler).__name__} in optimizers=(optimizer, lr_scheduler): pass "
            "optimizers=(optimizer, None)"
        )
    _check_schedule_choice(trainer.args)
    original_step = trainer.training_step

    def training_step(*args: Any, **kwargs: Any) -> Any:
        loss = original_step(*args, **kwargs)
        sched = trainer.lr_scheduler
        if isinstance(sched, _LossFedScheduler) and isinstance(loss, torch.Tensor):
            inputs = args[1] if len(args) > 1 else kwargs.get("inputs")
            num = args[2] if len(args) > 2 else kwargs.get("num_items_in_batch")
            items = None
            if _across_ranks(trainer.args, num) and isinstance(inputs, dict):
                shifts = bool(getattr(trainer, "_loss_shifts_labels", False))
                items = _items(inputs.get("labels"), inputs.get("shift_labels"), shifts)
            if items is not None:  # the Trainer's loss is this rank's sum over every rank's items, x world
                sched.__dict__.setdefault("_fed_items", []).append(
                    (loss.detach() * num / trainer.args.world_size, items)
                )
            else:
                sched.__dict__.setdefault("_fed", []).append(loss.detach())
        return loss

    def create_scheduler(num_training_steps: int, optimizer: Any = None) -> Any:
        if trainer.lr_scheduler is None:
            trainer.lr_scheduler = _hdet_for(
                trainer.args,
                optimizer if optimizer is not None else trainer.optimizer,
                trainer.model,
                num_training_steps,
                hdet_kwargs,
            )
            trainer._created_lr_scheduler = True
        return trainer.lr_scheduler

    callback = _TrackingCallback(trainer, track, log_every, compare_group, hdet_kwargs.get("run_name"))
    original_train = trainer.train

    def train(*args: Any, **kwargs: Any) -> Any:
        callback.began = False
        try:
            return original_train(*args, **kwargs)
        except BaseException as exc:
            try:
                callback.on_failure(exc)
            except Exception:  # noqa: BLE001 - never hide the training's own exception
                logger.warning("hdet-track: could not end the run FAILED:\n%s", traceback.format_exc())
            raise

    trainer.training_step = training_step
    trainer.create_scheduler = create_scheduler
    trainer.train = train
    trainer.add_callback(callback)
    return trainer


def _peak_lrs(optimizer: Any) -> float | list[float]:
    """Each param group's peak, as Hugging Face's own schedulers scale each group's own LR (the
    Trainer's optimizer gives every group ``args.learning_rate``; one the user built, its own):
    the ``max_lr`` a scheduler like this one left in the group (an earlier ``train()`` on the same
    optimizer), else the ``initial_lr`` of the Trainer's scheduler, else its ``lr``. One number when
    every group has the same."""
    peaks = [float(g.get("max_lr", g.get("initial_lr", g["lr"]))) for g in optimizer.param_groups]
    return peaks[0] if len(set(peaks)) == 1 else peaks


def _hdet_for(args: Any, optimizer: Any, model: Any, num_training_steps: int, hdet_kwargs: dict) -> _LossFedScheduler:
    warmup = args.get_warmup_steps(num_training_steps) if hasattr(args, "get_warmup_steps") else 0
    pct = warmup / num_training_steps if warmup else 0.3
    kwargs = dict(hdet_kwargs)
    kwargs.setdefault("model", model)
    return _LossFedScheduler(
        optimizer,
        max_lr=_peak_lrs(optimizer),
        total_steps=num_training_steps,
        # at least 2 steps: OneCycleLR's warm-up ends at step pct_start * total_steps - 1, and one that
        # ends at step 0 divides by zero (a 1-step warm-up, or max_steps of 2 or 3 without one)
        pct_start=float(min(max(pct, 2.0 / num_training_steps), 0.99)),
        cycle_momentum=False,
        close_at_end=False,
        **kwargs,
    )


def _check_schedule_choice(args: Any) -> None:
    """HDET's OneCycle-shaped schedule takes the place of the scheduler the Trainer would make: a
    schedule chosen in the arguments is refused, not dropped in silence (as Lightning's integration
    refuses a scheduler other than OneCycleLR)."""
    kind = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    if kind != "linear":
        raise ValueError(
            f"Expected lr_scheduler_type='linear' (the Trainer's default) with HDET, but got {kind!r}: HDET's "
            "OneCycle-shaped schedule takes the scheduler's place (warmup_steps still sets its ramp-up); leave "
            "lr_scheduler_type at its default"
        )
    if getattr(args, "lr_scheduler_kwargs", None):
        raise ValueError(
            f"Expected no lr_scheduler_kwargs with HDET, but got {args.lr_scheduler_kwargs!r}: HDET's OneCycle-shaped "
            "schedule takes the scheduler's place and would ignore them"
        )


def _made_by_the_trainer(lr_scheduler: Any) -> bool:
    """Whether ``lr_scheduler`` is one the Trainer made from its arguments (Hugging Face's schedules
    are LambdaLRs of functions in ``transformers``), not one given in ``optimizers=``."""
    lambdas = getattr(lr_scheduler, "lr_lambdas", None)
    return bool(lambdas) and all(
        str(getattr(getattr(f, "func", f), "__module__", "")).startswith("transformers.") for f in lambdas
    )


def _check_callback_form(args: Any, lr_scheduler: Any) -> None:
    """What the callback form cannot do (``hdet_track.wrap(trainer)`` can): a clear error at once."""
    if getattr(args, "label_smoothing_factor", 0):
        raise ValueError(
            f"Expected label_smoothing_factor=0 with HDETTrainerCallback, but got {args.label_smoothing_factor}: "
            "the Trainer then computes the loss itself and the model's output (which the callback reads) has "
            "none; use hdet_track.wrap(trainer), which takes the loss the Trainer computes"
        )
    _check_schedule_choice(args)  # ReduceLROnPlateau and GreedyLR too (stepped only after evaluations)
    if lr_scheduler is not None and not _made_by_the_trainer(lr_scheduler):
        raise ValueError(
            f"Expected a Trainer that makes its own scheduler (HDET takes its place), but it was given "
            f"{type(lr_scheduler).__name__} in optimizers=(optimizer, lr_scheduler): pass optimizers=(optimizer, None)"
        )


class HDETTrainerCallback(TrainerCallback):
    """The callback form: ``Trainer(..., callbacks=[HDETTrainerCallback(spread=0.3, ...)])``.

    At the start of training it puts an ``HDETScheduler`` in charge of the optimizer's learning
    rates (the Trainer's own scheduler object is kept, but its ``step`` and ``get_last_lr`` now
    drive and report HDET), and takes each optimizer step's training loss from the model's output
    (``outputs.loss``, as Hugging Face models return when given labels). ``hdet_track.wrap(trainer)``
    does the same without relying on the model's output, and also ends the run FAILED when
    ``train()`` raises: a callback never sees that exception (Hugging Face has no exception
    callback), so in this form a run that reached its last step ends FINISHED (at the next
    ``train()``, ``callback.scheduler.close()`` or the process's exit) even when ``train()`` raised.
    """

    def __init__(
        self, *, track: Any = True, log_every: int = 1, compare_group: str | None = None, **hdet_kwargs: Any
    ) -> None:
        taken = ("track", "log_every", "compare_group", "close_at_end")
        check_hdet_kwargs(
            "HDETTrainerCallback", hdet_kwargs, taken=taken, log_every=log_every, compare_group=compare_group
        )
        self.track = track
        self.log_every = log_every
        self.compare_group = compare_group
        self.hdet_kwargs = hdet_kwargs
        self.scheduler: _LossFedScheduler | None = None
        self._hook: Any = None
        self._mlflow_opened = False  # Hugging Face's MLflow callback opened a run at an earlier train()

    def on_train_begin(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: Any = None,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        **kwargs: Any,
    ) -> None:
        if self._hook is not None:  # the previous train() raised before on_train_end
            self._hook.remove()
            self._hook = None
        _check_callback_form(args, lr_scheduler)
        if self.scheduler is not None:
            self.scheduler.close()  # the previous train()'s run, left open for final metrics
        sched = _hdet_for(args, optimizer, model, state.max_steps, self.hdet_kwargs)
        self.scheduler = sched
        saved = lr_scheduler.__dict__.pop(_STATE_KEY, None) if lr_scheduler is not None else None
        if saved is not None:  # resume_from_checkpoint: the Trainer loaded its scheduler.pt, HDET's inside
            sched.load_state_dict(saved)
        elif state.global_step > 0:
            raise ValueError(_NOT_HDET.format(step=state.global_step))
        sched._no_loss_hint = (
            "Expected the model's output to hold the training loss (outputs.loss, as Hugging Face models "
            "return when given labels), which HDETTrainerCallback reads, but this step's had none (a "
            "compute_loss_func, or a model that returns a tuple without a loss?): use hdet_track.wrap(trainer), "
            "which takes the loss the Trainer computes"
        )

        shifts = _shifts_labels(model)

        def capture(module: Any, inputs: Any, kwargs: Any, output: Any) -> None:
            loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
            if not module.training or not isinstance(loss, torch.Tensor):
                return
            num = kwargs.get("num_items_in_batch")
            items = (
                _items(kwargs.get("labels"), kwargs.get("shift_labels"), shifts) if _across_ranks(args, num) else None
            )
            if items is not None:  # normalised by every rank's items: this rank's sum, and its own count
                sched.__dict__.setdefault("_fed_items", []).append((loss.detach() * num, items))
            elif num is not None:  # normalised by the optimizer step's item count: summed, as the Trainer does
                world = args.world_size if _across_ranks(args, num) else 1  # (and scaled as it scales it)
                sched.__dict__.setdefault("_fed", []).append(loss.detach() * world)
            else:
                sched.__dict__.setdefault("_fed_mean", []).append(loss.detach())

        self._hook = model.register_forward_hook(capture, with_kwargs=True)
        if lr_scheduler is not None:
            _drive(lr_scheduler, sched)
        tracker = _report_tracker(args, self.track, sched._resumed_runs, again=self._mlflow_opened)
        self._mlflow_opened = self._mlflow_opened or _mlflow_open(args)
        if tracker not in (False, None):
            run_name = self.hdet_kwargs.get("run_name") or args.run_name
            sched.start_tracking(tracker, log_every=self.log_every, compare_group=self.compare_group, run_name=run_name)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.scheduler is not None:
            self.scheduler.drop_pending()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.scheduler is not None:
            before_pause(args, control, self.scheduler)

    on_epoch_end = on_step_end

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.scheduler is not None and state.global_step > 0:
            after_evaluation(args, self.scheduler)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.scheduler is not None:
            end_of_training(self.scheduler)
