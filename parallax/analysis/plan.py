"""`parallax plan`: which layout should this model use on these devices?

    parallax plan (EXPERIMENT.py | --preset NAME) [--set key=value ...] (--devices N --device TYPE | --target NAME)
                  [--devices-per-host K] [--attention auto|xla|fused] [--noise-scale B | --noise-scale-from DIR]
                  [--top K] [--json]

Searches every (data, tensor, pipe, expert) with product N that the model's shapes divide (pipe
need not divide the layers: uneven stages pad the stack), every ZeRO stage, microbatch count,
pipeline schedule (and circular repeats), remat policy and sequence parallelism on/off, and ranks
the layouts that fit in device memory by predicted MFU. One vectorised evaluation of cost.py's
model over all candidates (numpy): a 16,384-device search takes well under a second of arithmetic.

Step time. Compute at a calibrated fraction of the device's dense peak (DEVICES[...].efficiency);
the FLOPs are those the device executes (cost.hardware_flops_per_device: recomputation, GPipe's
bubble ticks, the embedding and loss head replicated over `pipe`). Each collective runs on the
link level its group crosses, given the device order (tensor innermost, then expert, data, pipe
outermost) and K devices per fast domain (an NVLink host; a TPU ICI slice): ring algorithms,
2(n-1)/n S for all-reduce, (n-1)/n S for all-gather, S for a permute, plus a fixed latency.
Overlap as the design states: tensor all-reduces exposed; the data-parallel gradient reduction
inside the backward layer loop hidden behind the backward pass (after the tick loop when
pipelined: exposed); ZeRO-3 gathers prefetched behind compute; pipeline sends behind the other
half-microbatch's compute (exposed only where longer); the GPipe/circular bubble (P-1)/(R M+P-1),
the table schedules' (1F1B, interleaved 1F1B, ZB-H1) from their tables in lockstep under the
compiled op costs (schedules.lockstep_bubble: ZB-H1's split B and W cost 1 + a and 1 - a
forwards for an attention share a, or each recompute the stage where no residuals are kept);
the MoE all-to-alls over `expert` exposed (the expert matmuls wait for the dispatched slots).

MoE models search `expert` too (dividing num_experts; the batch is split over data x expert), with
MoE blocks inside GPipe/circular stages when pipe > 1 (tests/test_cost_moe.py validates those
terms against compiles) and the table schedules.
The device, preset and published-run tables live in presets.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from parallax.config import (Config, ConfigError, Fp8Config, ModelConfig, TrainConfig, UserError, apply_overrides,
                             expert_d_ff, load_experiment, stack_length)
from parallax.analysis.collectives import collective_terms
from parallax.analysis.cost import (Grid, Workload, hardware_flops_per_device, memory_parts, memory_platform,
                                    model_flops_per_step)
from parallax.parallelism import (CIRCULAR, GPIPE, INTERLEAVED, LAYOUT_FIELDS, ONE_F_ONE_B, REMATS, SCHEDULES,
                                  SEQUENCE_DIMS, ZB_H1,
                                  bubble, keeps_residuals, legal, lockstep_bubble, own_gradients, pipelined)
from parallax.analysis.presets import PUBLISHED  # noqa: F401 - re-exported: the published runs beside compare_published
from parallax.analysis.presets import ALIASES, DEVICES, PRESETS, Device, PublishedRun

GiB = 2**30
USABLE_MEMORY = 0.90  # of HBM: XLA's own buffers, fragmentation (raise XLA_PYTHON_CLIENT_MEM_FRACTION from 0.75)
LINK_EFFICIENCY = 0.80  # achieved / nominal bandwidth of large ring collectives (NCCL bus bandwidth, ICI)
LATENCY_INTRA, LATENCY_INTER = 10e-6, 30e-6  # seconds per collective
# remat=save_attn_mlp_offload: bytes/s per device to and from pinned host memory (assumed, not
# measured: a PCIe Gen4 x16 link's ~25 GB/s shared by two devices), hidden behind the compute
HOST_LINK_BW = 12.5e9


# ----------------------------------------------------------------------------------------------
# The search


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidates(w: Workload, n_devices: int, zero_stages=(0, 1, 3), sequence=(0, 1), fp8: bool = False,
               remats=tuple(range(len(REMATS)))) -> Grid:
    """Every layout parallax accepts for `w` on n_devices, as arrays. The enumeration proposes
    (mesh factorizations, microbatch counts dividing a batch shard, schedules, repeats, ZeRO,
    remat, sequence parallelism); `parallelism.legal`, the rules table every config is checked
    with, decides. Left out as dominated, not illegal: microbatches on one stage but for 1F1B
    (GPipe there only adds ticks) and sequence parallelism at tensor 1 (a no-op)."""
    m = w.model
    E = m.moe.num_experts
    units = stack_length(m)
    rows = []
    for t, e in itertools.product(_divisors(n_devices), _divisors(E) if E else [1]):
        if n_devices % (t * e):
            continue
        for p in _divisors(n_devices // (t * e)):
            d = n_devices // (t * p * e)
            if w.global_batch % (d * e):  # (the rule `batch`; the microbatches below divide a shard)
                continue
            for mb in _divisors(w.global_batch // (d * e)):
                if p == 1:
                    scheds = [(GPIPE, 1)] if mb == 1 else [(ONE_F_ONE_B, 1)]
                else:
                    repeats = [r for r in _divisors(-(-units // p)) if r > 1]
                    scheds = ([(GPIPE, 1), (ONE_F_ONE_B, 1), (ZB_H1, 1)] + [(CIRCULAR, r) for r in repeats]
                              + [(INTERLEAVED, r) for r in repeats])
                for (sched, r), zero, remat in itertools.product(scheds, zero_stages, remats):
                    for sp in (sequence if t > 1 else (0,)):
                        # sequence parallelism shards T where tensor divides it, else D (field 2)
                        rows.append((d, t, p, e, zero, mb, sched, r, remat, sp and (1 if w.seq_len % t == 0 else 2), 0))
    if not rows:
        return Grid(*(np.zeros(0, int) for _ in LAYOUT_FIELDS))
    a = np.asarray(rows, dtype=np.int64).T
    cfg = Config(model=m, train=TrainConfig(global_batch=w.global_batch, seq_len=w.seq_len),
                 fp8=Fp8Config(enabled=fp8))
    keep = legal(cfg, dict(zip(LAYOUT_FIELDS, a)))
    return Grid(*a[:, keep])


_FACTOR = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
           "reduce-scatter": lambda n: n - 1, "all-to-all": lambda n: (n - 1) / n}


def collective_seconds(kind: str, nbytes, group, stride, dev: Device, per_host: int):
    """Seconds of one collective on a group of `group` devices `stride` ids apart (the device
    order), hierarchically: the members inside one fast domain first (NVLink/ICI), then the
    domains over the slow links on 1/inner of the data each, as NCCL's and XLA's hierarchical
    algorithms do. A permute crosses the slow links when any neighbour pair does."""
    group, stride = np.maximum(np.asarray(group, float), 1), np.asarray(stride, float)
    inner = np.clip(per_host // np.maximum(stride, 1), 1, group)  # members sharing a domain
    outer = np.maximum(group / inner, 1)  # domains the group spans
    bw_in, bw_out = dev.intra_bw * LINK_EFFICIENCY, dev.inter_bw * LINK_EFFICIENCY
    crosses = outer > 1
    latency = np.where(crosses, LATENCY_INTER, LATENCY_INTRA)
    if kind == "collective-permute":
        return nbytes / np.where(crosses, bw_out, bw_in) + latency
    if kind == "all-to-all":  # no hierarchy to exploit: each device sends (n-inner)/n of its bytes off-domain
        return (inner - 1) / group * nbytes / bw_in + (group - inner) / group * nbytes / bw_out + latency
    f = _FACTOR[kind]
    return f(inner) * nbytes / bw_in + np.where(crosses, f(outer) * nbytes / inner / bw_out, 0) + latency


def evaluate(w: Workload, g: Grid, dev: Device, per_host: int, attention: str = "xla", fp8: bool = False,
             all_reduce_groups: tuple[int, int] = (0, 0)) -> dict:
    """Predicted memory, time parts and MFU of every layout in `g` (arrays). `all_reduce_groups`:
    the groups whose reduce-scatters and all-gathers the compiler writes as all-reduces
    (targets.all_reduce_groups)."""
    t, p, d, e = (np.asarray(x) for x in (g.tensor, g.pipe, g.data, g.expert))
    n = t * p * d * e
    mem = memory_parts(w, g, memory_platform(dev.platform), attention)
    hw = hardware_flops_per_device(w, g, attention)
    peak = (dev.peak_fp8 or dev.peak_bf16) if fp8 else dev.peak_bf16
    rate = peak * dev.efficiency
    m_, sched = np.asarray(g.microbatches), np.asarray(g.schedule)
    piped = pipelined(p, m_)
    f1b = piped & own_gradients(sched)
    t_blocks = hw["blocks"] / rate
    # Table schedules skip idle work, so their busy work is stretched by their bubble: the table's,
    # ticks in lockstep under the compiled op costs (schedules.COMPILED_COSTS, or kept_costs for the
    # attention share where B and W start from F's residuals; 1F1B and interleaved: the formula,
    # ZB-H1: more than the paper's)
    from parallax.model.transformer import attention_share  # (counts only: as cost.model_flops_per_step)

    lockstep = lockstep_bubble(sched, p, m_, g.repeats, keeps_residuals(sched, g.remat, attention),
                               attention_share(w.model, w.seq_len, attention))
    stretch = np.where(f1b, 1 / (1 - np.where(f1b, lockstep, 0)), 1.0)
    t_compute = t_blocks * stretch + (hw["head"] + hw["embedding"] + hw["optimizer"]) / rate
    strides = {"tensor": 1, "expert": t, "data": t * e, "pipe": t * e * d}  # device order: tensor innermost
    sizes = {"tensor": t, "expert": e, "data": d, "pipe": p}
    exposed = {"tensor": 0.0, "pipe": 0.0, "data": 0.0, "expert": 0.0}
    hidden_data = 0.0  # behind the backward pass
    hidden_zero3 = 0.0  # behind compute
    tick_send = 0.0
    for term in collective_terms(w, g, "accelerator", attention, *all_reduce_groups):
        axis = "data" if "data" in term.axes else term.axes[0]
        # A group's members lie its innermost non-trivial axis apart: a (data, expert) gradient
        # group is d*e devices t apart when expert > 1, t*e apart otherwise.
        stride = strides[term.axes[0]]
        for a in term.axes[1:]:
            stride = np.where(sizes[a] > 1, np.minimum(stride, strides[a]), stride)
        secs = term.executions * collective_seconds(term.kind, term.bytes, term.group, stride, dev, per_host)
        secs = np.where((term.executions > 0) & (term.bytes > 0), secs, 0.0)
        if term.overlap == "tick":
            tick_send = tick_send + secs
        elif term.overlap == "backward":
            hidden_data = hidden_data + secs
        elif term.overlap == "compute":
            hidden_zero3 = hidden_zero3 + secs
        elif axis == "tensor":
            exposed["tensor"] = exposed["tensor"] + secs * stretch
        else:
            exposed[axis] = exposed[axis] + secs
    t_backward = t_blocks * 2 / 3
    exposed["data"] = exposed["data"] + np.maximum(hidden_data - np.where(piped, 0, t_backward), 0)
    exposed["data"] = exposed["data"] + np.maximum(hidden_zero3 - t_compute, 0)
    exposed["pipe"] = exposed["pipe"] + np.maximum(tick_send - t_compute / 2, 0)  # half the tick hides it
    # the offloaded residuals go to the host in the forward pass and come back in the backward
    host_s = np.maximum(2 * mem["host"] / HOST_LINK_BW - t_compute, 0)
    step = t_compute + exposed["tensor"] + exposed["pipe"] + exposed["data"] + exposed["expert"] + host_s
    flops = model_flops_per_step(w)
    mfu = flops / (n * dev.peak_bf16 * step)
    return {"memory": mem, "flops": hw, "compute_s": t_compute, "tensor_s": exposed["tensor"],
            "pipe_s": exposed["pipe"], "data_s": exposed["data"], "expert_s": exposed["expert"], "step_s": step,
            "mfu": mfu, "bubble": np.where(f1b, lockstep, bubble(sched, p, m_, g.repeats)), "host_s": host_s}


@dataclass(frozen=True)
class Plan:
    layouts: list[dict]
    searched: int
    fitting: int
    seconds: float
    notes: list[str]


def _row(g: Grid, ev: dict, i: int) -> dict:
    pick = lambda a: np.asarray(a).reshape(-1)[i] if np.ndim(a) else a  # noqa: E731
    mem = {k: float(pick(v)) / GiB for k, v in ev["memory"].items()}
    return {
        "data": int(pick(g.data)), "tensor": int(pick(g.tensor)), "pipe": int(pick(g.pipe)), "expert": int(pick(g.expert)),
        "zero": int(pick(g.zero)), "microbatches": int(pick(g.microbatches)), "schedule": SCHEDULES[int(pick(g.schedule))],
        "repeats": int(pick(g.repeats)), "remat": REMATS[int(pick(g.remat))],
        "sequence_parallel": bool(pick(g.sequence)),
        "sequence_parallel_dim": SEQUENCE_DIMS[max(int(pick(g.sequence)) - 1, 0)],
        "memory_gib": round(mem.pop("total"), 3), "memory_parts_gib": {k: round(v, 3) for k, v in mem.items()},
        "step_time_s": float(pick(ev["step_s"])), "mfu": float(pick(ev["mfu"])), "bubble": float(pick(ev["bubble"])),
        "time_parts_s": {k: float(pick(ev[k + "_s"])) for k in ("compute", "tensor", "pipe", "data", "expert")},
    }


def search(w: Workload, n_devices: int, dev: Device, per_host: int, attention: str = "xla", fp8: bool = False,
           top: int = 5, sequence=(0, 1), remats=tuple(range(len(REMATS))), all_reduce_groups: tuple[int, int] = (0, 0)) -> Plan:
    started = time.perf_counter()
    g = candidates(w, n_devices, sequence=sequence, fp8=fp8, remats=remats)
    if np.size(g.data) == 0:
        return Plan([], 0, 0, time.perf_counter() - started, [])
    ev = evaluate(w, g, dev, per_host, attention, fp8, all_reduce_groups)
    fits = ev["memory"]["total"] <= dev.hbm_bytes * USABLE_MEMORY
    order = np.lexsort((ev["memory"]["total"], -np.where(fits, ev["mfu"], -1.0)))  # best MFU, then least memory
    best = [i for i in order[:top] if fits[i]]
    return Plan([_row(g, ev, int(i)) for i in best], int(np.size(g.data)), int(fits.sum()),
                time.perf_counter() - started, [])


def min_memory(w: Workload, n_devices: int, dev: Device, attention: str) -> float:
    """The least memory per device of any layout on n_devices (inf when none factors)."""
    g = candidates(w, n_devices)
    if np.size(g.data) == 0:
        return math.inf
    return float(np.min(memory_parts(w, g, memory_platform(dev.platform), attention)["total"]))


def smallest_fitting_count(w: Workload, n_devices: int, dev: Device, attention: str, step: int) -> int | None:
    """The smallest multiple of `step` above n_devices with a layout that fits: doubling, then
    bisection (memory falls with the device count up to divisibility, so this is the smallest the
    bisection finds)."""
    limit = dev.hbm_bytes * USABLE_MEMORY
    fits = lambda k: min_memory(w, k * step, dev, attention) <= limit  # noqa: E731
    lo = max(n_devices // step, 1)
    hi = lo * 2
    while not fits(hi):
        hi *= 2
        if hi * step > 2**22:
            return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi * step


def compare_published(run: PublishedRun, attention: str = "fused") -> dict:
    """The planner's choice for a published run beside the published layout and MFU. `fused`
    attention by default: every published run used a fused attention kernel."""
    pre = PRESETS[run.preset]
    w = Workload(pre.model, run.global_batch or pre.global_batch, pre.seq_len)
    dev, per_host = DEVICES[run.device], run.per_host or DEVICES[run.device].per_host
    features = (0, 1) if run.sequence_parallel else (0,)
    # none of the published runs offloaded activations to host memory (remat=save_attn_mlp_offload)
    remats = tuple(i for i, r in enumerate(REMATS) if not r.endswith("_offload"))
    plan = search(w, run.devices, dev, per_host, attention, top=1, sequence=features, remats=remats)
    unrestricted = plan if run.sequence_parallel else search(w, run.devices, dev, per_host, attention, top=1,
                                                             remats=remats)
    g = candidates(w, run.devices, sequence=features, remats=remats)
    lay = run.layout
    match = ((np.asarray(g.data) == lay["data"]) & (np.asarray(g.tensor) == lay["tensor"])
             & (np.asarray(g.pipe) == lay["pipe"])) if np.size(g.data) else np.zeros(0, bool)
    published = None
    if match.any():  # the published layout as parallax would run it: its best variant
        idx = np.nonzero(match)[0]
        sub = g.pick(idx)
        ev = evaluate(w, sub, dev, per_host, attention)
        fits = ev["memory"]["total"] <= dev.hbm_bytes * USABLE_MEMORY
        i = int(np.argmax(np.where(fits, ev["mfu"], -1.0))) if fits.any() else int(np.argmin(ev["memory"]["total"]))
        published = {**_row(sub, ev, i), "fits": bool(fits[i])}
    return {"run": run, "chosen": plan.layouts[0] if plan.layouts else None, "published_in_parallax": published,
            "chosen_all_features": unrestricted.layouts[0] if unrestricted.layouts else None,
            "usable_gib": dev.hbm_bytes * USABLE_MEMORY / GiB}


# ----------------------------------------------------------------------------------------------
# Command line


def _device(name: str) -> Device:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in DEVICES:
        raise UserError(f"--device {name!r}: unknown device type (known: {', '.join(DEVICES)})")
    return DEVICES[key]


def _workload(args: argparse.Namespace) -> tuple[Workload, Config, str]:
    if (args.experiment is None) == (args.preset is None):
        raise UserError("plan: give an experiment file or --preset NAME (not both)")
    if args.preset is not None:
        key = args.preset.lower()
        if key not in PRESETS:
            raise UserError(f"--preset {args.preset!r}: unknown preset (known: {', '.join(PRESETS)})")
        pre = PRESETS[key]
        cfg = Config(name=key, model=pre.model, train=TrainConfig(global_batch=pre.global_batch, seq_len=pre.seq_len))
        note = pre.note
    else:
        cfg, note = load_experiment(args.experiment), ""
    cfg = apply_overrides(cfg, args.set)
    m = cfg.model
    for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "vocab_size"):
        if getattr(m, name) <= 0:
            raise ConfigError(f"model.{name}: must be positive, got {getattr(m, name)}")
    if m.d_model % m.n_heads or m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model: d_model={m.d_model}, n_heads={m.n_heads}, n_kv_heads={m.n_kv_heads} must divide evenly")
    for name in ("global_batch", "seq_len"):
        if getattr(cfg.train, name) <= 0:
            raise ConfigError(f"train.{name}: must be positive, got {getattr(cfg.train, name)}")
    return Workload.of(cfg), cfg, note


def _no_factorization(w: Workload, n: int) -> str:
    m = w.model
    return (f"--devices {n}: no (data, tensor, pipe, expert) factorization of {n} fits the model's divisibility: tensor must "
            f"divide n_heads={m.n_heads}, n_kv_heads={m.n_kv_heads}, d_ff={m.d_ff} and vocab_size={m.vocab_size}; "
            f"pipe must leave every stage a layer of the n_layers={m.n_layers} (uneven stages are padded); data must "
            f"divide train.global_batch={w.global_batch}"
            + (f"; expert must divide moe.num_experts={m.moe.num_experts} (tensor also moe.d_ff={expert_d_ff(m)}, "
               f"data x expert the batch)" if m.moe.num_experts else ""))


def cap_batch(global_batch: int, noise_scale: float, splittable=lambda batch: True) -> tuple[int, str | None]:
    """The global batch capped near the gradient noise scale B_simple (McCandlish et al. 2018):
    beyond it a bigger batch buys little more progress per step, so the extra data parallelism is
    wasted. Halves while above 2x B_simple and `splittable(half)` (some layout on the devices can
    split it: early in training B_simple can be a few sequences). Returns (batch, message or None)."""
    if noise_scale <= 0:
        raise UserError(f"--noise-scale: must be positive, got {noise_scale}")
    if global_batch <= 2 * noise_scale:
        return global_batch, None
    capped, floor = global_batch, ""
    while capped > 2 * noise_scale and capped % 2 == 0:
        if not splittable(capped // 2):
            floor = " (the smallest these devices can split)"
            break
        capped //= 2
    return capped, (f"train.global_batch={global_batch} is {global_batch / noise_scale:.1f}x the gradient noise "
                    f"scale {noise_scale:g}: past ~2x it, a step's progress barely grows with the batch "
                    f"(wasted data parallelism); planning with global batch {capped}{floor}")


def noise_scale_from(workdir: str) -> float:
    """The last `noise_scale` (B_simple, sequences) a `train.noise_scale=true` run logged."""
    path = Path(workdir) / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"--noise-scale-from {workdir!r}: no metrics.jsonl there")
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise UserError(f"--noise-scale-from {workdir!r}: cannot read {path}: {e.strerror or e}") from e
    values = []
    for line in lines:
        try:
            record = json.loads(line) if line.strip() else None
        except ValueError:  # a partial last line (a kill mid-write) or bytes that are not UTF-8: not a record
            continue
        value = record.get("noise_scale") if isinstance(record, dict) else None
        if isinstance(value, (int, float)) and value > 0:
            values.append(float(value))
    if not values:
        raise UserError(f"--noise-scale-from {workdir!r}: {path} holds no noise_scale value (train with "
                        "--set train.noise_scale=true for enough steps that the estimate is defined)")
    return values[-1]


def explain(row: dict, dev: Device, per_host: int, n: int) -> str:
    """One paragraph in the terms of the classic recipe."""
    t, p, d = row["tensor"], row["pipe"], row["data"]
    parts = [f"tensor={t} " + ("keeps each layer's Megatron all-reduces inside one fast domain "
                              f"({per_host} devices)" if t <= per_host else "crosses fast domains (slow all-reduces)")
             + (" and splits the layer's weights and activations" if t > 1 else "")
             + ((" (with sequence parallelism: the residual stream too, on "
                 + ("D: T is no multiple of tensor)" if row.get("sequence_parallel_dim") == "embed" else "T)"))
                if row["sequence_parallel"] else "")]
    if p > 1:
        parts.append(f"pipe={p} splits the {row['microbatches']} microbatches' depth over stages "
                     f"({row['schedule']}{', ' + str(row['repeats']) + ' chunks per stage' if row['repeats'] > 1 else ''}; "
                     f"bubble {row['bubble']:.1%})")
    if row["expert"] > 1:
        parts.append(f"expert={row['expert']} spreads the experts (each device holds 1/{row['expert']} of them; "
                     f"tokens travel by all-to-all, exposed {row['time_parts_s']['expert']:.2f} s)")
    parts.append(f"data={d} takes the rest of the {n} devices")
    mem = row["memory_parts_gib"]
    closing = []
    if row["zero"]:
        closing.append(f"ZeRO-{row['zero']} shards " + ("optimizer state" if row["zero"] == 1 else "parameters, gradients "
                                                        "and optimizer state") + " over data")
    if row["remat"] != "none":
        closing.append(f"remat={row['remat']} trades recomputation for activation memory")
    tp = row["time_parts_s"]
    closing = " and ".join(closing)
    return ("; ".join(parts) + ". " + (closing[:1].upper() + closing[1:] + " to fit " if closing else "It fits ")
            + f"{row['memory_gib']:.1f} GiB of {dev.hbm_bytes / GiB * USABLE_MEMORY:.0f} usable "
            f"(activations {mem['activations'] + mem['working']:.1f}, states "
            f"{mem['params'] + mem['optimizer'] + mem['gradients']:.1f}). Step {row['step_time_s']:.2f} s: compute "
            f"{tp['compute']:.2f}, exposed tensor {tp['tensor']:.2f}, pipe {tp['pipe']:.2f}, data {tp['data']:.2f}, expert {tp['expert']:.2f}; "
            f"predicted MFU {row['mfu']:.1%}.")


def layout_config(cfg: Config, row: dict) -> Config:
    """`cfg` laid out as one planner row: its mesh sizes and parallel settings."""
    mesh = dataclasses.replace(cfg.mesh, **{k: row[k] for k in ("data", "tensor", "pipe", "expert")})
    parallel = dataclasses.replace(cfg.parallel, zero=row["zero"], microbatches=row["microbatches"],
                                   schedule=row["schedule"], repeats=row["repeats"], remat=row["remat"],
                                   sequence_parallel=row["sequence_parallel"],
                                   sequence_parallel_dim=row.get("sequence_parallel_dim", "length"))
    return dataclasses.replace(cfg, mesh=mesh, parallel=parallel)


def verify(cfg: Config, layouts: list[dict], target: str, dev: Device) -> list[dict]:
    """Compile each layout's train step for `target` (audit.audit: the target's own compiler,
    nothing run) and set what the compiler holds beside what the planner predicted: peak memory
    per device and collective bytes per step per axis family. `fits`: the compiled peak within
    the usable memory the planner allows (a layout that does not is dropped by the caller);
    `refused`: the line a layout's rules or the target gave instead of a compile."""
    from parallax.analysis.audit import audit

    limit = dev.hbm_bytes * USABLE_MEMORY
    out = []
    for row in layouts:
        try:
            a = audit(layout_config(cfg, row), target=target)
        except UserError as e:
            out.append({"refused": str(e), "fits": False})
            continue
        xla = a["memory"]["xla"]
        peak = xla["peak"] if xla else None
        out.append({
            "compiled_gib": None if peak is None else peak / GiB, "planned_gib": row["memory_gib"],
            "fits": peak is None or peak <= limit, "compile_s": a["compile_s"],
            "axes": {axis: {"compiled_mib": f["bytes"] / 2**20, "model_mib": f["model_bytes"] / 2**20}
                     for axis, f in a["axes"].items()},
        })
    return out


def _verified_text(i: int, v: dict, limit_gib: float) -> str:
    if "refused" in v:
        return f"#{i}: not compiled: {v['refused']}"
    mem = ("the compiler gives no memory analysis" if v["compiled_gib"] is None else
           f"compiled {v['compiled_gib']:.2f} GiB (planned {v['planned_gib']:.2f}, "
           f"{v['planned_gib'] / v['compiled_gib'] - 1:+.0%})")
    axes = ", ".join(f"{k} {a['compiled_mib']:.1f} MiB (planned {a['model_mib']:.1f})" for k, a in v["axes"].items())
    verdict = "" if v["fits"] else f"; does not fit: more than {limit_gib:.1f} GiB usable, dropped"
    return f"#{i}: {mem}; collectives per step {axes}; compile {v['compile_s']:.0f} s{verdict}"


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="search layouts for a model on N devices (cost model)")
    p.add_argument("experiment", nargs="?", help="an experiment file defining get_config()")
    p.add_argument("--preset", help=f"a named model instead of an experiment ({', '.join(PRESETS)})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--devices", type=int, help="device count N (or --target)")
    p.add_argument("--device", help=f"device type ({', '.join(DEVICES)}) (or --target)")
    p.add_argument("--target", metavar="NAME",
                   help="a named slice or GPU count giving both: v5e-8, v6e-256, v5p-32 (TensorCores: 16 chips), "
                        "v4-128, 2xv5p-128, h100-64")
    p.add_argument("--devices-per-host", type=int, help="fast-domain size (default: the device type's)")
    p.add_argument("--attention", choices=("auto", "xla", "fused"), default="auto",
                   help="auto: the attention the config's model.attention compiles to on the device type's platform "
                        "(cuDNN on GPU, splash on TPU where the shapes allow: fused; else XLA's); xla: materialised "
                        "scores; fused: a flash-style kernel")
    p.add_argument("--noise-scale", type=float, help="gradient noise scale B_simple (sequences): cap the batch near it")
    p.add_argument("--noise-scale-from", metavar="WORKDIR", help="the last noise_scale in WORKDIR/metrics.jsonl")
    p.add_argument("--top", type=int, default=5, help="layouts to show")
    p.add_argument("--json", action="store_true", help='print {"layouts": [...]} best first')
    p.add_argument("--verify", type=int, metavar="K",
                   help="compile the best K layouts for --target (nothing runs) and print compiled against planned "
                        "memory and collective bytes; a layout the compiler says does not fit is dropped")


def _target_devices(args: argparse.Namespace) -> tuple[int, Device, int | None]:
    """(device count, device type, fast-domain size or None) from --target, or --devices/--device.
    A target's count and type are its own: a --devices or --device that disagrees is refused."""
    name = getattr(args, "target", None)
    if name is None:
        if args.devices is None or args.device is None:
            raise UserError("plan: give --devices N and --device TYPE, or --target NAME (e.g. v5p-32, h100-64)")
        return args.devices, _device(args.device), None
    from parallax.parallel.targets import target

    t = target(name)
    if args.devices is not None and args.devices != t.devices:
        raise UserError(f"--devices {args.devices}: --target {t.name} has {t.devices} devices ({t.chips} chips); "
                        "drop --devices or make it match")
    if t.device_type is None:
        raise UserError(f"--target {t.name}: the planner has no device entry for {t.name.split('-')[0]} yet "
                        f"(known device types: {', '.join(DEVICES)})")
    dev = DEVICES[t.device_type]
    if args.device is not None and _device(args.device) is not dev:
        raise UserError(f"--device {args.device}: --target {t.name} is {dev.name}; drop --device or make it match")
    return t.devices, dev, t.fast_domain


def plan_command(args: argparse.Namespace) -> int:
    if getattr(args, "target", None) is not None:  # before anything below imports JAX
        from parallax.parallel.targets import cpu_only_jax

        cpu_only_jax()
    if args.verify is not None and (args.verify <= 0 or getattr(args, "target", None) is None):
        raise UserError(f"--verify {args.verify}: " + ("must be positive" if args.verify <= 0 else
                        "needs --target NAME (the compiler to verify with, e.g. v5e-8, v5p-32)"))
    args.devices, dev, domain = _target_devices(args)
    if args.devices <= 0:
        raise UserError(f"--devices: must be positive, got {args.devices}")
    per_host = args.devices_per_host or domain or dev.per_host
    if per_host <= 0:
        raise UserError(f"--devices-per-host: must be positive, got {per_host}")
    w, cfg, note = _workload(args)
    notes = [note] if note else []
    if args.attention == "auto":  # what the program will run on this device type (parallelism.attention_kernel)
        from parallax.parallelism import attention_kernel

        kernel = attention_kernel(cfg, dev.platform)
        args.attention = kernel  # the cost model reads 'cudnn' and 'splash' as fused kernels
        notes.append(f"attention: {kernel} (model.attention={cfg.model.attention!r} on {dev.name}), planned as "
                     f"{'XLA with materialised scores' if kernel == 'xla' else 'a fused kernel (no [B, N, T, T])'}")
    if args.noise_scale is not None and args.noise_scale_from is not None:
        raise UserError("plan: give --noise-scale or --noise-scale-from, not both")
    noise_scale = noise_scale_from(args.noise_scale_from) if args.noise_scale_from is not None else args.noise_scale
    if noise_scale is not None:
        splittable = lambda b: np.size(candidates(dataclasses.replace(w, global_batch=b), args.devices).data) > 0  # noqa: E731
        batch, msg = cap_batch(w.global_batch, noise_scale, splittable)
        if msg:
            notes.append(msg)
            w = dataclasses.replace(w, global_batch=batch)
    from parallax.parallel.targets import all_reduce_groups  # (no JAX)
    groups = all_reduce_groups(getattr(args, "target", None), next(k for k, v in DEVICES.items() if v is dev), args.devices)
    result = search(w, args.devices, dev, per_host, args.attention, cfg.fp8.enabled, max(args.top, args.verify or 1),
                    all_reduce_groups=groups)
    if result.searched == 0:
        raise UserError(_no_factorization(w, args.devices))
    if not result.layouts:
        least = min_memory(w, args.devices, dev, args.attention)
        more = smallest_fitting_count(w, args.devices, dev, args.attention, min(per_host, args.devices))
        raise UserError(
            f"no layout of {cfg.name} fits {dev.name} memory on {args.devices} devices (the leanest needs "
            f"{least / GiB:.1f} GiB of {dev.hbm_bytes * USABLE_MEMORY / GiB:.1f} usable); "
            + (f"the smallest device count that fits is {more}" if more else "no device count up to 4M fits"))
    checked, dropped = [], []
    if args.verify:
        w_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch=w.global_batch))
        checked = verify(w_cfg, result.layouts[:args.verify], args.target, dev)
        for row, v in zip(result.layouts, checked):
            row["verified"] = v
        dropped = [r for r in result.layouts[:args.verify] if not r["verified"]["fits"]]
    if args.json:
        print(json.dumps({"layouts": [r for r in result.layouts if r not in dropped], "dropped": dropped,
                          "searched": result.searched, "fitting": result.fitting,
                          "search_s": round(result.seconds, 3), "notes": notes}))
        return 0
    n_params = sum(v for k, v in _param_counts(cfg.model).items() if k != "total")
    on = f"{dev.name} (target {args.target})" if getattr(args, "target", None) else dev.name
    print(f"plan: {cfg.name} ({n_params / 1e9:.1f}B params, batch {w.global_batch} x {w.seq_len}) on {args.devices} "
          f"{on} ({per_host} per fast domain); {result.searched} layouts searched, {result.fitting} fit, "
          f"{result.seconds:.2f} s")
    for line in notes:
        print(f"note: {line}")
    head = f"{'#':>2} {'data':>5} {'tensor':>6} {'seq':>3} {'pipe':>4} {'expert':>6} {'zero':>4} {'micro':>5} {'schedule':>10} " \
           f"{'remat':>21} {'GiB':>6} {'step s':>8} {'bubble':>6} {'MFU':>6}"
    print(head)
    for i, r in enumerate(result.layouts, 1):
        sched = r["schedule"] + (f"x{r['repeats']}" if r["repeats"] > 1 else "")
        seq = ("SP(D)" if r.get("sequence_parallel_dim") == "embed" else "SP") if r["sequence_parallel"] else "-"
        print(f"{i:>2} {r['data']:>5} {r['tensor']:>6} {seq:>3} {r['pipe']:>4} {r['expert']:>6} {r['zero']:>4} "
              f"{r['microbatches']:>5} {sched:>10} {r['remat']:>21} {r['memory_gib']:>6.1f} {r['step_time_s']:>8.3f} "
              f"{r['bubble']:>6.1%} {r['mfu']:>6.1%}")
    if checked:
        print(f"verified on {args.target} (compiled by its compiler, not run):")
        for i, v in enumerate(checked, 1):
            print("  " + _verified_text(i, v, dev.hbm_bytes * USABLE_MEMORY / GiB))
    kept = [r for r in result.layouts if r not in dropped]
    if not kept:
        raise UserError(f"plan: the compiler for {args.target} says none of the {len(checked)} verified layouts of "
                        f"{cfg.name} fits ({dev.hbm_bytes * USABLE_MEMORY / GiB:.1f} GiB usable); see the table above")
    print(explain(kept[0], dev, per_host, args.devices))
    return 0


def _param_counts(m: ModelConfig) -> dict[str, int]:
    from parallax.model.transformer import count_params

    return count_params(m)
