"""The input pipeline: shipped and user data, the split, resumable and sharded batch iterators,
and the prefetcher."""

import doctest
import gc
import itertools
import sys
import threading

import jax
import numpy as np
import pytest
from helpers import assert_tree_bitwise_equal

from train import data as D

# --------------------------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------------------------


def test_load_digits():
    digits = D.load_digits()
    assert set(digits) == {"image", "label"}
    image, label = digits["image"], digits["label"]
    assert image.shape == (1797, 8, 8, 1) and image.dtype == np.float32
    assert label.shape == (1797,) and label.dtype == np.int32
    assert image.min() == 0.0 and image.max() == 1.0
    assert np.array_equal(np.unique(label), np.arange(10))
    # Pixel values are sixteenths.
    np.testing.assert_array_equal(image * 16, np.round(image * 16))


def test_load_text():
    from pydoc_data.topics import topics

    tokens = D.load_text()
    text = "".join(topics.values())
    assert tokens.dtype == np.uint8 and tokens.ndim == 1
    assert len(text) > 400_000 and len(tokens) >= len(text)
    assert int(tokens.max()) < D.BYTE_VOCAB
    assert int(tokens.min()) > 0  # no NUL byte, so 0 is free as the mask token
    assert D.decode(tokens) == text


def test_encode_decode():
    assert D.encode("aé€").tolist() == [97, 0xC3, 0xA9, 0xE2, 0x82, 0xAC]
    assert D.decode(D.encode("aé€")) == "aé€"
    assert D.decode([0xFF]) == "\ufffd"


@pytest.mark.parametrize("image_key,label_key", [("image", "label"), ("images", "labels"),
                                                 ("x", "y")])
def test_load_npz_images(tmp_path, image_key, label_key):
    path = tmp_path / "data.npz"
    pixels = np.array([[[0, 255], [51, 102]], [[255, 0], [0, 0]], [[1, 2], [3, 4]]], np.uint8)
    np.savez(path, **{image_key: pixels, label_key: np.array([2, 0, 1], np.int64)})
    loaded = D.load_npz_images(path)
    assert loaded["image"].shape == (3, 2, 2, 1) and loaded["image"].dtype == np.float32
    np.testing.assert_array_equal(loaded["image"][0, :, :, 0],
                                  np.array([[0, 1], [0.2, 0.4]], np.float32))
    assert loaded["label"].dtype == np.int32 and loaded["label"].tolist() == [2, 0, 1]


def test_load_npz_images_keeps_float_images(tmp_path):
    path = tmp_path / "data.npz"
    images = np.random.default_rng(0).normal(size=(4, 3, 3, 2))
    np.savez(path, image=images, label=np.arange(4))
    np.testing.assert_array_equal(D.load_npz_images(path)["image"], images.astype(np.float32))


def test_load_npz_images_errors(tmp_path):
    path = tmp_path / "data.npz"
    np.savez(path, pixels=np.zeros((2, 4, 4)), targets=np.zeros(2, int))
    with pytest.raises(ValueError, match=r"has arrays \['pixels', 'targets'\]; expected images "
                                         r"under one of 'image', 'images', 'x' and labels"):
        D.load_npz_images(path)
    np.savez(path, image=np.zeros((2, 4, 4)), targets=np.zeros(2, int))
    with pytest.raises(ValueError, match=r"\['image', 'targets'\]; expected labels under one of "
                                         r"'label', 'labels', 'y'\. Save"):
        D.load_npz_images(path)
    np.savez(path, image=np.zeros((2, 4, 4)), label=np.zeros(3, int))
    with pytest.raises(ValueError, match="2 images 'image' but 3 labels 'label'"):
        D.load_npz_images(path)
    np.savez(path, image=np.zeros((2, 4, 4)), label=np.zeros(2))
    with pytest.raises(ValueError, match="labels 'label' are float64"):
        D.load_npz_images(path)
    np.savez(path, image=np.zeros((2, 4)), label=np.zeros(2, int))
    with pytest.raises(ValueError, match=r"shape \(2, 4\); expected \[N, H, W\]"):
        D.load_npz_images(path)
    np.save(tmp_path / "single.npy", np.zeros(3))
    with pytest.raises(ValueError, match="not a .npz archive"):
        D.load_npz_images(tmp_path / "single.npy")


def test_load_text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("naïve\n", encoding="utf-8")
    tokens = D.load_text_file(path)
    assert tokens.dtype == np.uint8 and D.decode(tokens) == "naïve\n"
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        D.load_text_file(tmp_path / "empty.txt")


def test_synthetic():
    images = D.synthetic_images(6, (5, 5, 3), num_classes=7, seed=1)
    assert images["image"].shape == (6, 5, 5, 3) and images["image"].dtype == np.float32
    assert 0.0 <= images["image"].min() and images["image"].max() < 1.0
    assert images["label"].dtype == np.int32 and set(images["label"]) <= set(range(7))
    assert_tree_bitwise_equal(images, D.synthetic_images(6, (5, 5, 3), num_classes=7, seed=1))
    tokens = D.synthetic_tokens(4, 16, vocab=50, seed=1)
    assert tokens.shape == (4, 16) and tokens.dtype == np.int32
    assert 0 <= tokens.min() and tokens.max() < 50
    np.testing.assert_array_equal(tokens, D.synthetic_tokens(4, 16, vocab=50, seed=1))
    assert not np.array_equal(tokens, D.synthetic_tokens(4, 16, vocab=50, seed=2))
    with pytest.raises(ValueError, match="vocab=0; expected a positive integer"):
        D.synthetic_tokens(4, 16, vocab=0)


# --------------------------------------------------------------------------------------------
# Split
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,fraction,n_eval", [(1797, 0.2, 359), (10, 0.3, 3), (100, 0.29, 29),
                                               (7, 0.5, 4), (3, 0.01, None)])
def test_split(n, fraction, n_eval):
    arrays = {"id": np.arange(n), "sq": np.arange(n) ** 2}
    if n_eval is None:
        with pytest.raises(ValueError, match="both need at least one"):
            D.split(arrays, fraction)
        return
    train, eval_ = D.split(arrays, fraction, seed=3)
    assert len(eval_["id"]) == n_eval and len(train["id"]) == n - n_eval
    assert not set(train["id"]) & set(eval_["id"])
    assert sorted([*train["id"], *eval_["id"]]) == list(range(n))
    for part in (train, eval_):
        np.testing.assert_array_equal(part["sq"], part["id"] ** 2)  # rows stay together
        assert np.all(np.diff(part["id"]) > 0)
    assert_tree_bitwise_equal((train, eval_), D.split(arrays, fraction, seed=3))
    # The eval set is the first n_eval of the seed's permutation.
    expected = np.sort(np.random.default_rng(3).permutation(n)[:n_eval])
    np.testing.assert_array_equal(eval_["id"], expected)
    if n > 10:
        assert not np.array_equal(eval_["id"], D.split(arrays, fraction, seed=4)[1]["id"])


def test_split_errors():
    with pytest.raises(ValueError, match=r"eval_fraction=1\.0; expected a fraction in \(0, 1\)"):
        D.split({"x": np.arange(4)}, 1.0)
    with pytest.raises(ValueError, match="leading dimensions"):
        D.split({"x": np.arange(4), "y": np.arange(5)}, 0.5)


# --------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------

ONE = {"process_index": 0, "process_count": 1}


def _ids(n):
    ids = np.arange(n, dtype=np.int32)
    return {"id": ids, "x": ids.astype(np.float32)[:, None] * np.array([1, -1], np.float32)}


def test_batches_exact_order():
    batches = D.Batches(_ids(10), 3, seed=5, **ONE)
    assert batches.steps_per_epoch == 3 and batches.local_batch_size == 3
    got = [next(batches)["id"] for _ in range(7)]
    for epoch in (0, 1):
        order = np.random.default_rng((5, epoch)).permutation(10)
        for i in range(3):
            np.testing.assert_array_equal(got[3 * epoch + i], order[3 * i:3 * i + 3])
    np.testing.assert_array_equal(got[6], np.random.default_rng((5, 2)).permutation(10)[:3])
    assert batches.state() == D.BatchesState(epoch=2, batch_index=1)


def test_batches_visit_every_example_once_per_epoch():
    batches = D.Batches(_ids(10), 4, seed=0, drop_remainder=False, num_epochs=3, **ONE)
    assert batches.steps_per_epoch == 3
    got = list(batches)
    assert [len(b["id"]) for b in got] == [4, 4, 2] * 3
    epochs = [np.concatenate([b["id"] for b in got[3 * e:3 * e + 3]]) for e in range(3)]
    for ids in epochs:
        assert sorted(ids) == list(range(10))
    assert not np.array_equal(epochs[0], epochs[1])
    for b in got:
        np.testing.assert_array_equal(b["x"][:, 0], b["id"])  # the fields stay aligned
        assert b["x"].dtype == np.float32
    with pytest.raises(StopIteration):
        next(batches)


def test_batches_drop_remainder_and_no_shuffle():
    got = list(D.Batches(_ids(10), 4, shuffle=False, num_epochs=2, **ONE))
    assert [b["id"].tolist() for b in got] == [[0, 1, 2, 3], [4, 5, 6, 7]] * 2
    dropped = list(D.Batches(_ids(10), 4, seed=1, num_epochs=1, **ONE))
    assert len(dropped) == 2 and all(len(b["id"]) == 4 for b in dropped)
    assert len(set(np.concatenate([b["id"] for b in dropped]))) == 8


def test_batches_images():
    digits = D.load_digits()
    batch = next(D.Batches(digits, 32, seed=0, **ONE))
    assert set(batch) == {"image", "label"}
    assert batch["image"].shape == (32, 8, 8, 1) and batch["image"].dtype == np.float32
    assert batch["label"].shape == (32,) and batch["label"].dtype == np.int32


@pytest.mark.parametrize("stop", [0, 1, 2, 3, 4, 7])
@pytest.mark.parametrize("drop_remainder", [True, False])
def test_batches_resume_is_bitwise_identical(stop, drop_remainder):
    make = lambda state=None: D.Batches(_ids(11), 4, seed=9, drop_remainder=drop_remainder,
                                        state=state, **ONE)
    reference = [next(b) for b in [make()] for _ in range(10)]  # crosses several epochs
    interrupted = make()
    for _ in range(stop):
        next(interrupted)
    saved = interrupted.state()
    # As a checkpoint may hand the state back: a tuple, a dict of numpy scalars, the step.
    steps = stop
    for state in (saved, tuple(saved), {"epoch": np.int32(saved.epoch),
                                         "batch_index": np.asarray(saved.batch_index)}, steps):
        resumed = make(state)
        assert resumed.state() == saved
        assert_tree_bitwise_equal([next(resumed) for _ in range(10 - stop)], reference[stop:])
    restored = make()
    restored.restore(saved)
    assert_tree_bitwise_equal(next(restored), reference[stop])


def test_states_survive_an_orbax_checkpoint(tmp_path):
    import orbax.checkpoint as ocp

    batches = D.Batches(_ids(10), 4, seed=0, **ONE)
    text = D.TextBatches(np.arange(100), 2, 8, seed=0, **ONE)
    for _ in range(3):
        next(batches), next(text)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "data", {"batches": batches.state(), "text": text.state()})
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(tmp_path / "data")
    resumed = D.Batches(_ids(10), 4, seed=0, state=restored["batches"], **ONE)
    resumed_text = D.TextBatches(np.arange(100), 2, 8, seed=0, state=restored["text"], **ONE)
    assert resumed.state() == batches.state() == D.BatchesState(epoch=1, batch_index=1)
    assert resumed_text.state() == text.state() == D.TextBatchesState(step=3)
    assert_tree_bitwise_equal((next(resumed), next(resumed_text)), (next(batches), next(text)))


def test_batches_state_errors():
    batches = D.Batches(_ids(10), 4, **ONE)
    with pytest.raises(ValueError, match=r"batch_index=2 is out of range; expected epoch >= 0 "
                                         r"and 0 <= batch_index < steps_per_epoch=2"):
        batches.restore((0, 2))
    with pytest.raises(TypeError, match="epoch=1.5; expected an integer"):
        batches.restore((1.5, 0))
    with pytest.raises(ValueError, match="batch_size=11 is larger than the 10 examples"):
        D.Batches(_ids(10), 11, **ONE)


# --------------------------------------------------------------------------------------------
# Text batches
# --------------------------------------------------------------------------------------------


def test_text_batches_next_token():
    stream = np.arange(1000, dtype=np.int32)
    batch = next(D.TextBatches(stream, 8, 16, seed=2, **ONE))
    tokens, targets = batch["tokens"], batch["targets"]
    assert set(batch) == {"tokens", "targets"}
    assert tokens.shape == targets.shape == (8, 16)
    assert tokens.dtype == targets.dtype == np.int32
    starts = np.random.default_rng((2, 0)).integers(0, 1000 - 17 + 1, 8)
    np.testing.assert_array_equal(tokens, starts[:, None] + np.arange(16))
    np.testing.assert_array_equal(targets, tokens + 1)


def test_text_batches_on_shipped_text():
    text = D.load_text()
    batches = D.TextBatches(text, 4, 64, seed=0, **ONE)
    for _ in range(3):
        batch = next(batches)
        np.testing.assert_array_equal(batch["tokens"][:, 1:], batch["targets"][:, :-1])
        assert 0 <= batch["tokens"].min() and batch["tokens"].max() < D.BYTE_VOCAB
    # A 2-D array (synthetic rows) is one stream.
    rows = D.synthetic_tokens(4, 8, vocab=10)
    batch = next(D.TextBatches(rows, 2, 8, **ONE))
    assert batch["tokens"].shape == (2, 8)


def test_text_batches_mlm():
    text = D.load_text()
    batch = next(D.TextBatches(text, 64, 100, seed=1, mlm=True, **ONE))
    tokens, targets, mask = batch["tokens"], batch["targets"], batch["mask"]
    assert set(batch) == {"tokens", "targets", "mask"}
    assert tokens.shape == targets.shape == mask.shape == (64, 100)
    assert tokens.dtype == targets.dtype == np.int32 and mask.dtype == bool
    assert mask.sum(axis=1).tolist() == [15] * 64  # exactly 15% of every window
    np.testing.assert_array_equal(tokens[~mask], targets[~mask])
    assert not np.any(targets == 0)  # NUL never occurs in text: a 0 is a mask token
    masked = tokens[mask]
    as_mask_token = np.mean(masked == 0)
    kept = np.mean(masked == targets[mask])
    assert 0.75 < as_mask_token < 0.85 and 0.07 < kept < 0.15
    # The windows are contiguous runs of the text.
    start = int(np.flatnonzero(np.lib.stride_tricks.sliding_window_view(text, 100)
                               .__eq__(targets[0]).all(axis=1))[0])
    np.testing.assert_array_equal(text[start:start + 100], targets[0])


def test_text_batches_resume_is_bitwise_identical():
    for mlm in (False, True):
        make = lambda state=None, mlm=mlm: D.TextBatches(
            D.load_text(), 4, 32, seed=3, mlm=mlm, state=state, **ONE)
        reference = [next(b) for b in [make()] for _ in range(6)]
        interrupted = make()
        for _ in range(4):
            next(interrupted)
        assert interrupted.state() == D.TextBatchesState(step=4)
        for state in (interrupted.state(), {"step": np.int64(4)}, 4):
            resumed = make(state)
            assert_tree_bitwise_equal([next(resumed), next(resumed)], reference[4:6])


def test_text_batches_errors():
    with pytest.raises(ValueError, match=r"5 tokens, fewer than a window of 6 \(seq_len=5\)"):
        D.TextBatches(np.arange(5), 1, 5, **ONE)
    with pytest.raises(ValueError, match="expected integer token ids"):
        D.TextBatches(np.zeros(50), 1, 5, **ONE)
    with pytest.raises(ValueError, match=r"mask_token=300 is outside the vocabulary"):
        D.TextBatches(np.arange(50), 1, 5, mlm=True, mask_token=300, **ONE)


@pytest.mark.parametrize("n, batch_size, seq_len", [(500, 8, 12), (13, 2, 3), (7, 4, 6)])
def test_text_windows_predict_every_target_once_in_order(n, batch_size, seq_len):
    stream = (np.arange(n) * 7919) % 256  # distinct neighbours: a target's place is its token
    batches = D.text_windows(stream, batch_size, seq_len)
    tokens = np.concatenate([b["tokens"] for b in batches])
    targets = np.concatenate([b["targets"] for b in batches])
    count = (n - 1) // seq_len
    assert [len(b["tokens"]) for b in batches[:-1]] == [batch_size] * (len(batches) - 1)
    assert tokens.shape == targets.shape == (count, seq_len) and targets.dtype == np.int32
    # Targets 1 .. count * seq_len, each once and in order; each follows its own token.
    np.testing.assert_array_equal(targets.reshape(-1), stream[1:count * seq_len + 1])
    np.testing.assert_array_equal(tokens.reshape(-1), stream[:count * seq_len])
    assert_tree_bitwise_equal(batches, D.text_windows(stream, batch_size, seq_len))
    with pytest.raises(ValueError, match=r"fewer than a window of 13 \(seq_len=12\)"):
        D.text_windows(np.arange(12), 2, 12)


# --------------------------------------------------------------------------------------------
# Several processes
# --------------------------------------------------------------------------------------------

SHARDED = {
    "batches": lambda **kw: D.Batches(_ids(26), 8, seed=4, **kw),
    "batches_with_remainder": lambda **kw: D.Batches(_ids(26), 8, seed=4, drop_remainder=False,
                                                     **kw),
    "text": lambda **kw: D.TextBatches(np.arange(500), 8, 12, seed=4, **kw),
    "mlm": lambda **kw: D.TextBatches(D.load_text(), 8, 40, seed=4, mlm=True, **kw),
}


@pytest.mark.parametrize("kind,process_count", [
    *[(kind, count) for kind in SHARDED for count in (2, 4)
      if (kind, count) != ("batches_with_remainder", 4)],  # 26 % 8 = 2 does not split over 4
])
def test_process_slices_concatenate_to_the_global_batch(kind, process_count):
    make = SHARDED[kind]
    single = make(process_index=0, process_count=1)
    procs = [make(process_index=p, process_count=process_count) for p in range(process_count)]
    assert procs[0].local_batch_size == 8 // process_count
    for _ in range(9):  # over epoch boundaries
        expected = next(single)
        local = [next(p) for p in procs]
        for batch in local:
            assert {k: len(v) for k, v in batch.items()} == {
                k: len(v) // process_count for k, v in expected.items()}
        got = {k: np.concatenate([b[k] for b in local]) for k in expected}
        assert_tree_bitwise_equal(got, expected)
    assert all(p.state() == single.state() for p in procs)


def test_divisibility_errors():
    with pytest.raises(ValueError, match=r"batch_size=6 does not split over process_count=4 "
                                         r"processes; .* a multiple of 4 \(e\.g\. 8\)"):
        D.Batches(_ids(20), 6, process_index=0, process_count=4)
    with pytest.raises(ValueError, match="batch_size=6 does not split over process_count=4"):
        D.TextBatches(np.arange(100), 6, 4, process_index=1, process_count=4)
    with pytest.raises(ValueError, match=r"last batch of each epoch holds 2 examples .* "
                                         r"process_count=4"):
        D.Batches(_ids(26), 8, drop_remainder=False, process_index=0, process_count=4)
    with pytest.raises(ValueError, match="process_index=2, process_count=2"):
        D.Batches(_ids(20), 4, process_index=2, process_count=2)


def test_default_processes(monkeypatch):
    batches = D.Batches(_ids(8), 4)
    assert (batches.process_index, batches.process_count) == (0, 1)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    batches = D.Batches(_ids(8), 4, shuffle=False)
    assert next(batches)["id"].tolist() == [2, 3]
    monkeypatch.setitem(sys.modules, "jax", None)  # jax cannot be imported
    batches = D.TextBatches(np.arange(50), 4, 5)
    assert (batches.process_index, batches.process_count) == (0, 1)


# --------------------------------------------------------------------------------------------
# Prefetch
# --------------------------------------------------------------------------------------------


def _finishes(fn, timeout=10.0):
    """Runs fn in a daemon thread; whether it returned within the timeout."""
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    thread.join(timeout)
    return not thread.is_alive()


def test_prefetch_preserves_order():
    assert list(D.prefetch(range(200), size=3)) == list(range(200))
    assert list(D.prefetch(iter([]))) == []
    doubled = D.prefetch(range(5), size=1, put=lambda x: 2 * x)
    assert list(doubled) == [0, 2, 4, 6, 8]
    with pytest.raises(StopIteration):
        next(doubled)


def test_prefetch_batches_with_device_put():
    reference = list(D.Batches(_ids(10), 4, seed=0, num_epochs=3, **ONE))
    prefetched = list(D.prefetch(D.Batches(_ids(10), 4, seed=0, num_epochs=3, **ONE),
                                 put=jax.device_put))
    assert all(isinstance(b["id"], jax.Array) for b in prefetched)
    assert_tree_bitwise_equal(prefetched, reference)


def test_prefetch_state_is_the_consumed_position():
    make = lambda state=None: D.Batches(_ids(10), 4, seed=0, state=state, **ONE)
    reference = [next(b) for b in [make()] for _ in range(8)]
    with D.prefetch(make(), size=3) as batches:
        assert batches.state() == D.BatchesState(0, 0)
        consumed = [next(batches) for _ in range(3)]
        saved = batches.state()
    assert saved == D.BatchesState(epoch=1, batch_index=1)
    assert_tree_bitwise_equal(consumed, reference[:3])
    assert_tree_bitwise_equal([next(b) for b in [make(saved)] for _ in range(5)], reference[3:])
    with pytest.raises(TypeError, match="no state"):
        D.prefetch(range(3)).state()


def test_prefetch_propagates_exceptions():
    def producer():
        yield from range(3)
        raise RuntimeError("corrupt record")

    batches = D.prefetch(producer(), size=2)
    assert [next(batches) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="corrupt record"):
        next(batches)
    with pytest.raises(StopIteration):
        next(batches)

    def put(x):
        if x == 2:
            raise ValueError("cannot place batch 2")
        return x

    batches = D.prefetch(range(5), put=put)
    assert [next(batches), next(batches)] == [0, 1]
    with pytest.raises(ValueError, match="cannot place batch 2"):
        next(batches)


def test_prefetch_abandoned_midway_stops():
    produced = []

    def endless():
        for i in itertools.count():
            produced.append(i)
            yield i

    batches = D.prefetch(endless(), size=2)
    assert [next(batches), next(batches)] == [0, 1]
    assert _finishes(batches.close)
    assert not batches._thread.is_alive()
    count = len(produced)
    assert count <= 2 + 2 + 1  # taken, queued, and at most one in hand
    with pytest.raises(StopIteration):
        next(batches)
    assert len(produced) == count  # the iterator is no longer touched

    # Dropped without close: collected, and its thread ends.
    batches = D.prefetch(endless(), size=2)
    next(batches)
    thread = batches._thread
    del batches
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_prefetch_errors():
    with pytest.raises(ValueError, match="size=0; expected a positive integer"):
        D.prefetch(range(3), size=0)


# --------------------------------------------------------------------------------------------
# Docstring examples
# --------------------------------------------------------------------------------------------


def test_docstring_examples():
    results = doctest.testmod(D, optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    assert results.attempted > 20 and results.failed == 0
