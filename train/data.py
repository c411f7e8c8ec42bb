"""The input pipeline: datasets, a train/eval split, resumable batch iterators and a prefetcher.

Everything here runs on the host in numpy; nothing depends on the models. The pieces:

- Real data that ships with installed packages: `load_digits` (scikit-learn's 1,797 8x8 digits) and
  `load_text` (Python's own ``pydoc_data.topics``, about 465k characters, as bytes).
- A user's data on disk: `load_npz_images` and `load_text_file`; a file that cannot be trained on
  raises `DataError`, whose one-line message names the file, what is wrong and what is expected.
- Synthetic data for throughput runs: `synthetic_images` and `synthetic_tokens`.
- `split`, a seeded train/eval split.
- `Batches` (arrays) and `TextBatches` (windows of a token stream, next-token or masked-LM
  targets). Each one's position is a small state (`state()` / `restore()`), and a run resumed from
  a saved state sees exactly the batches of a run that was never interrupted. With several
  processes, every process computes the same global batch and keeps its own slice of it.
- `prefetch`, a background thread that keeps a few batches ready (optionally already on device).

A training loop::

    data = load_digits()
    train_data, eval_data = split(data, eval_fraction=0.2, seed=0)
    batches = prefetch(Batches(train_data, batch_size=128, seed=0), put=jax.device_put)
    for step in range(num_steps):
        state, metrics = train_step(state, next(batches))
    save_checkpoint(..., data_state=batches.state())   # the position after the batches consumed
"""

from __future__ import annotations

import operator
import os
import queue
import threading
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Mapping
from os import PathLike
from typing import Any
from typing import NamedTuple

import numpy as np

BYTE_VOCAB = 256
"""The vocabulary of byte-level text: every token is one byte of the UTF-8 encoding."""

IMAGE_KEYS = ("image", "images", "x")
LABEL_KEYS = ("label", "labels", "y")


# Real data that ships with installed packages.


def load_digits() -> dict[str, np.ndarray]:
    """scikit-learn's handwritten digits: 1,797 grey 8x8 images in 10 classes.

    Returns:
        ``{"image": float32[1797, 8, 8, 1] in [0, 1], "label": int32[1797] in [0, 10)}``.

    >>> data = load_digits()
    >>> data["image"].shape, data["image"].dtype, data["label"].dtype
    ((1797, 8, 8, 1), dtype('float32'), dtype('int32'))
    """
    from sklearn.datasets import load_digits as sk_load_digits

    digits = sk_load_digits()
    images_Nx8x8x1 = (digits.images / 16.0).astype(np.float32)[..., None]  # pixels are 0..16
    return {"image": images_Nx8x8x1, "label": digits.target.astype(np.int32)}


def load_text() -> np.ndarray:
    """Python's own reference documentation (``pydoc_data.topics``) as a byte-level token stream.

    The topics are joined in the module's order, about 465k characters of English prose and code,
    and encoded as UTF-8 bytes (vocabulary `BYTE_VOCAB`; `decode` turns tokens back into text).

    Returns:
        ``uint8[T]``.

    >>> tokens = load_text()
    >>> tokens.dtype, len(tokens) > 400_000
    (dtype('uint8'), True)
    """
    from pydoc_data.topics import topics

    return encode("".join(topics.values()))


def encode(text: str) -> np.ndarray:
    """Encodes text as byte-level tokens (``uint8``, the UTF-8 bytes).

    >>> encode("héllo").tolist()
    [104, 195, 169, 108, 108, 111]
    """
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


def decode(tokens: Iterable[int] | np.ndarray) -> str:
    """Decodes byte-level tokens to text; bytes that are not valid UTF-8 become U+FFFD.

    >>> decode(encode("héllo"))
    'héllo'
    """
    return np.asarray(tokens, dtype=np.uint8).tobytes().decode("utf-8", errors="replace")


# A user's data on disk.


class DataError(ValueError):
    """A data file that cannot be trained on: missing, unreadable, corrupt, or holding the wrong
    arrays. The message is one line, ``<file>: <what is wrong>; <what is expected>``."""


NPZ_EXPECTED = ("a .npz archive with images under 'image' ([N, H, W] or [N, H, W, C], uint8 "
                "pixels or floats) and integer labels under 'label' ([N], 0 to num_classes - 1), "
                "saved with np.savez(path, image=images, label=labels)")
TEXT_EXPECTED = "a UTF-8 text file to train on"


def load_npz_images(path: str | PathLike[str],
                    num_classes: int | None = None) -> dict[str, np.ndarray]:
    """Loads images and integer labels from a ``.npz`` archive.

    The images are the array named ``image``, ``images`` or ``x`` (the first found), shaped
    ``[N, H, W]`` or ``[N, H, W, C]``, with finite values; ``uint8`` pixels are scaled to [0, 1],
    any other real dtype is cast to float32 unchanged. The labels are the integer array named
    ``label``, ``labels`` or ``y``, shaped ``[N]``, with class ids in ``[0, num_classes)``; without
    ``num_classes`` they only need to be non-negative (the number of classes is then
    ``labels.max() + 1``). Labels stored as floats are refused, even whole ones. The archive is
    read without pickle (``allow_pickle=False``), so object arrays are refused too.

    Returns:
        ``{"image": float32[N, H, W, C], "label": int32[N]}``.

    Raises:
        DataError: (a ``ValueError``) the file is missing, a directory, empty, not a ``.npz``
            archive, truncated or corrupt, lacks one of the two arrays (the message lists the
            arrays it has), or their shapes, dtypes or values do not fit. The message names the
            file, what is wrong and what is expected.

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "data.npz")
    >>> np.savez(path, x=np.zeros((5, 28, 28), np.uint8), y=np.arange(5))
    >>> {k: v.shape for k, v in load_npz_images(path).items()}
    {'image': (5, 28, 28, 1), 'label': (5,)}
    """
    if num_classes is not None:
        _check_positive(num_classes=num_classes)
    name = os.fspath(path)
    head = _read_file(path, NPZ_EXPECTED, size=6)
    if not head:
        raise DataError(f"{name}: is empty (0 bytes); expected {NPZ_EXPECTED}")
    if head.startswith(b"\x93NUMPY"):
        raise DataError(f"{name}: holds a single array (a .npy file), not a .npz archive; "
                        f"expected {NPZ_EXPECTED}")
    if not head.startswith(b"PK"):  # every zip file, and so every .npz, starts with "PK"
        raise DataError(f"{name}: is not a .npz archive (a .npz is a zip file, and this is not "
                        f"one); expected {NPZ_EXPECTED}")
    # Our own handle, closed on every path: numpy leaves a member's file to the garbage collector
    # when reading it raises (an object array), which would warn about an unclosed file.
    with open(path, "rb") as fid:
        try:
            archive = np.load(fid, allow_pickle=False)
        except MemoryError:
            raise
        except Exception as e:  # zipfile.BadZipFile, EOFError, OSError, ValueError, zlib.error
            raise _corrupt(name, e) from e
        with archive:
            image_key, label_key = _npz_keys(archive, name)
            images = _read_member(archive, image_key, name)
            labels = _read_member(archive, label_key, name)
    if images.ndim == 3:
        images = images[..., None]
    if images.ndim != 4:
        raise DataError(f"{name}: images {image_key!r} have shape {images.shape}; expected "
                        "[N, H, W] or [N, H, W, C]")
    if not (np.issubdtype(images.dtype, np.integer) or np.issubdtype(images.dtype, np.floating)
            or images.dtype == np.bool_):
        raise DataError(f"{name}: images {image_key!r} are {images.dtype}; expected real numbers "
                        "(uint8 pixels 0-255, or floats)")
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"{name}: labels {label_key!r} are {labels.dtype}{list(labels.shape)}"
                        f"{_label_hint(labels)}; expected one integer class per image, "
                        "shaped [N]")
    if len(labels) != len(images):
        raise DataError(f"{name}: {len(images)} images {image_key!r} but {len(labels)} labels "
                        f"{label_key!r}; expected one label per image")
    if images.size == 0:
        raise DataError(f"{name}: images {image_key!r} have shape {images.shape}, no pixels; "
                        "expected at least one image of at least 1x1 pixels")
    if images.dtype == np.uint8:
        images = images.astype(np.float32) / 255.0
    images = images.astype(np.float32)
    finite = np.isfinite(images)
    if not finite.all():
        first = int(np.argmin(finite.reshape(len(images), -1).all(axis=1)))
        raise DataError(f"{name}: images {image_key!r} hold {int(finite.size - finite.sum())} "
                        f"values that are inf or nan in float32, the first in image {first}; "
                        "expected finite pixel values")
    lowest, highest = int(labels.min()), int(labels.max())
    limit = 2**31 - 1 if num_classes is None else num_classes
    if lowest < 0:
        raise DataError(f"{name}: labels {label_key!r} include {lowest} ({int((labels < 0).sum())}"
                        f" of {len(labels)} are negative); expected class ids in "
                        f"[0, {'num_classes' if num_classes is None else num_classes})")
    if highest >= limit:
        raise DataError(f"{name}: labels {label_key!r} go up to {highest}, outside "
                        f"num_classes={limit}; expected class ids in [0, {limit})")
    return {"image": images, "label": labels.astype(np.int32)}


def load_text_file(path: str | PathLike[str]) -> np.ndarray:
    """Loads a UTF-8 text file as byte-level tokens (``uint8``, the file's bytes, vocabulary 256).

    Raises:
        DataError: (a ``ValueError``) the file is missing, a directory, empty or not UTF-8.

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "corpus.txt")
    >>> with open(path, "w", encoding="utf-8") as f:
    ...     _ = f.write("hello")
    >>> load_text_file(path).tolist()
    [104, 101, 108, 108, 111]
    """
    name = os.fspath(path)
    raw = _read_file(path, TEXT_EXPECTED)
    if not raw:
        raise DataError(f"{name}: is empty; expected {TEXT_EXPECTED}")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{name}: is not UTF-8 text (byte {e.start} is 0x{raw[e.start]:02x}, "
                        f"which UTF-8 does not allow there); expected {TEXT_EXPECTED}") from None
    return np.frombuffer(raw, dtype=np.uint8).copy()


def _read_file(path: str | PathLike[str], expected: str, size: int = -1) -> bytes:
    """The first ``size`` bytes of ``path`` (all with -1), or a `DataError` saying why not."""
    name = os.fspath(path)
    if os.path.isdir(path):
        raise DataError(f"{name}: is a directory; expected {expected}")
    try:
        with open(path, "rb") as f:
            return f.read(size)
    except FileNotFoundError:
        raise DataError(f"{name}: no such file; expected {expected}") from None
    except OSError as e:
        raise DataError(f"{name}: cannot be read ({e.strerror or e}); expected {expected}") \
            from None


def _read_member(archive: Any, key: str, name: str) -> np.ndarray:
    try:
        return archive[key]
    except MemoryError:
        raise
    except ValueError as e:
        if "allow_pickle" not in str(e):
            raise _corrupt(name, e) from e
        raise DataError(f"{name}: array {key!r} holds Python objects (dtype=object), which "
                        "are not loaded because that takes pickle; expected numeric arrays, e.g. "
                        "np.savez(path, image=np.asarray(images, np.float32), "
                        "label=np.asarray(labels, np.int64))") from None
    except Exception as e:  # zipfile.BadZipFile (a bad CRC), zlib.error, EOFError, ...
        raise _corrupt(name, e) from e


def _npz_keys(archive: Any, name: str) -> tuple[str, str]:
    """The archive's image and label keys, or a `DataError` naming what is missing."""
    image_key = next((k for k in IMAGE_KEYS if k in archive), None)
    label_key = next((k for k in LABEL_KEYS if k in archive), None)
    if image_key is None or label_key is None:
        missing = [f"{what} under one of {', '.join(map(repr, keys))}"
                   for what, key, keys in (("images", image_key, IMAGE_KEYS),
                                           ("labels", label_key, LABEL_KEYS)) if key is None]
        raise DataError(f"{name}: has arrays {sorted(archive.keys())}; expected "
                        f"{' and '.join(missing)}. Save them with "
                        "np.savez(path, image=images, label=labels)")
    return image_key, label_key


def _corrupt(name: str, e: BaseException) -> DataError:
    reason = " ".join(str(e).split())[:120]
    return DataError(f"{name}: is truncated or corrupt ({type(e).__name__}: {reason}); expected "
                     "a complete .npz archive: write it again with np.savez")


def _label_hint(labels: np.ndarray) -> str:
    """Why labels of the wrong shape or dtype are wrong, beyond their dtype and shape."""
    if labels.ndim == 2 and labels.shape[1] > 1:
        return " (one-hot? save labels.argmax(axis=1))"
    if labels.ndim == 2 and labels.shape[1] == 1:
        return " (save labels.reshape(-1))"
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.floating) or not labels.size:
        return ""
    fractional = labels[~np.isfinite(labels) | (labels != np.round(labels))]
    if fractional.size:
        return f" and include {fractional[0]}, not a class id"
    return ", whole numbers stored as floats (save them with labels.astype(np.int64))"


# Synthetic data for throughput runs.


def synthetic_images(n: int, shape: tuple[int, ...] = (32, 32, 3), num_classes: int = 10,
                     seed: int = 0) -> dict[str, np.ndarray]:
    """Uniform random images in [0, 1) with uniform random labels.

    Returns:
        ``{"image": float32[n, *shape], "label": int32[n] in [0, num_classes)}``.

    >>> data = synthetic_images(4, (224, 224, 3), num_classes=1000)
    >>> data["image"].shape, data["label"].dtype
    ((4, 224, 224, 3), dtype('int32'))
    """
    _check_positive(n=n, num_classes=num_classes)
    rng = np.random.default_rng(seed)
    return {"image": rng.random((n, *shape), dtype=np.float32),
            "label": rng.integers(0, num_classes, n, dtype=np.int32)}


def synthetic_tokens(n: int, seq_len: int, vocab: int = BYTE_VOCAB, seed: int = 0) -> np.ndarray:
    """``n`` sequences of ``seq_len`` uniform random tokens in [0, vocab).

    `TextBatches` reads a 2-D array as one stream, row after row.

    Returns:
        ``int32[n, seq_len]``.

    >>> synthetic_tokens(8, 128, vocab=30522).shape
    (8, 128)
    """
    _check_positive(n=n, seq_len=seq_len, vocab=vocab)
    return np.random.default_rng(seed).integers(0, vocab, (n, seq_len), dtype=np.int32)


# Train/eval split.


def split(arrays: Mapping[str, np.ndarray], eval_fraction: float,
          seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Splits examples at random into a train and an eval set.

    ``round(eval_fraction * N)`` examples go to eval, the rest to train; the two are disjoint,
    each keeps the original order of its examples, and the same seed gives the same split.

    Returns:
        ``(train, eval)``, dicts with the keys of ``arrays``.

    >>> train, held_out = split({"x": np.arange(10)}, eval_fraction=0.3, seed=0)
    >>> train["x"].tolist(), held_out["x"].tolist()
    ([0, 1, 3, 5, 7, 8, 9], [2, 4, 6])
    """
    arrays = {k: np.asarray(v) for k, v in arrays.items()}
    n = _num_examples(arrays)
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction={eval_fraction!r}; expected a fraction in (0, 1)")
    n_eval = round(eval_fraction * n)
    if not 0 < n_eval < n:
        raise ValueError(f"eval_fraction={eval_fraction} of {n} examples leaves "
                         f"{n - n_eval} for train and {n_eval} for eval; both need at least one")
    order = np.random.default_rng(seed).permutation(n)
    eval_idx, train_idx = np.sort(order[:n_eval]), np.sort(order[n_eval:])
    return ({k: v[train_idx] for k, v in arrays.items()},
            {k: v[eval_idx] for k, v in arrays.items()})


# Batch iterators.


class BatchesState(NamedTuple):
    """The position of a `Batches`: the next batch is batch ``batch_index`` of epoch ``epoch``."""

    epoch: int
    batch_index: int


class TextBatchesState(NamedTuple):
    """The position of a `TextBatches`: the number of batches drawn so far."""

    step: int


class Batches(Iterator[dict[str, np.ndarray]]):
    """Batches of a dict of arrays, reshuffled every epoch, with a resumable position.

    Epoch ``e`` visits the examples in the order ``np.random.default_rng((seed, e)).permutation(N)``
    (the original order with ``shuffle=False``), ``batch_size`` at a time. With
    ``drop_remainder=True`` every batch is full and the last ``N % batch_size`` examples of each
    epoch's order are skipped; with ``drop_remainder=False`` the last batch of an epoch holds
    them. The iterator runs for ``num_epochs`` epochs, or forever.

    The position is ``state()``, a `BatchesState` ``(epoch, batch_index)``; an iterator built with
    ``state=`` (or `restore`) yields the same batches, bit for bit, as the one it was taken from.

    With ``process_count`` processes, every process computes the same global batch of
    ``batch_size`` examples and yields rows ``[p * b, (p + 1) * b)`` of it, where ``p`` is
    ``process_index`` and ``b = batch_size // process_count``; the processes' batches,
    concatenated in process order, are the single-process batch. Both default to
    ``jax.process_index()`` and ``jax.process_count()`` (0 and 1 without jax).

    Args:
        arrays: a dict of arrays with the same leading dimension ``N``, e.g.
            ``{"image": ..., "label": ...}``; every batch is a dict with the same keys.
        batch_size: the global batch size, over all processes.
        seed: a non-negative integer seed for the shuffle.
        shuffle: reshuffle every epoch (``False``: the original order, e.g. for eval).
        drop_remainder: yield only full batches.
        num_epochs: stop after this many epochs (counted from epoch 0); ``None`` runs forever.
        process_index: this process's index.
        process_count: the number of processes sharing the global batch.
        state: the position to start from, as accepted by `restore`.

    Raises:
        ValueError: ``batch_size`` (or the last, partial batch of an epoch) does not split over
            ``process_count``, or an argument is out of range.

    >>> data = {"x": np.arange(10), "y": np.arange(10) % 2}
    >>> batches = Batches(data, batch_size=4, seed=0)
    >>> batches.steps_per_epoch
    2
    >>> saved = batches.state()
    >>> first = next(batches)
    >>> first["x"].shape, batches.state()
    ((4,), BatchesState(epoch=0, batch_index=1))
    >>> resumed = Batches(data, batch_size=4, seed=0, state=saved)
    >>> np.array_equal(next(resumed)["x"], first["x"])
    True
    >>> [b["x"].tolist() for b in Batches(data, 4, shuffle=False, drop_remainder=False,
    ...                                    num_epochs=1)]
    [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    """

    def __init__(self, arrays: Mapping[str, np.ndarray], batch_size: int, seed: int = 0, *,
                 shuffle: bool = True, drop_remainder: bool = True, num_epochs: int | None = None,
                 process_index: int | None = None, process_count: int | None = None,
                 state: Any = None):
        self._arrays = {k: np.asarray(v) for k, v in arrays.items()}
        self.num_examples = _num_examples(self._arrays)
        _check_positive(batch_size=batch_size)
        _check_seed(seed)
        if num_epochs is not None and num_epochs < 0:
            raise ValueError(f"num_epochs={num_epochs}; expected a non-negative count or None")
        if drop_remainder and batch_size > self.num_examples:
            raise ValueError(f"batch_size={batch_size} is larger than the {self.num_examples} "
                             "examples, so drop_remainder=True leaves no batch; use a smaller "
                             "batch_size or drop_remainder=False")
        self.process_index, self.process_count = _resolve_processes(process_index, process_count)
        _check_divisible(batch_size, self.process_count, "batch_size")
        remainder = self.num_examples % batch_size
        if not drop_remainder and remainder % self.process_count:
            raise ValueError(f"the last batch of each epoch holds {remainder} examples "
                             f"({self.num_examples} % batch_size={batch_size}), which do not split "
                             f"over process_count={self.process_count} processes; use "
                             "drop_remainder=True or a batch_size that divides the data evenly")
        self.batch_size = batch_size
        self.local_batch_size = batch_size // self.process_count
        self.seed = seed
        self.shuffle = shuffle
        self.drop_remainder = drop_remainder
        self.num_epochs = num_epochs
        self.steps_per_epoch = (self.num_examples // batch_size if drop_remainder
                                else -(-self.num_examples // batch_size))
        self._epoch, self._index = 0, 0
        self._order_epoch: int | None = None
        self._order = np.arange(0)
        if state is not None:
            self.restore(state)

    def state(self) -> BatchesState:
        """The position of the next batch, to save with a checkpoint."""
        return BatchesState(self._epoch, self._index)

    def restore(self, state: Any) -> None:
        """Moves to a saved position.

        Args:
            state: a `BatchesState`, an ``(epoch, batch_index)`` pair, a mapping with
                ``"epoch"`` and ``"batch_index"`` (as a checkpoint may restore it), or an integer
                number of batches from the start of epoch 0 (e.g. the train step). Numpy and jax
                integer scalars are accepted.
        """
        if isinstance(state, Mapping):
            epoch = _as_int(state["epoch"], "epoch")
            index = _as_int(state["batch_index"], "batch_index")
        elif isinstance(state, tuple | list):
            if len(state) != 2:
                raise ValueError(f"state={state!r}; expected (epoch, batch_index)")
            epoch, index = _as_int(state[0], "epoch"), _as_int(state[1], "batch_index")
        else:
            epoch, index = divmod(_as_int(state, "state"), self.steps_per_epoch)
        if epoch < 0 or not 0 <= index < self.steps_per_epoch:
            raise ValueError(f"state epoch={epoch}, batch_index={index} is out of range; expected "
                             f"epoch >= 0 and 0 <= batch_index < "
                             f"steps_per_epoch={self.steps_per_epoch}")
        self._epoch, self._index = epoch, index

    def __next__(self) -> dict[str, np.ndarray]:
        if self.num_epochs is not None and self._epoch >= self.num_epochs:
            raise StopIteration
        order = self._epoch_order(self._epoch)
        start = self._index * self.batch_size
        global_idx = order[start:start + self.batch_size]
        local = len(global_idx) // self.process_count
        idx = global_idx[self.process_index * local:(self.process_index + 1) * local]
        self._index += 1
        if self._index == self.steps_per_epoch:
            self._epoch, self._index = self._epoch + 1, 0
        return {k: v[idx] for k, v in self._arrays.items()}

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            self._order = (np.random.default_rng((self.seed, epoch)).permutation(self.num_examples)
                           if self.shuffle else np.arange(self.num_examples))
            self._order_epoch = epoch
        return self._order


class TextBatches(Iterator[dict[str, np.ndarray]]):
    """Random windows of a token stream, for next-token or masked-language-model training.

    Batch ``s`` draws ``batch_size`` window starts uniformly from
    ``np.random.default_rng((seed, s))``, so a batch depends only on the seed and its step: the
    position is that step (`TextBatchesState`), and resuming from it is exact.

    - Next-token (default): ``{"tokens": int32[B, L], "targets": int32[B, L]}``, where the targets
      are the tokens shifted by one (``targets[:, i]`` is the token after ``tokens[:, i]``).
    - ``mlm=True``, BERT's recipe: ``{"tokens", "targets", "mask"}``. In each window exactly
      ``max(1, round(mask_rate * L))`` positions are picked (``mask``, bool); 80% of them are
      replaced by ``mask_token`` in ``tokens``, 10% by a random token in ``[0, vocab_size)`` and
      10% left as they are. ``targets`` are the original tokens; the loss reads them where
      ``mask`` is set. Byte 0 (NUL) does not occur in text, so it is the default ``mask_token``
      for byte-level text.

    Multiple processes share each global batch as in `Batches`: each yields its rows
    ``[p * b, (p + 1) * b)``.

    Args:
        tokens: the token stream (a 2-D array is read row after row), e.g. `load_text()`.
        batch_size: the global batch size, over all processes.
        seq_len: the window length ``L``.
        seed: a non-negative integer seed.
        mlm: masked-language-model batches instead of next-token ones.
        mask_rate: the fraction of positions picked in each window (``mlm=True``).
        mask_token: the id that replaces picked tokens (``mlm=True``).
        vocab_size: random replacements are drawn from ``[0, vocab_size)`` (``mlm=True``).
        process_index: this process's index.
        process_count: the number of processes sharing the global batch.
        state: the position to start from, as accepted by `restore`.

    >>> batches = TextBatches(encode("abcdefghij"), batch_size=2, seq_len=4, seed=0)
    >>> batch = next(batches)
    >>> decode(batch["tokens"][0]), decode(batch["targets"][0])
    ('fghi', 'ghij')
    >>> batches.state()
    TextBatchesState(step=1)
    >>> mlm = next(TextBatches(load_text(), batch_size=8, seq_len=128, mlm=True))
    >>> mlm["mask"].sum(axis=1).tolist()
    [19, 19, 19, 19, 19, 19, 19, 19]
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int = 0, *,
                 mlm: bool = False, mask_rate: float = 0.15, mask_token: int = 0,
                 vocab_size: int = BYTE_VOCAB, process_index: int | None = None,
                 process_count: int | None = None, state: Any = None):
        self._tokens = np.asarray(tokens).reshape(-1)
        if not np.issubdtype(self._tokens.dtype, np.integer):
            raise ValueError(f"tokens are {self._tokens.dtype}; expected integer token ids")
        _check_positive(batch_size=batch_size, seq_len=seq_len)
        _check_seed(seed)
        window = seq_len if mlm else seq_len + 1  # next-token windows carry one extra target
        _check_window(self._tokens, window, seq_len)
        if mlm:
            if not 0.0 < mask_rate < 1.0:
                raise ValueError(f"mask_rate={mask_rate!r}; expected a fraction in (0, 1)")
            if not 0 <= mask_token < vocab_size:
                raise ValueError(f"mask_token={mask_token} is outside the vocabulary "
                                 f"[0, vocab_size={vocab_size})")
        self.process_index, self.process_count = _resolve_processes(process_index, process_count)
        _check_divisible(batch_size, self.process_count, "batch_size")
        self.batch_size = batch_size
        self.local_batch_size = batch_size // self.process_count
        self.seq_len = seq_len
        self.seed = seed
        self.mlm = mlm
        self.mask_rate = mask_rate
        self.mask_token = mask_token
        self.vocab_size = vocab_size
        self._window = window
        self._step = 0
        if state is not None:
            self.restore(state)

    def state(self) -> TextBatchesState:
        """The position of the next batch, to save with a checkpoint."""
        return TextBatchesState(self._step)

    def restore(self, state: Any) -> None:
        """Moves to a saved position: a `TextBatchesState`, a 1-tuple, a mapping with ``"step"``,
        or an integer step."""
        if isinstance(state, Mapping):
            step = _as_int(state["step"], "step")
        elif isinstance(state, tuple | list):
            if len(state) != 1:
                raise ValueError(f"state={state!r}; expected (step,)")
            step = _as_int(state[0], "step")
        else:
            step = _as_int(state, "state")
        if step < 0:
            raise ValueError(f"state step={step}; expected a non-negative step")
        self._step = step

    def __next__(self) -> dict[str, np.ndarray]:
        rng = np.random.default_rng((self.seed, self._step))
        self._step += 1
        B, L = self.batch_size, self.seq_len
        starts_B = rng.integers(0, len(self._tokens) - self._window + 1, B)
        rows = slice(self.process_index * self.local_batch_size,
                     (self.process_index + 1) * self.local_batch_size)
        windows_bxW = self._tokens[starts_B[rows, None] + np.arange(self._window)].astype(np.int32)
        if not self.mlm:
            return {"tokens": windows_bxW[:, :-1], "targets": windows_bxW[:, 1:]}
        # The random draws cover the global batch, so that every process sees the same ones.
        num_masked = max(1, round(self.mask_rate * L))
        picked_BxK = np.argsort(rng.random((B, L)), axis=1)[:, :num_masked]
        mask_BxL = np.zeros((B, L), dtype=bool)
        np.put_along_axis(mask_BxL, picked_BxK, True, axis=1)
        action_BxL = rng.random((B, L))
        random_BxL = rng.integers(0, self.vocab_size, (B, L), dtype=np.int32)
        mask_bxL, action_bxL, random_bxL = mask_BxL[rows], action_BxL[rows], random_BxL[rows]
        tokens_bxL = windows_bxW.copy()
        tokens_bxL[mask_bxL & (action_bxL < 0.8)] = self.mask_token
        replace_bxL = mask_bxL & (action_bxL >= 0.8) & (action_bxL < 0.9)
        tokens_bxL[replace_bxL] = random_bxL[replace_bxL]
        return {"tokens": tokens_bxL, "targets": windows_bxW, "mask": mask_bxL}


def text_windows(tokens: np.ndarray, batch_size: int, seq_len: int) -> list[dict[str, np.ndarray]]:
    """Every next-token target of a token stream once: the stream cut into consecutive windows of
    ``seq_len + 1`` tokens that overlap by one (window ``i`` starts at ``i * seq_len``), as
    ``{"tokens", "targets"}`` batches of ``batch_size`` windows, the last batch holding the rest.
    The final ``< seq_len`` targets that fill no window are left out.

    The eval of the whole held-out split (``eval_batches=0``): no draw, the same batches for any
    seed, every target weighted alike.

    >>> batches = text_windows(encode("abcdefghij"), batch_size=2, seq_len=3)
    >>> [[decode(t) for t in b["targets"]] for b in batches]
    [['bcd', 'efg'], ['hij']]
    """
    stream = np.asarray(tokens).reshape(-1)
    _check_positive(batch_size=batch_size, seq_len=seq_len)
    _check_window(stream, seq_len + 1, seq_len)
    count = (len(stream) - 1) // seq_len
    windows_NxW = stream[np.arange(count)[:, None] * seq_len + np.arange(seq_len + 1)]
    windows_NxW = windows_NxW.astype(np.int32)
    return [{"tokens": w[:, :-1], "targets": w[:, 1:]}
            for w in np.split(windows_NxW, range(batch_size, count, batch_size))]


# Prefetching.

_ITEM, _END, _ERROR = range(3)


class Prefetcher(Iterator[Any]):
    """Iterates over another iterator that a daemon thread runs ahead; see `prefetch`."""

    def __init__(self, iterator: Iterable[Any], size: int = 2, *,
                 put: Callable[[Any], Any] | None = None):
        _check_positive(size=size)
        state_fn = getattr(iterator, "state", None)
        self._state_fn = state_fn if callable(state_fn) else None
        self._state = self._state_fn() if self._state_fn is not None else None
        self._queue: queue.Queue[tuple[int, Any, Any]] = queue.Queue(maxsize=size)
        self._stop = threading.Event()
        self._done = False
        # The thread holds no reference to self, so an abandoned prefetcher is collected and
        # its __del__ stops the thread.
        self._thread = threading.Thread(
            target=_produce, args=(iter(iterator), put, self._state_fn, self._queue, self._stop),
            name="prefetch", daemon=True)
        self._thread.start()

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        kind, value, state = self._queue.get()
        if kind == _ITEM:
            self._state = state
            return value
        self._done = True
        self._stop.set()
        if kind == _ERROR:
            raise value
        raise StopIteration

    def state(self) -> Any:
        """The wrapped iterator's ``state()`` after the last batch taken from the prefetcher.

        The thread runs ahead, so the wrapped iterator's own state is up to ``size + 1`` batches
        further; this is the position to checkpoint.
        """
        if self._state_fn is None:
            raise TypeError("the prefetched iterator has no state() method to track")
        return self._state

    def close(self) -> None:
        """Stops the thread and waits for it to finish the batch it is producing, if any.

        The wrapped iterator is then no longer touched, and further ``next`` calls stop.
        """
        self._done = True
        self._stop.set()
        while True:  # unblock a producer waiting for room in the queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()


def prefetch(iterator: Iterable[Any], size: int = 2, *,
             put: Callable[[Any], Any] | None = None) -> Prefetcher:
    """Runs ``iterator`` in a background thread that keeps ``size`` batches ready.

    Batches come out in the iterator's order. ``put`` is applied to each batch in the thread, e.g.
    ``jax.device_put``, ``jaxamp.parallel.put_sharded``, or, with several processes,
    ``lambda b: jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), b)``.
    An exception raised by the iterator or by ``put`` is raised by the ``next`` call that reaches
    it. `Prefetcher.state` gives the wrapped iterator's position after the batches taken so far.
    ``close()`` (or a ``with`` block) stops the thread; a prefetcher that is dropped stops it too.

    Args:
        iterator: any iterable, e.g. a `Batches`.
        size: the number of batches kept ready.
        put: a function applied to each batch in the background thread.

    >>> batches = prefetch(Batches({"x": np.arange(6)}, 2, shuffle=False), size=2)
    >>> [next(batches)["x"].tolist() for _ in range(2)], batches.state()
    ([[0, 1], [2, 3]], BatchesState(epoch=0, batch_index=2))
    >>> batches.close()
    """
    return Prefetcher(iterator, size, put=put)


def _produce(iterator: Iterator[Any], put: Callable[[Any], Any] | None,
             state_fn: Callable[[], Any] | None, q: queue.Queue[tuple[int, Any, Any]],
             stop: threading.Event) -> None:
    try:
        while not stop.is_set():
            try:
                item = next(iterator)
            except StopIteration:
                _offer(q, stop, (_END, None, None))
                return
            if put is not None:
                item = put(item)
            state = state_fn() if state_fn is not None else None
            if not _offer(q, stop, (_ITEM, item, state)):
                return
    except BaseException as e:  # handed to the consumer, which raises it
        _offer(q, stop, (_ERROR, e, None))


def _offer(q: queue.Queue[tuple[int, Any, Any]], stop: threading.Event,
           message: tuple[int, Any, Any]) -> bool:
    """Puts ``message`` on the queue unless stopped first; returns whether it was put."""
    while not stop.is_set():
        try:
            q.put(message, timeout=0.05)
            return True
        except queue.Full:
            pass
    return False


# Helpers.


def _num_examples(arrays: Mapping[str, np.ndarray]) -> int:
    if not isinstance(arrays, Mapping) or not arrays:
        raise ValueError(f"expected a non-empty dict of arrays, e.g. {{'image': ..., 'label': ...}}"
                         f"; got {type(arrays).__name__}")
    lengths = {k: np.shape(v)[0] if np.ndim(v) else None for k, v in arrays.items()}
    if len(set(lengths.values())) != 1 or None in lengths.values():
        raise ValueError(f"arrays have leading dimensions {lengths}; expected one example per "
                         "row, the same number in every array")
    n = int(np.shape(next(iter(arrays.values())))[0])
    if n == 0:
        raise ValueError("arrays hold no examples")
    return n


def _resolve_processes(process_index: int | None, process_count: int | None) -> tuple[int, int]:
    if process_index is None or process_count is None:
        try:
            import jax
        except ImportError:
            default_index, default_count = 0, 1
        else:
            default_index, default_count = jax.process_index(), jax.process_count()
        process_index = default_index if process_index is None else process_index
        process_count = default_count if process_count is None else process_count
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index}, process_count={process_count}; "
                         "expected process_count >= 1 and 0 <= process_index < process_count")
    return process_index, process_count


def _check_divisible(batch_size: int, process_count: int, name: str) -> None:
    if batch_size % process_count:
        multiple = -(-batch_size // process_count) * process_count
        raise ValueError(f"{name}={batch_size} does not split over process_count={process_count} "
                         f"processes; the global batch size must be a multiple of {process_count} "
                         f"(e.g. {multiple})")


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if operator.index(value) < 1:
            raise ValueError(f"{name}={value}; expected a positive integer")


def _check_window(stream: np.ndarray, window: int, seq_len: int) -> None:
    if len(stream) < window:
        raise ValueError(f"the stream has {len(stream)} tokens, fewer than a window of "
                         f"{window} (seq_len={seq_len}); use a shorter seq_len")


def _check_seed(seed: int) -> None:
    if operator.index(seed) < 0:
        raise ValueError(f"seed={seed}; expected a non-negative integer")


def _as_int(value: Any, name: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}={value!r}; expected an integer") from None
