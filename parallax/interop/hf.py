"""`parallax import-hf DIR --out WORKDIR` and `parallax export-hf WORKDIR --out DIR`.

Import reads a Hugging Face Llama/Mistral/Mixtral checkpoint (config.json + safetensors, one file
or sharded with an index), checks every tensor against the parallax model config.json implies
(interop/hf_layout.py) before anything is written, and leaves a workdir that `parallax train
WORKDIR/experiment.py --workdir WORKDIR` resumes as any other: a step-0 Orbax checkpoint in the
training loop's own format (the imported parameters, a freshly initialised optimizer state),
run.json as loop.py writes it, the experiment file, and WORKDIR/hf/ (the source's config.json and
tokenizer files, for export). Each parameter is made with `jax.make_array_from_callback` in its
training sharding: a device's shard is cut from one layer's (or one expert's) tensors, read one
at a time, so the host holds one tensor group of one layer plus the shard being filled.

Export reads the latest checkpoint's parameters one leaf at a time (Orbax partial restore, as
NumPy on the host), splits the layer stack per layer (and expert), and writes safetensors files of
at most --max-shard-size (with model.safetensors.index.json when there are several), config.json,
and a tokenizer when the run's data has one. The host holds one leaf plus one shard.

Both write into a temporary sibling of --out and rename it into place at the end: bad input (one
line naming the file, tensor or field, exit 2) leaves nothing behind. Single-process commands.
No JAX at module load (cli.py imports this module to build its parser).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import shutil
from pathlib import Path
from typing import Any

from parallax.config import (CheckpointConfig, Config, MeshConfig, OptimConfig, TrainConfig, apply_overrides,
                             check_data, check_fields, check_optim, data_sources)
from parallax.interop.hf_layout import (CONFIG_FILE, FIXED_MODEL_FIELDS, Checkpoint, HFError, Shards, check_leaves,
                                        check_sequence, hf_config, is_empty_dir, model_config, parse_size, parts,
                                        read_json, write_json)

SOURCE_DIR = "hf"  # WORKDIR/hf: the imported config.json and tokenizer files
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json")
EXPERIMENT_FILE = "experiment.py"
DEFAULT_MAX_SHARD = "5GB"  # transformers' save_pretrained default of v4


def add_import_hf_parser(sub) -> None:
    p = sub.add_parser("import-hf", help="a Hugging Face Llama/Mistral/Mixtral checkpoint -> a workdir to fine-tune")
    p.add_argument("directory", help="a directory with config.json and model.safetensors (or a sharded index)")
    p.add_argument("--out", required=True, metavar="WORKDIR", help="the workdir to create (absent or empty)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of the fine-tune config (not the model fields config.json fixes)")


def add_export_hf_parser(sub) -> None:
    p = sub.add_parser("export-hf", help="a workdir's latest checkpoint -> a Hugging Face checkpoint directory")
    p.add_argument("workdir", help="a parallax workdir with checkpoints")
    p.add_argument("--out", required=True, metavar="DIR", help="the directory to create (absent or empty)")
    p.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD, metavar="SIZE",
                   help=f"largest safetensors file, e.g. 5GB, 500MB (default {DEFAULT_MAX_SHARD})")


def _check_out(out: Path) -> None:
    if out.exists() and not is_empty_dir(out):
        raise HFError(f"--out {str(out)!r} exists and is not an empty directory; choose another")
    if not out.absolute().parent.is_dir():
        raise HFError(f"--out {str(out)!r}: its parent directory does not exist")


def _staging(out: Path) -> Path:
    tmp = out.absolute().parent / f".{out.name}.parallax-tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _publish(tmp: Path, out: Path) -> None:
    if out.exists():
        out.rmdir()  # empty (checked first): os.replace needs it gone or empty
    os.replace(tmp, out)


# ----------------------------------------------------------------------------------------------
# import-hf


def fine_tune_config(hf: dict, where: str, name: str, overrides: list[str]) -> Config:
    """The experiment an import writes: the model config.json describes, on mesh data=-1, AdamW
    at a fine-tuning learning rate; `overrides` on top (never of the model fields config.json fixes)."""
    for item in overrides:
        key = item.partition("=")[0].strip()
        if key.startswith("model.") and key[len("model."):] in FIXED_MODEL_FIELDS:
            raise HFError(f"--set {key}: fixed by {where}; the checkpoint's tensors follow it")
    m = model_config(hf, where)
    seq = min(int(hf.get("max_position_embeddings") or 2048), 2048)
    cfg = Config(name=name, mesh=MeshConfig(data=-1), model=m,
                 optim=OptimConfig(warmup_steps=50, weight_decay=0.0),
                 train=TrainConfig(steps=1000, global_batch=16, seq_len=seq, lr=2e-5, eval_every=100),
                 checkpoint=CheckpointConfig(every=200))
    cfg = apply_overrides(cfg, overrides)
    check_fields(cfg)
    check_data(cfg)
    check_optim(cfg)
    check_sequence(hf, cfg.train.seq_len, where)
    return cfg


def _run_name(directory: Path) -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", directory.absolute().name).strip("-.")
    return name or "hf-model"


def import_hf_command(args) -> int:
    from parallax.train.distributed import configure_host_devices

    src, out = Path(args.directory), Path(args.out)
    if not src.is_dir():
        raise HFError(f"{str(src)!r} is not a directory")
    _check_out(out)
    where = str(src / CONFIG_FILE)
    hf = read_json(src / CONFIG_FILE)
    cfg = fine_tune_config(hf, where, _run_name(src), args.set)
    checkpoint = Checkpoint(src)  # headers only
    print(configure_host_devices(cfg), flush=True)
    return import_checkpoint(cfg, checkpoint, src, out)


def import_checkpoint(cfg: Config, checkpoint: Checkpoint, src: Path, out: Path) -> int:
    import jax

    from parallax.train.build import build
    from parallax.train.checkpoint import Checkpoints, DiskForm, make_meta
    from parallax.train.loop import write_run_file

    built = build(cfg)
    target = DiskForm(built.layout).target.params  # layer-major, with the training shardings
    leaves = {_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(target)[0]}
    all_parts = parts(cfg.model)
    check_leaves(all_parts, {k: x.shape for k, x in leaves.items()})
    checkpoint.check(all_parts, {k: x.shape for k, x in leaves.items()}, cfg.model.tie_embeddings)
    # Every input is checked: from here on things are written (into a staging directory).
    params = jax.tree_util.tree_map_with_path(lambda p, x: _load_leaf(checkpoint, all_parts, _path(p), x), target)
    state = _fresh_state(cfg, built.layout, params)
    tmp = _staging(out)
    try:
        with Checkpoints(tmp, cfg.checkpoint) as saver:
            saver.open(built.layout)
            saver.save(0, state, make_meta(cfg, 0, built.mesh, skipped_steps=0, unwritten_records=[]))
        write_run_file(tmp, cfg)
        (tmp / EXPERIMENT_FILE).write_text(experiment_source(cfg, src))
        (tmp / SOURCE_DIR).mkdir()
        for name in (CONFIG_FILE,) + TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, tmp / SOURCE_DIR / name)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    n = sum(1 for p in all_parts for _ in p.names(leaves[p.leaf].shape))
    print(f"imported {n} tensors of {src} into {out}/checkpoints/0 (a step-0 checkpoint, fresh optimizer state)")
    if cfg.data.source == "stdlib" and not cfg.data.sources:
        tok = f" --tokenizer {out / SOURCE_DIR / 'tokenizer.json'}" if (src / "tokenizer.json").is_file() else ""
        print(f"data.source is 'stdlib' (bytes): for the model's own tokens, `parallax prepare SOURCES --out DATA{tok}` "
              "and --set data.source=DATA")
    print(f"fine-tune: parallax train {out / EXPERIMENT_FILE} --workdir {out}")
    return 0


def _path(path: tuple) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in path)


class _Filler:
    """make_array_from_callback's callback for one leaf: the block of the leaf a device holds,
    assembled unit by unit (a layer, or a layer's expert) from that unit's HF tensors."""

    def __init__(self, checkpoint: Checkpoint, leaf_parts: list, shape: tuple[int, ...]):
        self.checkpoint, self.parts, self.shape = checkpoint, leaf_parts, shape
        self.units = leaf_parts[0].units
        self._unit: tuple[Any, Any] = (None, None)  # the last unit read (replicas ask for the same block)
        self._block: tuple[Any, Any] = (None, None)

    def unit(self, index: tuple[int, ...]):
        import numpy as np

        if self._unit[0] != index:
            arr = np.zeros(self.shape[self.units:], np.float32)
            for part in self.parts:  # every region of the unit is some part's (q, k, v fill qkv)
                name = part.name.format(i=index[0] if index else 0, e=index[1] if len(index) > 1 else 0)
                arr[part.region] = part.from_hf(self.checkpoint.read(name), self.shape)
            self._unit = (index, arr)
        return self._unit[1]

    def __call__(self, index: tuple) -> Any:
        import numpy as np

        index = tuple(index) + (slice(None),) * (len(self.shape) - len(index))
        key = tuple((s.start, s.stop, s.step) for s in index)
        if self._block[0] != key:
            ranges = [range(*index[a].indices(self.shape[a])) for a in range(self.units)]
            blocks = [self.unit(u)[index[self.units:]] for u in itertools.product(*ranges)]
            block = np.stack(blocks).reshape(*(len(r) for r in ranges), *blocks[0].shape) if ranges else blocks[0]
            self._block = (key, block)
        return self._block[1]


def _load_leaf(checkpoint: Checkpoint, all_parts: list, leaf: str, target: Any) -> Any:
    import jax

    filler = _Filler(checkpoint, [p for p in all_parts if p.leaf == leaf], target.shape)
    return jax.make_array_from_callback(target.shape, target.sharding, filler)


def _fresh_state(cfg: Config, layout, params: Any):
    """The TrainState init_state would make, with `params` for the random initialisation: the
    stage layout when pipelined, AdamW/Muon state from tx.init, FP8 state as initialised."""
    import jax
    import jax.numpy as jnp

    from parallax.model.fp8 import FP8_COLLECTION
    from parallax.parallel.pipeline import to_stages
    from parallax.parallel.sharding import logical_context
    from parallax.train.train_state import TrainState

    shardings = layout.state_shardings
    if layout.schedule is not None:
        params = jax.jit(lambda p: {**p, "layers": to_stages(p["layers"], layout.schedule)},
                         out_shardings=shardings.params, donate_argnums=0)(params)
    opt_state = jax.jit(layout.tx.init, out_shardings=shardings.opt_state)(params)
    fp8: Any = {}
    if jax.tree.leaves(layout.abstract_state.fp8):  # scales and histories: ones and zeros, as train_state makes them
        def init_fp8(rng):
            tokens = jnp.zeros((cfg.train.global_batch, cfg.train.seq_len), jnp.int32)
            with logical_context(layout.mesh, layout.rules):
                return layout.model.init(rng, tokens).get(FP8_COLLECTION, {})

        fp8 = jax.jit(init_fp8, out_shardings=shardings.fp8)(jax.random.key(cfg.train.seed))
    step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
    return TrainState(step=step, params=params, opt_state=opt_state, fp8=fp8)


def _render(obj: Any, indent: int, used: set[str], always: tuple[str, ...] = ()) -> str:
    """A dataclass as constructor source: its non-default fields (and `always`), nested ones on
    their own lines; `used` collects the class names it names."""
    items = []
    used.add(type(obj).__name__)
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if value == default and f.name not in always:
            continue
        text = _render(value, indent + 4, used, ("data",) * (f.name == "mesh")) if dataclasses.is_dataclass(value) \
            else repr(value)
        items.append(f"{f.name}={text}")
    if sum(len(i) for i in items) < 80 and not any("\n" in i for i in items):
        return f"{type(obj).__name__}({', '.join(items)})"
    pad = " " * (indent + 4)
    return f"{type(obj).__name__}(\n" + "".join(f"{pad}{i},\n" for i in items) + " " * indent + ")"


def experiment_source(cfg: Config, src: Path) -> str:
    """WORKDIR/experiment.py: `get_config()` returning `cfg`, written out field by field."""
    used: set[str] = set()
    body = _render(cfg, 4, used, ("mesh",))
    return (f'"""Fine-tune of the Hugging Face checkpoint {str(src.absolute())!r} (written by `parallax import-hf`).\n\n'
            "The model fields come from its config.json and must stay as they are (the checkpoint's tensors\n"
            "follow them); the rest is a starting point. WORKDIR/checkpoints/0 holds the imported weights.\n"
            '"""\n\n'
            f"from parallax.config import {', '.join(sorted(used))}\n\n\n"
            f"def get_config() -> Config:\n    return {body}\n")


# ----------------------------------------------------------------------------------------------
# export-hf


def config_from_flat(flat: dict) -> Config:
    """The Config a checkpoint's meta recorded (config.flatten's keys)."""
    return apply_overrides(Config(), [f"{k}={v!r}" for k, v in flat.items()])


def export_hf_command(args) -> int:
    workdir, out = Path(args.workdir), Path(args.out)
    max_bytes = parse_size(args.max_shard_size)
    if not workdir.is_dir():
        raise HFError(f"workdir {str(workdir)!r} is not a directory")
    _check_out(out)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # reading to the host needs no accelerator
    return export_checkpoint(workdir, out, max_bytes)


def export_checkpoint(workdir: Path, out: Path, max_bytes: int) -> int:
    import numpy as np
    import orbax.checkpoint as ocp

    from parallax.train.checkpoint import Checkpoints

    store = Checkpoints(workdir)
    steps = store.steps()
    if not steps:
        raise HFError(f"workdir {str(workdir)!r} holds no checkpoint (checkpoints/ has no finalized step)")
    step = steps[-1]
    where = str(store.path(step))
    with store.reader() as manager:
        try:
            meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            saved = manager.item_metadata(step)["state"]
        except Exception as e:  # an unreadable (damaged) checkpoint: say which, in one line
            raise HFError(f"checkpoint {where!r} cannot be read ({_first_line(e)})") from None
        cfg = config_from_flat(meta["config"])
        base = workdir / SOURCE_DIR / CONFIG_FILE
        config = hf_config(cfg.model, read_json(base) if base.is_file() else None, cfg.train.seq_len)
        saved = getattr(saved, "tree", saved)["params"]
        shapes = {_path(p): tuple(x.shape) for p, x in _flat_metadata(saved)}
        all_parts = parts(cfg.model)
        check_leaves(all_parts, shapes)
        _check_saved_shapes(cfg, shapes, store.path(step))
        tmp = _staging(out)
        try:
            shards = Shards(tmp, max_bytes)
            for leaf in dict.fromkeys(p.leaf for p in all_parts):  # one leaf in memory at a time
                try:
                    value = _restore_leaf(manager, step, leaf, shapes[leaf])
                except Exception as e:
                    raise HFError(f"checkpoint {where!r}: params/{leaf} cannot be read ({_first_line(e)})") from None
                for part in (p for p in all_parts if p.leaf == leaf):
                    for unit, name in part.names(shapes[leaf]):
                        shards.add(name, part.to_hf(np.asarray(value[unit])[part.region]))
                del value
            shards.finish()
            write_json(tmp / CONFIG_FILE, config)
            tokenizer = _copy_tokenizer(cfg, workdir, tmp)
            _publish(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    if cfg.model.moe.num_experts and cfg.model.moe.capacity_factor > 0:
        print(f"note: trained with model.moe.capacity_factor={cfg.model.moe.capacity_factor} (assignments over an "
              "expert's capacity dropped); Mixtral in transformers is dropless, so outputs differ where tokens dropped")
    print(f"exported step {step} of {workdir} to {out}: {config['architectures'][0]}, {shards.count} tensors in "
          f"{len(shards.files)} file{'s' * (len(shards.files) > 1)}" + (f"; tokenizer from {tokenizer}" if tokenizer else
                                                                        "; no tokenizer (the run's data has none)"))
    return 0


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def _flat_metadata(tree: Any) -> list:
    import jax

    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]


def _check_saved_shapes(cfg: Config, shapes: dict, where: Path) -> None:
    """The saved parameters are those of the model the saved config describes."""
    import jax
    import jax.numpy as jnp
    import flax.linen as nn

    from parallax.model.transformer import Transformer

    model = Transformer(cfg.model)
    want = jax.eval_shape(lambda r: nn.unbox(model.init(r, jnp.zeros((1, 8), jnp.int32))["params"]), jax.random.key(0))
    for path, x in jax.tree_util.tree_flatten_with_path(want)[0]:
        if shapes.get(_path(path)) != tuple(x.shape):
            raise HFError(f"checkpoint {str(where)!r}: params/{_path(path)} is {shapes.get(_path(path))}, but its "
                          f"config implies {tuple(x.shape)}")


def _restore_leaf(manager, step: int, leaf: str, shape: tuple[int, ...]) -> Any:
    """One parameter of the saved state, as a host NumPy array (Orbax partial restore)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    item, args = {}, {}
    node_i, node_a = item, args
    keys = ["params", *leaf.split("/")]
    for k in keys[:-1]:
        node_i, node_a = node_i.setdefault(k, {}), node_a.setdefault(k, {})
    node_i[keys[-1]] = jax.ShapeDtypeStruct(shape, np.float32)
    node_a[keys[-1]] = ocp.RestoreArgs(restore_type=np.ndarray, dtype=np.float32)
    restore = ocp.args.PyTreeRestore(item, restore_args=args, partial_restore=True)
    state = manager.restore(step, args=ocp.args.Composite(state=restore))["state"]
    value = state["params"]
    for k in keys[1:]:
        value = value[k]
    return value


def _copy_tokenizer(cfg: Config, workdir: Path, out: Path) -> str | None:
    """The tokenizer of the run's data (a prepared directory's tokenizer.json), else the imported
    checkpoint's own files (WORKDIR/hf); None when neither exists (the byte corpus, token files)."""
    from parallax.train.tokenizer import MANIFEST, read_manifest_tokenizer

    for src in data_sources(cfg.data)[0]:
        if src != "stdlib" and (Path(src) / MANIFEST).is_file():
            tok_path, eod_token, _, _ = read_manifest_tokenizer(src)
            shutil.copyfile(tok_path, out / "tokenizer.json")
            tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.train.seq_len}
            if eod_token is not None:
                tok_config["eos_token"] = eod_token
            write_json(out / "tokenizer_config.json", tok_config)
            return f"data {src!r}"
    copied = [n for n in TOKENIZER_FILES if (workdir / SOURCE_DIR / n).is_file()]
    for name in copied:
        shutil.copyfile(workdir / SOURCE_DIR / name, out / name)
    return f"the imported checkpoint ({', '.join(copied)})" if "tokenizer.json" in copied else None
