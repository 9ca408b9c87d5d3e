"""The demo's training tasks on real, offline data: a model, its optimizer, batches and evaluation.

* ``digits``: scikit-learn's bundled 8x8 digits, an MLP (the embedded default).
* ``fashion-mnist``: the standard idx files, an MLP.
* ``text``: character-level language modelling on a text file (default: the Python standard
  library's own source files, present wherever Python is) with a small causal transformer;
  training and validation text are split by position.

Each task is a template for your own loop: ``task.model(seed)``, ``task.optimizer(params, lr)``,
``task.batch(generator, size)``, ``task.loss(outputs, targets)``, ``task.evaluate(model)``.
"""

from __future__ import annotations

import gzip
import math
import struct
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "DATASETS",
    "DataError",
    "ImageTask",
    "TextTask",
    "CharTransformer",
    "load_task",
    "stdlib_sources",
]

DATASETS = ("digits", "fashion-mnist", "text")
FASHION_DIRS = ("/usr/share/datasets/fashion-mnist",)


class DataError(ValueError):
    """A dataset could not be found or read."""


def _seeded(seed: int, build):
    """``build()`` under ``torch.manual_seed(seed)`` without disturbing the global RNG."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return build()
    finally:
        torch.random.set_rng_state(state)


# ---------------------------------------------------------------------- image classification
class ImageTask:
    """Classification of flat, standardised images with an MLP trained by SGD with Nesterov momentum."""

    kind = "image"

    def __init__(self, name: str, x_train, y_train, x_val, y_val) -> None:
        self.name = name
        self.x_train, self.y_train, self.x_val, self.y_val = x_train, y_train, x_val, y_val
        self.classes = int(y_train.max()) + 1

    def to(self, device: torch.device) -> ImageTask:
        for attr in ("x_train", "y_train", "x_val", "y_val"):
            setattr(self, attr, getattr(self, attr).to(device))
        return self

    def model(self, seed: int) -> nn.Module:
        inputs = self.x_train.shape[1]
        return _seeded(
            seed,
            lambda: nn.Sequential(
                nn.Linear(inputs, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, self.classes)
            ),
        )

    def optimizer(self, params, lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)

    def batch(self, generator: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(len(self.x_train), (size,), generator=generator).to(self.x_train.device)
        return self.x_train[idx], self.y_train[idx]

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, targets)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> tuple[float, float]:
        """(validation loss, accuracy) on the whole validation set; NaN loss if it is not finite."""
        logits = model(self.x_val)
        loss = float(F.cross_entropy(logits, self.y_val))
        acc = float((logits.argmax(1) == self.y_val).float().mean())
        return (loss if math.isfinite(loss) else math.nan), acc


def _read_idx(path: Path) -> torch.Tensor:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4:
        raise DataError(f"{path} is not an idx file (only {len(data)} bytes)")
    zero, dtype, ndim = struct.unpack_from(">HBB", data, 0)
    if zero != 0 or dtype != 0x08:
        raise DataError(f"{path} is not an idx file of unsigned bytes")
    dims = struct.unpack_from(">" + "I" * ndim, data, 4)
    payload = data[4 + 4 * ndim :]
    if len(payload) != math.prod(dims):
        raise DataError(f"{path} is truncated: {len(payload)} bytes for shape {tuple(dims)}")
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).reshape(dims)


def _find(directory: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz"):
        if (directory / name).exists():
            return directory / name
    raise DataError(f"missing {stem}[.gz] in {directory}")


def _fashion_mnist(data_dir: str | None) -> ImageTask:
    candidates = [Path(data_dir)] if data_dir else [Path(d) for d in FASHION_DIRS]
    for directory in candidates:
        if directory.is_dir():
            try:
                x_train = _read_idx(_find(directory, "train-images-idx3-ubyte")).float().reshape(-1, 784) / 255
                y_train = _read_idx(_find(directory, "train-labels-idx1-ubyte")).long()
                x_val = _read_idx(_find(directory, "t10k-images-idx3-ubyte")).float().reshape(-1, 784) / 255
                y_val = _read_idx(_find(directory, "t10k-labels-idx1-ubyte")).long()
            except (OSError, DataError) as exc:
                raise DataError(f"cannot read Fashion-MNIST from {directory}: {exc}") from None
            # One mean and deviation for every pixel (see digits.py: per-pixel deviations put rare
            # strokes on almost blank border pixels up to 280 deviations out)
            mean, std = x_train.mean(), x_train.std()
            return ImageTask("fashion-mnist", (x_train - mean) / std, y_train, (x_val - mean) / std, y_val)
    given = f"--data-dir {data_dir!r} is not a directory; " if data_dir else ""
    raise DataError(
        f"Fashion-MNIST not found: {given}pass --data-dir DIR with the four idx files, or install Debian's "
        "package (apt-get install dataset-fashion-mnist) which puts them under /usr/share/datasets/fashion-mnist"
    )


# ---------------------------------------------------------------------- character-level text
def stdlib_sources(max_chars: int = 2_000_000) -> str:
    """The Python standard library's top-level ``*.py`` files, in name order, up to ``max_chars``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    if not parts:
        raise DataError(f"no readable Python sources under {root}: pass --text-file FILE")
    return "".join(parts)[:max_chars]


class CharTransformer(nn.Module):
    """A small decoder-only transformer over characters (pre-norm blocks, causal attention)."""

    def __init__(self, vocab: int, context: int, width: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(context, width) * 0.02)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.position[: ids.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, w = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(att.transpose(1, 2).reshape(b, t, w))
        return h + self.mlp(self.norm2(h))


class TextTask:
    """Next-character prediction; the last ``val_fraction`` of the text (by position) is held out."""

    kind = "text"

    def __init__(self, text: str, source: str, context: int = 64, val_fraction: float = 0.1) -> None:
        if len(text) < 20 * context:
            raise DataError(
                f"{source} has {len(text)} characters; the text task needs at least {20 * context} "
                "(pass a longer --text-file)"
            )
        self.name, self.source, self.context = "text", source, context
        codes = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32).long()
        self.alphabet, ids = torch.unique(codes, return_inverse=True)
        self.vocab = len(self.alphabet)
        cut = int(len(ids) * (1 - val_fraction))
        self.train_ids, self.val_ids = ids[:cut], ids[cut:]

    def to(self, device: torch.device) -> TextTask:
        self.train_ids, self.val_ids = self.train_ids.to(device), self.val_ids.to(device)
        return self

    def model(self, seed: int) -> nn.Module:
        return _seeded(seed, lambda: CharTransformer(self.vocab, self.context))

    def optimizer(self, params, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.01)

    def _windows(self, ids: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        offsets = starts.to(ids.device)[:, None] + torch.arange(self.context + 1, device=ids.device)
        chunk = ids[offsets]
        return chunk[:, :-1], chunk[:, 1:]

    def batch(self, generator: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(len(self.train_ids) - self.context - 1, (size,), generator=generator)
        return self._windows(self.train_ids, starts)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))

    @torch.no_grad()
    def evaluate(self, model: nn.Module, windows: int = 128) -> tuple[float, float]:
        """(validation loss per character, next-character accuracy) on evenly spaced held-out windows."""
        last = len(self.val_ids) - self.context - 1
        starts = torch.linspace(0, last, min(windows, last + 1)).long()
        x, y = self._windows(self.val_ids, starts)
        logits = model(x)
        loss = float(self.loss(logits, y))
        acc = float((logits.argmax(-1) == y).float().mean())
        return (loss if math.isfinite(loss) else math.nan), acc


def _text(text_file: str | None) -> TextTask:
    if text_file is None:
        return TextTask(stdlib_sources(), "the Python standard library's sources")
    path = Path(text_file)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise DataError(f"cannot read --text-file {text_file}: {exc.strerror or exc}") from None
    return TextTask(text, str(path))


# ---------------------------------------------------------------------- entry point
def load_task(dataset: str, *, data_dir: str | None = None, text_file: str | None = None, seed: int = 0):
    """The task for ``dataset`` (one of ``DATASETS``); raises ``DataError`` naming what to do otherwise."""
    if dataset == "digits":
        from .digits import load_digits_split

        return ImageTask("digits", *load_digits_split(seed))
    if dataset == "fashion-mnist":
        return _fashion_mnist(data_dir)
    if dataset == "text":
        return _text(text_file)
    raise DataError(f"unknown dataset {dataset!r}: choose one of {', '.join(DATASETS)}")
