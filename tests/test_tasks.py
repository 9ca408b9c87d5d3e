"""The demo's tasks on real offline data: the text task's split, windows, causal model and learning;
data errors; the device choice (nccl only with one GPU per replica)."""

from __future__ import annotations

import gzip
import math
import struct

import pytest
import torch

from hdet_track.examples.ablation import AblationConfig, choose_device
from hdet_track.examples.tasks import DataError, TextTask, load_task, stdlib_sources


@pytest.fixture(scope="module")
def corpus() -> str:
    return stdlib_sources(max_chars=60_000)


def test_stdlib_corpus_is_real_python_source(corpus):
    assert len(corpus) == 60_000
    assert "def " in corpus and "import " in corpus


def test_text_split_is_by_position_and_decodes_back(corpus):
    task = TextTask(corpus, "stdlib", context=32, val_fraction=0.1)
    cut = int(len(corpus) * 0.9)
    decode = lambda ids: "".join(chr(int(task.alphabet[i])) for i in ids)  # noqa: E731
    assert len(task.train_ids) == cut and len(task.val_ids) == len(corpus) - cut
    assert decode(task.train_ids[:500]) == corpus[:500]
    assert decode(task.val_ids) == corpus[cut:]  # the held-out text is the tail, not a random sample
    assert task.vocab == len(set(corpus))


def test_text_batches_are_next_character_windows_from_the_training_text(corpus):
    task = TextTask(corpus, "stdlib", context=32)
    x, y = task.batch(torch.Generator().manual_seed(3), 8)
    assert x.shape == y.shape == (8, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one character
    train = task.train_ids.tolist()
    joined = ",".join(map(str, train))
    for row in torch.cat([x[:, :1], y], dim=1).tolist():
        assert ",".join(map(str, row)) in joined  # a contiguous run of the training text
    again, _ = task.batch(torch.Generator().manual_seed(3), 8)
    assert torch.equal(x, again)  # the data order is a function of the seed


def test_char_transformer_is_causal(corpus):
    task = TextTask(corpus, "stdlib", context=32)
    model = task.model(seed=0).eval()
    x, _ = task.batch(torch.Generator().manual_seed(0), 2)
    changed = x.clone()
    changed[:, -1] = (changed[:, -1] + 1) % task.vocab
    with torch.no_grad():
        a, b = model(x), model(changed)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])  # no position sees a later character
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_text_task_learns_on_the_stdlib_sources(corpus):
    torch.manual_seed(0)
    task = TextTask(corpus, "stdlib", context=32)
    model = task.model(seed=0)
    before, _ = task.evaluate(model)
    assert abs(before - math.log(task.vocab)) < 0.5  # an untrained model is near uniform
    opt = task.optimizer(model.parameters(), 3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(150):
        x, y = task.batch(gen, 16)
        loss = task.loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after, acc = task.evaluate(model)
    assert after < before - 1.0 and acc > 0.2


def test_same_seed_same_initial_weights_without_touching_the_global_rng(corpus):
    task = TextTask(corpus, "stdlib", context=32)
    state = torch.random.get_rng_state()
    a, b = task.model(seed=5), task.model(seed=5)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    c = task.model(seed=6)
    assert not torch.equal(next(a.parameters()), next(c.parameters()))


def test_text_errors_name_the_file_and_what_to_do(tmp_path):
    with pytest.raises(DataError, match="cannot read --text-file .*missing.txt"):
        load_task("text", text_file=str(tmp_path / "missing.txt"))
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(DataError, match=r"short.txt has 9 characters; .* at least 1280 .*--text-file"):
        load_task("text", text_file=str(short))
    with pytest.raises(DataError, match="unknown dataset 'cifar': choose one of digits, fashion-mnist, text"):
        load_task("cifar")


def test_truncated_idx_file_is_a_data_error(tmp_path):
    header = struct.pack(">HBBIII", 0, 8, 3, 10, 28, 28)
    for name, payload in [
        ("train-images-idx3-ubyte.gz", header + bytes(100)),
        ("train-labels-idx1-ubyte.gz", struct.pack(">HBBI", 0, 8, 1, 10) + bytes(10)),
        ("t10k-images-idx3-ubyte.gz", header + bytes(10 * 784)),
        ("t10k-labels-idx1-ubyte.gz", struct.pack(">HBBI", 0, 8, 1, 10) + bytes(10)),
    ]:
        with gzip.open(tmp_path / name, "wb") as f:
            f.write(payload)
    with pytest.raises(DataError, match=r"cannot read Fashion-MNIST .* truncated: 100 bytes for shape \(10, 28, 28\)"):
        load_task("fashion-mnist", data_dir=str(tmp_path))


@pytest.mark.parametrize(
    ("requested", "replicas", "gpus", "expected"),
    [
        ("auto", 4, 0, "cpu"),
        ("auto", 4, 2, "cpu"),  # nccl cannot put two ranks on one GPU: gloo on the CPU instead
        ("auto", 4, 4, "cuda"),
        ("auto", 2, 8, "cuda"),
        ("cpu", 2, 8, "cpu"),
        ("cuda", 2, 2, "cuda"),
    ],
)
def test_choose_device(requested, replicas, gpus, expected):
    assert choose_device(requested, replicas, gpus) == expected


def test_choose_device_errors():
    with pytest.raises(ValueError, match="one GPU per replica: 4 replicas but 1 GPU"):
        choose_device("cuda", 4, 1)
    with pytest.raises(ValueError, match="device to be one of auto, cpu, cuda, but got 'tpu'"):
        choose_device("tpu", 1, 0)


def test_dataset_defaults_for_learning_rates_and_batches():
    text = AblationConfig(dataset="text")
    assert (text.low_lr, text.high_lr, text.batch_size) == (2e-3, 2e-2, 16)
    digits = AblationConfig(dataset="digits", high_lr=0.8)
    assert (digits.low_lr, digits.high_lr, digits.batch_size) == (0.05, 0.8, 64)
    with pytest.raises(DataError, match="unknown dataset 'mnist'"):
        AblationConfig(dataset="mnist")


@pytest.mark.parametrize("seed", [0, 108])
def test_digits_split_is_standardised_without_outlying_pixels(seed):
    """Per-pixel scaling made a rare stroke on an always-blank border pixel 38 deviations out in
    training and 1,000 in validation (seed 108): one image's loss then outweighed a batch's."""
    task = load_task("digits", seed=seed)
    assert (len(task.x_train), len(task.x_val)) == (1438, 359)
    assert abs(float(task.x_train.mean())) < 1e-5 and float(task.x_train.std()) == pytest.approx(1.0, abs=1e-5)
    assert float(task.x_train.abs().max()) < 3 and float(task.x_val.abs().max()) < 3  # pixel values 0-16
    assert torch.equal(load_task("digits", seed=seed).x_val, task.x_val)  # the split is fixed by the seed


def test_fashion_mnist_scales_every_pixel_alike(tmp_path):
    """One mean and deviation for all pixels: a stroke on a pixel blank in every other training
    image stays a few deviations out (per-pixel scaling made it hundreds)."""
    rng = torch.Generator().manual_seed(0)
    train = torch.randint(0, 256, (50, 28, 28), generator=rng, dtype=torch.uint8)
    train[:, 0, 0] = 0
    train[7, 0, 0] = 255  # one stroke on an otherwise blank corner
    val = torch.randint(0, 256, (10, 28, 28), generator=rng, dtype=torch.uint8)
    val[3, 0, 0] = 255
    for name, array in [("train-images-idx3-ubyte", train), ("t10k-images-idx3-ubyte", val)]:
        (tmp_path / name).write_bytes(struct.pack(">HBBIII", 0, 8, 3, len(array), 28, 28) + array.numpy().tobytes())
    for name, n in [("train-labels-idx1-ubyte", 50), ("t10k-labels-idx1-ubyte", 10)]:
        (tmp_path / name).write_bytes(struct.pack(">HBBI", 0, 8, 1, n) + bytes(i % 10 for i in range(n)))
    task = load_task("fashion-mnist", data_dir=str(tmp_path))
    raw = train.reshape(50, -1).float() / 255
    mean, std = raw.mean(), raw.std()
    assert torch.allclose(task.x_train, (raw - mean) / std, atol=1e-5)
    assert torch.allclose(task.x_val, (val.reshape(10, -1).float() / 255 - mean) / std, atol=1e-5)
    assert float(task.x_train[7, 0]) < 3 and float(task.x_val[3, 0]) < 3
