"""`parallax sample WORKDIR --prompt TEXT [--max-new-tokens N --temperature T --top-p P --top-k K --seed S
--num-samples B --context S --json] [--set mesh.data=.. --set mesh.tensor=..]`.

Loads the newest checkpoint of a training workdir onto a sampling mesh (decode.sampling_config:
data=1 x the run's tensor size by default; `--set mesh.*` names another) and decodes with the KV
cache (decode.py), printing the completion as it comes. Temperature 0 is greedy; a seed fixes the
text. The context is train.seq_len, the length the model was trained on: prompt + new tokens must
fit in it (refused otherwise; the default --max-new-tokens is 64 or what the prompt leaves);
`--context` allocates a longer cache, where rope extrapolates past the trained length.

Output: the completion on stdout as it is decoded (one sample), or each sample after the run
(several). `--json`: stdout holds one JSON object (prompt, completion, token ids, timing) and the
streamed text goes to stderr. The tokenizer is the run's (train/tokenizer.py: bytes for 'stdlib',
a prepared directory's own); `--tokenizer` names a tokenizer.json instead.

No JAX at module load (cli.py imports this module to build its parser).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from parallax.config import Config, UserError


def add_sample_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sample", help="generate text from a training workdir's newest checkpoint")
    p.add_argument("workdir", help="a training run's workdir (holding checkpoints/)")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, metavar="N",
                   help="tokens to generate (default 64, or as many as the context leaves after the prompt)")
    p.add_argument("--temperature", type=float, default=1.0, metavar="T", help="0: greedy (default 1)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus mass in (0, 1] (default 1: off)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely tokens (default 0: off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--num-samples", type=int, default=1, metavar="B",
                   help="completions of the prompt decoded together (a multiple of mesh.data)")
    p.add_argument("--context", type=int, metavar="S",
                   help="positions of the KV cache (default train.seq_len; more: rope extrapolates)")
    p.add_argument("--tokenizer", metavar="PATH", help="a tokenizer.json (default: the run's data source's)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout; stream to stderr")
    p.add_argument("--set", action="append", default=[], metavar="mesh.AXIS=SIZE",
                   help="the sampling mesh (default data=1 x the run's tensor size)")


def meta_config_file(workdir: str | Path) -> dict | None:
    """The newest checkpoint's flat config, read without JAX (only to size the simulated CPU
    devices before JAX starts; the checkpoint is read properly later). None when unreadable."""
    root = Path(workdir) / "checkpoints"
    try:
        steps = sorted((int(p.name) for p in root.iterdir() if p.name.isdigit()), reverse=True)
    except OSError:
        return None
    for step in steps:
        try:
            return json.loads((root / str(step) / "meta" / "metadata").read_text())["config"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def prepare_devices(workdir: str | Path, mesh_sets: list[str], sampling: bool) -> None:
    """Before JAX starts (CPU only): simulate the devices the mesh will need, as train does."""
    from parallax.train.distributed import configure_host_devices

    flat = meta_config_file(workdir)
    if flat is None:
        return  # no checkpoint: the restore says so, in one line
    from parallax.config import MeshConfig, apply_overrides

    mesh = MeshConfig(**{k.split(".", 1)[1]: v for k, v in flat.items() if k.startswith("mesh.")})
    if sampling:
        mesh = MeshConfig(data=1, tensor=mesh.tensor if mesh.tensor > 0 else 1)
    mesh = apply_overrides(Config(mesh=mesh), [s for s in mesh_sets if s.strip().startswith("mesh.")]).mesh
    print(configure_host_devices(Config(mesh=mesh)), file=sys.stderr, flush=True)


def tokenizer_of(cfg: Config, path: str | None):
    from parallax.train.tokenizer import load_tokenizer, tokenizer_for

    tok = load_tokenizer(path) if path else tokenizer_for(cfg)
    if tok.vocab_size > cfg.model.vocab_size:
        raise UserError(f"the tokenizer has {tok.vocab_size} tokens but the model only model.vocab_size="
                        f"{cfg.model.vocab_size}; name the run's own with --tokenizer")
    return tok


class Stream:
    """Writes each new token's text as it comes. Bytes that do not yet decode (a UTF-8 sequence
    cut between tokens) are held back until they do, or until the end."""

    def __init__(self, tok, out):
        self.tok, self.out, self.ids, self.shown = tok, out, [], ""

    def __call__(self, token: int) -> None:
        self.ids.append(int(token))
        text = self.tok.decode(self.ids)
        if text.startswith(self.shown) and not text.endswith("\ufffd"):
            self.out.write(text[len(self.shown):])
            self.out.flush()
            self.shown = text

    def close(self) -> None:
        text = self.tok.decode(self.ids)
        self.out.write(text[len(self.shown):] if text.startswith(self.shown) else "\n" + text)
        self.out.write("\n")
        self.out.flush()


def sample_command(args: argparse.Namespace) -> int:
    prepare_devices(args.workdir, args.set, sampling=True)  # before JAX starts

    import numpy as np

    from parallax.infer.decode import (Decoder, Sampling, check_lengths, mesh_devices, restore_run, sampling_config,
                                       saved_config)

    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    sampling.check()  # before the checkpoint is read
    if args.num_samples < 1:
        raise UserError(f"--num-samples: must be >= 1, got {args.num_samples}")
    if args.prompt == "":
        raise UserError("--prompt: empty; give at least one character")
    from parallax.parallel.mesh import available_devices, describe

    cfg, _ = saved_config(args.workdir)
    devices = available_devices()
    scfg = sampling_config(cfg, args.set, len(devices))
    tok = tokenizer_of(cfg, args.tokenizer)
    ids = tok.encode(args.prompt)
    context = args.context if args.context is not None else cfg.train.seq_len
    if context < 2:
        raise UserError(f"--context: must be >= 2 positions, got {context}")
    new = args.max_new_tokens if args.max_new_tokens is not None else max(min(64, context - len(ids)), 1)
    check_lengths(len(ids), new, context, cfg.train.seq_len)  # before the restore
    built, restored = restore_run(args.workdir, scfg, mesh_devices(scfg, devices))
    decoder = Decoder(built, restored.state.params, args.num_samples, context)
    log = sys.stderr
    print(f"parallax: sampling checkpoint step {restored.step} on {describe(built.mesh)}", file=log, flush=True)
    stream = Stream(tok, sys.stderr if args.json else sys.stdout) if args.num_samples == 1 else None
    prompts = np.tile(np.asarray(ids, np.int32), (args.num_samples, 1))
    gen = decoder.generate(prompts, new, sampling,
                           on_token=(lambda t: stream(t[0])) if stream else None, stop_id=tok.eod_id)
    if stream:
        stream.close()
    samples = []
    for row in gen.tokens:
        row = [int(t) for t in row]
        if tok.eod_id >= 0 and tok.eod_id in row:  # the row's text ends at its end-of-document token
            row = row[: row.index(tok.eod_id) + 1]
        samples.append({"completion": tok.decode(row, skip_special=True), "token_ids": row})
    if not stream:
        out = sys.stderr if args.json else sys.stdout
        for i, s in enumerate(samples):
            print(f"--- sample {i}\n{s['completion']}", file=out, flush=True)
    if args.json:
        record = {"prompt": args.prompt, "prompt_ids": ids, "completion": samples[0]["completion"],
                  "token_ids": samples[0]["token_ids"], "samples": samples, "step": restored.step,
                  "mesh": describe(built.mesh), "context": context,
                  "sampling": {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                               "seed": sampling.seed},
                  "timing": gen.timing}
        print(json.dumps(record), flush=True)
    return 0
