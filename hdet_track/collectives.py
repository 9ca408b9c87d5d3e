"""A thin collective layer over ``torch.distributed``; no HDET logic.

Tensors are flattened into one buffer per (dtype, device) so that averaging costs one
``all_reduce`` per bucket instead of one per tensor. Without an initialised process group
everything is a no-op on a world of one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "world",
    "Bucket",
    "make_buckets",
    "buckets_finite",
    "average_buckets",
    "average_parameters",
    "all_gather_rows",
    "PendingRows",
    "start_gather_rows",
    "all_gather_objects",
    "relative_divergence",
]


def world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """``(rank, world_size)`` in ``group``; ``(0, 1)`` when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl" or "cuda" in str(backend):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class Bucket:
    """Tensors of one dtype and device and their flat copy."""

    tensors: list[torch.Tensor]
    flat: torch.Tensor

    def copy_back(self) -> None:
        offset = 0
        for t in self.tensors:
            n = t.numel()
            t.copy_(self.flat[offset : offset + n].view_as(t))
            offset += n


def make_buckets(tensors: Iterable[torch.Tensor]) -> list[Bucket]:
    """Group ``tensors`` by (dtype, device), skipping duplicates, bool tensors (masks: nothing to
    average) and expanded views (a stride of 0: one value shown many times, which cannot be written
    back), and flatten each group."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    seen: set[int] = set()
    for t in tensors:
        if id(t) in seen or t.numel() == 0 or t.dtype == torch.bool:
            continue
        if t.numel() > 1 and 0 in t.stride():
            continue
        seen.add(id(t))
        groups.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        return [Bucket(ts, torch.cat([t.detach().reshape(-1) for t in ts])) for ts in groups.values()]


def buckets_finite(buckets: Sequence[Bucket]) -> bool:
    """Whether every floating value in the buckets is finite."""
    for b in buckets:
        if b.flat.is_floating_point() or b.flat.is_complex():
            if not bool(torch.isfinite(b.flat).all()):
                return False
    return True


def average_buckets(
    buckets: Sequence[Bucket],
    group: dist.ProcessGroup | None = None,
    *,
    contribute: bool = True,
    num_contributors: int | None = None,
    measure: bool = False,
) -> tuple[float, float]:
    """Average the buckets over the ranks of ``group`` (one ``all_reduce`` each) and copy back.

    A rank with ``contribute=False`` sends zeros and receives the mean of the others
    (``num_contributors`` of them). Integer tensors are summed as int64 and averaged with floor
    division; float16 ones are summed in float32 (four values of 20,000 overflow float16's sum).

    Returns:
        With ``measure=True``, ``(distance_sq, mean_norm_sq)`` over the floating buckets:
        this rank's squared L2 distance to the average before averaging, and the
        average's squared norm; ``(0.0, 0.0)`` otherwise.
    """
    _, size = world(group)
    count = size if num_contributors is None else num_contributors
    if count < 1:
        raise ValueError(f"Expected num_contributors >= 1, but got {count}")
    dist_sq = 0.0
    norm_sq = 0.0
    with torch.no_grad():
        for b in buckets:
            floating = b.flat.is_floating_point() or b.flat.is_complex()
            measured = measure and b.flat.is_floating_point()
            local = b.flat.clone() if measured else b.flat
            if size > 1:
                work = b.flat  # the sum's own dtype where it cannot overflow (float32, bfloat16, int64)
                if b.flat.dtype == torch.float16:
                    work = b.flat.float()
                elif not floating and b.flat.dtype != torch.int64:
                    work = b.flat.long()
                if not contribute:
                    work.zero_()
                dist.all_reduce(work, op=dist.ReduceOp.SUM, group=group)
                if floating:
                    work.div_(count)
                else:
                    work.floor_divide_(count)
                if work is not b.flat:
                    b.flat.copy_(work)
            if measured:
                diff = local.double() - b.flat.double()
                dist_sq += float(torch.dot(diff, diff))
                norm_sq += float(torch.dot(b.flat.double(), b.flat.double()))
            b.copy_back()
    return dist_sq, norm_sq


def average_parameters(params: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None) -> None:
    """Average ``params`` (parameters or buffers) in place across ``group``.

    Example:
        >>> average_parameters(list(model.parameters()) + list(model.buffers()))
    """
    average_buckets(make_buckets(params), group)


def all_gather_rows(row: Sequence[float], group: dist.ProcessGroup | None = None) -> list[list[float]]:
    """Gather one row of floats from every rank (float64, one collective).

    Returns:
        ``rows[r]`` is rank r's row. Without a process group: ``[list(row)]``.
    """
    _, size = world(group)
    if size == 1:
        return [[float(x) for x in row]]
    local = torch.tensor([float(x) for x in row], dtype=torch.float64, device=_collective_device(group))
    out = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(out, local, group=group)
    return [t.cpu().tolist() for t in out]


class PendingRows:
    """An :func:`all_gather_rows` in flight (see :func:`start_gather_rows`)."""

    def __init__(self, work: dist.Work | None, out: list[torch.Tensor], rows: list[list[float]] | None = None) -> None:
        self._work = work
        self._out = out
        self._rows = rows

    def done(self) -> bool:
        """Whether :meth:`wait` returns without waiting."""
        return self._rows is not None or (self._work is not None and self._work.is_completed())

    def wait(self) -> list[list[float]]:
        """Wait for every rank's row: ``rows[r]`` is rank r's."""
        if self._rows is None:
            assert self._work is not None
            self._work.wait()
            self._rows = [t.cpu().tolist() for t in self._out]
        return self._rows


def start_gather_rows(row: Sequence[float], group: dist.ProcessGroup | None = None) -> PendingRows:
    """Start gathering one row of floats from every rank (``async_op``) and return at once: unlike a
    blocking collective, no rank waits for the slowest here (on an oversubscribed CPU that wait is a
    scheduler time slice). Every rank must call it at the same point, like :func:`all_gather_rows`;
    collectives issued later on the same group run after it."""
    _, size = world(group)
    if size == 1:
        return PendingRows(None, [], rows=[[float(x) for x in row]])
    local = torch.tensor([float(x) for x in row], dtype=torch.float64, device=_collective_device(group))
    out = [torch.empty_like(local) for _ in range(size)]
    return PendingRows(dist.all_gather(out, local, group=group, async_op=True), out)


def all_gather_objects(obj: object, group: dist.ProcessGroup | None = None) -> list[object]:
    """Gather one picklable object from every rank (``[obj]`` without a process group)."""
    _, size = world(group)
    if size == 1:
        return [obj]
    out: list[object] = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def relative_divergence(distance_sq: float, mean_norm_sq: float) -> float:
    """``||x_r - mean|| / ||mean||`` (inf for a zero mean with a nonzero distance, 0 for both zero)."""
    if mean_norm_sq > 0:
        return math.sqrt(distance_sq / mean_norm_sq)
    return 0.0 if distance_sq == 0 else math.inf
