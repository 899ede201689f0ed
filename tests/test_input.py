"""The grain input pipeline (train/input.py): records, the seeded shuffle, mixtures and their token
shares, prepared directories (eod_id, vocabulary), the prefetching feed, evaluation batches, and
exact resume across a kill -9 on 1 and 2 processes, read back from the batches the runs fed
(PARALLAX_INPUT_TRACE: a CRC-32 per row) and compared with an uninterrupted run's.

Tolerances: a mixture's token shares within 0.01 of its weights (the issue's 1%); every batch
compared exactly (its CRCs); losses of resumed steps bit-identical on the same mesh, rtol 1e-6
across process counts (tests/test_multihost.py's RTOL).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import signal
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

import test_multihost as mh
from parallax.cli import main
from parallax.config import (Config, ConfigError, DataConfig, ModelConfig, TrainConfig, apply_overrides, check_data,
                             check_types, load_experiment)
from parallax.train.data import DOC_KEYS, DataError, make_global_batch, split_batch
from parallax.train.input import TRACE_ENV, Feed, eval_batches, open_input, resolve_data, with_source
from parallax.train.prepare import PrepareError
from test_cli import QUICKSTART, TINY, _assert_one_error_line, _sets

T, B = 16, 8


def _cfg(*sets: str, vocab: int = 256) -> Config:
    cfg = Config(model=ModelConfig(vocab_size=vocab), train=TrainConfig(seq_len=T, global_batch=B, seed=3))
    return apply_overrides(cfg, list(sets))


def _token_file(path: Path, ids) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.asarray(ids, np.uint16).tofile(path)
    return str(path)


def _prepared(root: Path, docs: list[list[int]], val_docs: list[list[int]], vocab: int, eod: int,
              tokenizer: bytes = b'{"model": "hand-written"}') -> str:
    """A prepared directory written by hand in train/prepare.py's format (each document + eod)."""
    root.mkdir(parents=True)
    splits = {}
    for name, ds in (("train", docs), ("val", val_docs)):
        flat = [t for d in ds for t in (*d, eod)]
        np.asarray(flat, np.uint16).tofile(root / f"{name}.bin")
        np.save(root / f"{name}.docs.npy", np.cumsum([0] + [len(d) + 1 for d in ds]).astype(np.int64))
        splits[name] = {"file": f"{name}.bin", "docs": f"{name}.docs.npy", "tokens": len(flat), "documents": len(ds)}
    (root / "tokenizer.json").write_bytes(tokenizer)
    (root / "manifest.json").write_text(json.dumps({
        "format": "parallax-prepared", "version": 1, "token_dtype": "uint16", "vocab_size": vocab, "eod_id": eod,
        "eod_token": "<|endoftext|>", "splits": splits, "sources": [], "tokenizer": "tokenizer.json"}))
    return str(root)


def _docs(rng, n: int, lo: int, hi: int) -> list[list[int]]:
    return [rng.integers(lo, hi, int(rng.integers(3, 40))).tolist() for _ in range(n)]


# ----------------------------------------------------------------------------------------------
# Records, shuffle, mixture


def test_batches_are_a_pure_function_of_seed_and_step(tmp_path):
    path = _token_file(tmp_path / "a.bin", np.arange(T * 100 + 1) % 256)
    a, _ = open_input(_cfg(f"data.source={path}"))
    b, _ = open_input(_cfg(f"data.source={path}"))
    assert np.array_equal(a.batch_rows(7), b.batch_rows(7))
    assert not np.array_equal(a.batch_rows(7), a.batch_rows(8))
    other, _ = open_input(_cfg(f"data.source={path}", "train.seed=4"))
    assert not np.array_equal(a.batch_rows(7), other.batch_rows(7))
    rows = np.array([1, 2, 6])
    assert np.array_equal(a.batch_rows(7, rows), a.batch_rows(7)[rows])  # a process's rows: the same records


def test_an_epoch_reads_every_window_once_and_reshuffles(tmp_path):
    n = 40  # windows of T+1 at stride T: 5 batches of 8 per epoch
    ids = np.arange(800)  # token i is id i: a window's first id is its start; 648 train tokens = 40 windows + 8
    sets = [f"data.source={_token_file(tmp_path / 'a.bin', ids)}", "data.val_fraction=0.19"]
    train, _ = open_input(_cfg(*sets, vocab=1024))
    assert len(train.windows[0]) == n
    starts = [train.batch_rows(s)[:, 0].tolist() for s in range(10)]
    first, second = sum(starts[:5], []), sum(starts[5:], [])
    assert sorted(first) == sorted(second) == [i * T for i in range(n)]  # each window once per epoch
    assert first != second and first != sorted(first)  # shuffled, and differently in the next epoch
    ordered, _ = open_input(_cfg(*sets, "data.shuffle=False", vocab=1024))
    assert np.array_equal(ordered.batch_rows(1), np.stack([ids[i * T: i * T + T + 1] for i in range(8, 16)]))


@pytest.mark.parametrize("weights", [(0.5, 0.3, 0.2), (0.9, 0.05, 0.05), ()])
def test_mixture_token_shares_match_weights(tmp_path, weights):
    # Three sources of disjoint ids and very different sizes (the smallest, 38 windows, repeats).
    sizes = (T * 3000, T * 500, T * 40)
    paths = [_token_file(tmp_path / f"s{i}.bin", 100 * i + np.arange(n + 1) % 100) for i, n in enumerate(sizes)]
    sets = [f"data.sources={','.join(paths)}"] + ([f"data.weights={','.join(map(str, weights))}"] if weights else [])
    train, val = open_input(_cfg(*sets, vocab=300))
    want = np.asarray(weights or (1 / 3,) * 3)
    for source in (train, val):
        inputs = np.concatenate([split_batch(source.batch_rows(s))["inputs"] for s in range(200)])  # 1,600 rows
        share = np.bincount(inputs.ravel() // 100, minlength=3) / inputs.size
        assert np.all(np.abs(share - want) <= 0.01), (share, want)


@pytest.mark.parametrize("sets, needles", [
    (["data.sources=a,b", "data.weights=1"], ["data.weights", "1 weights for 2 data.sources"]),
    (["data.sources=a,b", "data.weights=1,-2"], ["data.weights[1]", "> 0"]),
    (["data.sources=a,b", "data.weights=1,1e999"], ["data.weights[1]", "finite"]),
    (["data.source=x.bin", "data.sources=a,b"], ["data.source='x.bin' and data.sources", "set one"]),
    (["data.sources=stdlib,a", "data.eod_id=5"], ["data.eod_id=5", "'stdlib'"]),
])
def test_bad_mixture_settings_name_the_field(sets, needles):
    with pytest.raises(ConfigError) as e:
        check_data(_cfg(*sets, vocab=300))
    for needle in needles:
        assert needle in str(e.value), str(e.value)


def test_old_configs_read_one_source():
    d = DataConfig()
    assert (d.sources, d.weights) == ((), ())
    assert resolve_data(Config()) == Config()  # 'stdlib' alone: nothing to resolve
    with pytest.raises(ConfigError, match="data.sources: expected a tuple of str"):
        check_types(dataclasses.replace(Config(), data=DataConfig(sources=["a"])))


# ----------------------------------------------------------------------------------------------
# Prepared directories


def test_prepared_directory_sets_eod_and_packs_documents(tmp_path):
    rng = np.random.default_rng(0)
    path = _prepared(tmp_path / "p", _docs(rng, 60, 5, 300), _docs(rng, 20, 5, 300), vocab=300, eod=2)
    cfg = resolve_data(_cfg(f"data.source={path}", vocab=300))
    assert cfg.data.eod_id == 2  # from the manifest
    assert resolve_data(_cfg(f"data.source={path}", "data.eod_id=2", vocab=300)).data.eod_id == 2
    train, val = open_input(cfg)
    batch = split_batch(train.batch_rows(0), 2)
    assert set(DOC_KEYS) <= set(batch)
    ends = batch["inputs"] == 2
    assert ends.any() and np.array_equal(batch["loss_mask"], (~ends).astype(np.int32))
    assert np.array_equal(batch["segment_ids"][:, 1:] - batch["segment_ids"][:, :-1], ends[:, :-1])
    assert val.batch_rows(0).max() < 300


def test_prepared_directory_refusals(tmp_path):
    rng = np.random.default_rng(1)
    a = _prepared(tmp_path / "a", _docs(rng, 30, 5, 300), _docs(rng, 10, 5, 300), vocab=300, eod=2)
    b = _prepared(tmp_path / "b", _docs(rng, 30, 5, 300), _docs(rng, 10, 5, 300), vocab=300, eod=2,
                  tokenizer=b'{"model": "another"}')
    with pytest.raises(DataError, match=r"data.eod_id=4 but .* eod_id=2 \(manifest.json\)"):
        resolve_data(_cfg(f"data.source={a}", "data.eod_id=4", vocab=300))
    with pytest.raises(PrepareError, match=r"vocab_size=300 .* > model.vocab_size=256"):
        resolve_data(_cfg(f"data.source={a}", vocab=256))
    with pytest.raises(DataError, match="different tokenizers"):
        resolve_data(_cfg(f"data.sources={a},{b}", vocab=300))
    with pytest.raises(DataError, match="'stdlib'.*different tokenizers"):
        resolve_data(_cfg(f"data.sources=stdlib,{a}", vocab=300))
    (tmp_path / "plain").mkdir()
    with pytest.raises(PrepareError, match="does not exist; make it with `parallax prepare`"):
        resolve_data(_cfg(f"data.source={tmp_path / 'plain'}", vocab=300))


def test_prepared_eod_conflict_is_one_line_exit_2_before_the_workdir(tmp_path, capsys):
    rng = np.random.default_rng(2)
    a = _prepared(tmp_path / "a", _docs(rng, 30, 5, 250), _docs(rng, 10, 5, 250), vocab=256, eod=2)
    wd = tmp_path / "wd"
    rc = main(["train", str(QUICKSTART), *_sets(*TINY, f"data.source={a}", "data.eod_id=3"), "--workdir", str(wd)])
    assert rc == 2
    _assert_one_error_line(capsys.readouterr().err, "data.eod_id=3", "eod_id=2")
    assert not wd.exists()


# ----------------------------------------------------------------------------------------------
# Feed and evaluation


@pytest.mark.parametrize("prefetch", [0, 3])
def test_feed_yields_the_batches_of_its_steps(tmp_path, prefetch):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    path = _token_file(tmp_path / "a.bin", np.arange(T * 300 + 1) % 256)
    train, _ = open_input(_cfg(f"data.source={path}"))
    mesh = jax.make_mesh((4, 2), ("data", "tensor"))
    sharding = NamedSharding(mesh, P("data"))
    feed = Feed(train, 5, 9, sharding, prefetch, 2)
    try:
        for step in range(5, 9):
            batch, waited = feed.next()
            assert waited >= 0
            want = make_global_batch(train, step, sharding)
            assert set(batch) == set(want)
            for k in batch:
                assert np.array_equal(np.asarray(batch[k]), np.asarray(want[k])), (step, k)
                assert batch[k].sharding == sharding
        with pytest.raises(StopIteration):
            feed.next()
    finally:
        feed.close()


def test_eval_batches_cover_the_validation_split_once(tmp_path):
    rng = np.random.default_rng(3)
    path = _prepared(tmp_path / "p", _docs(rng, 20, 5, 300), _docs(rng, 25, 5, 300), vocab=300, eod=2)
    cfg = with_source(_cfg(vocab=300), path)  # a run on 'stdlib' evaluated on a prepared directory
    assert cfg.data.eod_id == 2 and cfg.data.source == path
    ev = eval_batches(cfg)
    val = np.fromfile(Path(path) / "val.bin", np.uint16)
    n = (len(val) - 1) // T
    assert len(ev) == -(-n // B) >= 2
    counted = np.concatenate([b["targets"][b["loss_mask"] == 1] for b in ev])  # in batch, row, position order
    inputs, targets = val[: n * T].reshape(n, T), val[1: n * T + 1].reshape(n, T)  # window i, in order
    assert np.array_equal(counted, targets[inputs != 2])  # each window once; the fill rows add nothing
    assert ev.tokens == n * T
    last = ev[len(ev) - 1]
    assert last["loss_mask"][n % B or B:].sum() == 0  # the fill rows count for nothing
    again = eval_batches(cfg, rows=np.array([0, 5]))
    assert np.array_equal(again[1]["inputs"], ev[1]["inputs"][[0, 5]])


# ----------------------------------------------------------------------------------------------
# Exact resume across kill -9, 1 and 2 processes

RUN = [*mh.TINY[:5], "train.steps=1000", "train.log_every=1", "train.eval_every=0", "checkpoint.every=2",
       "data.prefetch=3"]
STOP = 8  # the reference and the resumed runs stop after this step


def _launch(tmp: Path, name: str, workdir: Path, processes: int, extra=(), sets=()) -> mh.Procs:
    port = mh._free_port()

    def argv(i: int) -> list[str]:
        cmd = [sys.executable, "-m", "parallax", "train", str(QUICKSTART), *_sets(*RUN, *sets), "--workdir",
               str(workdir), *extra]
        if processes > 1:
            cmd += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes), "--process-id", str(i)]
        return cmd

    return mh.Procs(tmp, name, argv, processes, env={TRACE_ENV: str(tmp / f"trace-{name}")})


def _fed(tmp: Path, name: str, complete: bool = True) -> dict[int, dict[int, int]]:
    """step (0-based: the batch's) -> {global row: CRC-32} over every process of one session
    (`complete` False: while it runs, a line being written is left out)."""
    out: dict[int, dict[int, int]] = {}
    for f in sorted((tmp / f"trace-{name}").glob("input.*.jsonl")):
        for line in f.read_text().splitlines(keepends=True):
            if not complete and not line.endswith("\n"):
                continue
            r = json.loads(line)
            out.setdefault(r["step"], {}).update(zip(r["rows"], r["crc32"]))
    return out


def _records(workdir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())}


def _kill_after(procs: mh.Procs, tmp: Path, name: str, step: int) -> None:
    """SIGKILL every process of session `name` once it has fed the batch of `step` (its trace)."""
    deadline = time.monotonic() + 240
    try:
        while max(_fed(tmp, name, complete=False), default=-1) < step:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs.procs), procs.err(0)[-3000:]
            time.sleep(0.1)
    finally:  # on time, or on failure: never leave a process behind
        for p in procs.procs:
            p.send_signal(signal.SIGKILL)
    assert [p.wait(60) for p in procs.procs] == [-signal.SIGKILL] * len(procs.procs)


@pytest.fixture(scope="module")
def resumed_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("input_resume")
    mh._CACHE[:] = [tmp / "jit_cache"]  # the persistent compile cache test_multihost's runs share
    t0 = time.perf_counter()
    # Three stages, two runs at a time (each waits mostly on its own start-up).
    ref = _launch(tmp, "ref", tmp / "ref", 1, ["--stop-at", str(STOP)])
    killed1 = _launch(tmp, "killed1", tmp / "p1", 1)
    _kill_after(killed1, tmp, "killed1", 6)
    mh._check(ref, ref.wait())
    # Two processes start from the uninterrupted run's checkpoint at step 4 (a 1-process one),
    # with periodic saves in flight as they are killed (checkpoint._coordination_barriers: before
    # it, the save's barriers hung two processes at the first step after a save).
    shutil.copytree(tmp / "ref", tmp / "p2", ignore=lambda d, names: [x for x in names if
                                                                     Path(d).name == "checkpoints" and x != "4"])
    two = []
    resumed1 = _launch(tmp, "resumed1", tmp / "p1", 1, ["--stop-at", str(STOP)])
    killed2 = _launch(tmp, "killed2", tmp / "p2", 2, (), two)
    _kill_after(killed2, tmp, "killed2", 6)
    mh._check(resumed1, resumed1.wait())
    resumed2 = _launch(tmp, "resumed2", tmp / "p2", 2, ["--stop-at", str(STOP)], two)
    mh._check(resumed2, resumed2.wait())
    sessions = {1: (killed1, resumed1, tmp / "p1"), 2: (killed2, resumed2, tmp / "p2")}
    print(f"input resume runs: {time.perf_counter() - t0:.1f} s")
    return tmp, sessions


@pytest.mark.parametrize("n", [1, 2])
def test_resumed_batches_equal_an_uninterrupted_runs_across_kill_9(resumed_runs, n):
    tmp, sessions = resumed_runs
    killed_procs, resumed, wd = sessions[n]
    if n == 2:  # the killed session resumed a 1-process checkpoint on 2 processes; it saved nothing
        assert "resuming from checkpoint step 4" in killed_procs.out(0)
    ref, killed, again = _fed(tmp, "ref"), _fed(tmp, f"killed{n}"), _fed(tmp, f"resumed{n}")
    assert sorted(ref) == list(range(STOP)) and all(sorted(r) == list(range(8)) for r in ref.values())
    out = resumed.out(0)
    assert "resuming from checkpoint step" in out, out[-2000:]
    start = int(out.split("resuming from checkpoint step ")[1].split()[0])
    assert sorted(again) == list(range(start, STOP))
    assert start <= max(killed)  # the resumed run read again batches the killed one had fed
    for step, rows in {**killed, **again}.items():  # every batch either session fed, from every process
        if step < STOP:
            assert rows == ref[step], step
    # The batch is the pure function of (seed, step) that the test computes here too.
    train, _ = open_input(resolve_data(apply_overrides(load_experiment(QUICKSTART), RUN)))
    assert {r: zlib.crc32(x.tobytes()) for r, x in enumerate(train.batch_rows(STOP - 1))} == ref[STOP - 1]
    # and the model saw the same data: the losses match the uninterrupted run's
    want, got = _records(tmp / "ref"), _records(wd)
    for step in range(start + 1, STOP + 1):
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=mh.RTOL), step


def test_input_wait_is_in_metrics(resumed_runs):
    tmp, _ = resumed_runs
    records = _records(tmp / "ref")
    assert sorted(records) == list(range(1, STOP + 1))
    for r in records.values():
        assert isinstance(r["input_wait_s"], float) and math.isfinite(r["input_wait_s"]) and r["input_wait_s"] >= 0
        assert r["input_wait_s"] <= r["step_time_s"]  # measured inside the step's time
    assert records[STOP]["input_wait_s"] == 0.0  # the last step fetches nothing after it
