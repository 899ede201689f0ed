"""Data: built-in corpus, token files and their errors, deterministic batching, global arrays."""

import dataclasses
import sysconfig
import zlib
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from parallax.config import Config, DataConfig, TrainConfig
from parallax.train.data import (
    Batcher,
    DataError,
    load_token_file,
    make_global_batch,
    open_data,
    process_rows,
    split_batch,
    stdlib_files,
    stdlib_tokens,
)

B, T = 8, 16


def _batcher(n=10_000, seed=0, **kw):
    return Batcher(np.arange(n, dtype=np.uint32), B, T, seed, "test tokens", **kw)


# ----------------------------------------------------------------------------------------------
# Batching


def test_step_fixes_the_batch():
    a, b = _batcher(), _batcher()  # two instances: no hidden state carries between calls
    assert np.array_equal(a.batch_rows(3), b.batch_rows(3))
    assert not np.array_equal(a.batch_rows(3), a.batch_rows(4))
    assert not np.array_equal(a.batch_rows(3), _batcher(seed=1).batch_rows(3))
    assert not np.array_equal(a.batch_rows(3), _batcher(stream=1).batch_rows(3))


def test_rows_are_contiguous_windows():
    rows = _batcher().batch_rows(0)
    assert rows.shape == (B, T + 1) and rows.dtype == np.int32
    # tokens are arange, so a window is its start plus 0..T
    assert np.array_equal(rows, rows[:, :1] + np.arange(T + 1))
    assert rows.min() >= 0 and rows.max() <= 10_000 - 1
    batch = split_batch(rows)
    assert np.array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    assert batch["inputs"].shape == batch["targets"].shape == (B, T)


def test_offsets_reach_both_ends():
    # len - (T+1) = 1: the only starts are 0 and 1, and both must occur
    batcher = Batcher(np.arange(T + 2, dtype=np.uint16), 64, T, 0, "tiny")
    assert set(batcher.offsets(0).tolist()) == {0, 1}


def test_row_subset_equals_slice_of_full_batch():
    batcher = _batcher()
    full = batcher.batch_rows(7)
    assert np.array_equal(batcher.batch_rows(7, slice(2, 6)), full[2:6])
    assert np.array_equal(batcher.batch_rows(7, range(4, 8)), full[4:8])
    assert np.array_equal(batcher.batch_rows(7, np.array([0, 1, 6, 7])), full[[0, 1, 6, 7]])


class _Spy:
    """A 1-D token array that records which positions were read."""

    def __init__(self, a):
        self.a, self.shape, self.read = a, a.shape, set()

    def __len__(self):
        return len(self.a)

    def __getitem__(self, idx):
        self.read.update(np.asarray(idx).ravel().tolist())
        return self.a[idx]


def test_row_subset_reads_only_its_rows():
    tokens = np.arange(100_000, dtype=np.uint32)
    spy = _Spy(tokens)
    batcher = Batcher(spy, B, T, 0, "spy")
    off = batcher.offsets(5)
    batcher.batch_rows(5, slice(0, 2))
    assert spy.read == {int(o) + j for o in off[:2] for j in range(T + 1)}


# ----------------------------------------------------------------------------------------------
# Built-in corpus


def test_stdlib_corpus():
    train, val = stdlib_tokens()
    assert train.dtype == val.dtype == np.uint8
    assert train.size > 1_000_000 and val.size > 10_000
    assert b"def " in train[:200_000].tobytes()
    assert stdlib_tokens()[0] is train  # cached: loaded once per process
    assert not train.flags.writeable  # callers cannot corrupt the cache


def test_stdlib_split_is_by_file():
    train_files, val_files = stdlib_files()
    assert not set(train_files) & set(val_files)
    assert not any(part in ("site-packages", "dist-packages") for p in train_files + val_files for part in p.parts)
    root = Path(sysconfig.get_paths()["stdlib"])
    for files, want in ((train_files, False), (val_files, True)):
        assert all((zlib.crc32(p.relative_to(root).as_posix().encode()) % 20 == 0) == want for p in files)
    train, val = stdlib_tokens()
    assert train.size == sum(p.stat().st_size for p in train_files)
    assert val.size == sum(p.stat().st_size for p in val_files)


# ----------------------------------------------------------------------------------------------
# Token files


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_round_trip(tmp_path, dtype):
    ids = np.random.default_rng(0).integers(0, 1000, size=1000).astype(dtype)
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    train, val = load_token_file(path, dtype, 1000, 0.1)
    assert isinstance(train, np.memmap) and train.dtype == np.dtype(dtype)
    assert np.array_equal(np.concatenate([train, val]), ids)
    assert len(val) == 100  # the last tenth is validation
    batcher = Batcher(train, 4, 8, 0, "t")
    rows = batcher.batch_rows(0)
    assert rows.dtype == np.int32
    assert np.array_equal(rows, ids[batcher.offsets(0)[:, None] + np.arange(9)].astype(np.int32))


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"data file '.*nope\.bin' does not exist"):
        load_token_file(tmp_path / "nope.bin", "uint16", 256, 0.1)


def test_size_not_multiple_of_dtype(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x00" * 1001)
    with pytest.raises(DataError, match=r"'.*odd\.bin': size 1001 bytes is not a multiple of uint16 \(2 bytes\)"):
        load_token_file(path, "uint16", 256, 0.1)
    path.write_bytes(b"\x00" * 1002)
    with pytest.raises(DataError, match=r"1002 bytes is not a multiple of uint32 \(4 bytes\)"):
        load_token_file(path, "uint32", 256, 0.1)


def test_id_out_of_vocab(tmp_path, monkeypatch):
    monkeypatch.setattr("parallax.train.data._SCAN_CHUNK", 64)  # the bad id sits in a later chunk
    ids = np.zeros(1000, np.uint16)
    ids[700] = 300
    path = tmp_path / "big.bin"
    ids.tofile(path)
    with pytest.raises(DataError, match=r"'.*big\.bin' holds token id 300 >= model.vocab_size=256 \(at token 700"):
        load_token_file(path, "uint16", 256, 0.1)
    load_token_file(path, "uint16", 301, 0.1)  # in range: no error


def test_file_too_short(tmp_path):
    path = tmp_path / "short.bin"
    np.arange(100, dtype=np.uint16).tofile(path)
    cfg = Config(data=DataConfig(source=str(path), val_fraction=0.5), train=TrainConfig(seq_len=49))
    train, val = open_data(cfg)  # 50 and 50 tokens: exactly one window of 50 each
    assert len(train.tokens) == len(val.tokens) == 50
    assert np.array_equal(train.batch_rows(0)[0], np.arange(50))
    with pytest.raises(DataError, match=r"short\.bin' \(train split\): 50 tokens is too short .*train\.seq_len\+1=51"):
        open_data(dataclasses.replace(cfg, train=TrainConfig(seq_len=50)))


def test_validation_split_too_short(tmp_path):
    path = tmp_path / "short.bin"
    np.arange(100, dtype=np.uint16).tofile(path)
    cfg = Config(data=DataConfig(source=str(path), val_fraction=0.1), train=TrainConfig(seq_len=16))
    with pytest.raises(DataError, match=r"short\.bin' \(validation split.*\): 10 tokens is too short"):
        open_data(cfg)
    path.write_bytes(b"")
    with pytest.raises(DataError, match=r"short\.bin' is empty"):
        open_data(cfg)


def test_open_data_stdlib_streams_differ():
    cfg = Config(train=TrainConfig(global_batch=B, seq_len=T))
    train, val = open_data(cfg)
    assert train.tokens is stdlib_tokens()[0] and val.tokens is stdlib_tokens()[1]
    assert (train.seed, train.stream) != (val.seed, val.stream)  # independent window draws
    assert "validation" in val.name and "train" in train.name
    assert train.batch_rows(0).shape == val.batch_rows(0).shape == (B, T + 1)
    assert train.batch_rows(0).max() < 256


# ----------------------------------------------------------------------------------------------
# Global arrays


def test_make_global_batch_on_mesh():
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sharding = NamedSharding(mesh, P(("data",), None))
    batcher = _batcher()
    batch = make_global_batch(batcher, 11, sharding)
    want = split_batch(batcher.batch_rows(11))
    for key in ("inputs", "targets"):
        arr = batch[key]
        assert arr.shape == (B, T) and arr.dtype == np.int32 and arr.sharding == sharding
        assert np.array_equal(np.asarray(arr), want[key])
        assert len(arr.addressable_shards) == 8
        for shard in arr.addressable_shards:
            assert shard.data.shape == (B // 4, T)  # 4-way over data, replicated over tensor
            assert np.array_equal(np.asarray(shard.data), want[key][shard.index])


class _FakeSharding:
    """What a process sees of a batch split 4 ways when it holds blocks 3 and 1 (out of order)."""

    def addressable_devices_indices_map(self, shape):
        return {"d0": (slice(6, 8), slice(None)), "d1": (slice(2, 4), slice(None)), "d2": (slice(6, 8), slice(None))}


def test_process_rows():
    assert np.array_equal(process_rows(_FakeSharding(), (B, T)), [2, 3, 6, 7])
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    assert np.array_equal(process_rows(NamedSharding(mesh, P()), (B, T)), np.arange(B))
