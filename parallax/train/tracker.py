"""Weights & Biases beside metrics.jsonl and TensorBoard (`metrics.wandb=true`).

Off by default, and then wandb is never imported: nothing changes when the package is absent.
On, every record MetricsWriter writes goes to W&B at its step, the run's flattened config is the
W&B run's config, and the run is finished when the writer closes. Files go under WORKDIR/wandb
(W&B's `dir`). The default mode is offline: no network at all, `wandb sync WORKDIR/wandb/offline-run-*`
uploads later. A resume reuses the W&B run id kept in WORKDIR/wandb/parallax_run_id, so an online
run continues the same W&B run; W&B takes no step below the one it has reached, so the steps a
resume repeats keep their first values there (metrics.jsonl holds the repeated ones).
"""

from __future__ import annotations

import importlib
import math
import secrets
import string
import sys
from pathlib import Path

from parallax.config import Config, ConfigError, UserError, choice_error, flatten

WANDB_MODES = ("offline", "online", "disabled")  # metrics.wandb_mode
RUN_ID_FILE = "parallax_run_id"


def check_tracker(cfg: Config) -> None:
    """Before JAX starts: the mode's name, and, with metrics.wandb on, that wandb imports (one
    line naming the package otherwise). Imports wandb only when it is on."""
    m = cfg.metrics
    if m.wandb_mode not in WANDB_MODES:
        raise ConfigError(choice_error("metrics.wandb_mode", m.wandb_mode, WANDB_MODES))
    if not m.wandb:
        return
    try:
        importlib.import_module("wandb")
    except ImportError as e:
        why = "is not installed" if isinstance(e, ModuleNotFoundError) and e.name == "wandb" else f"failed to import ({e})"
        raise UserError(f"metrics.wandb=true needs the package 'wandb', which {why}: pip install wandb "
                        "(or set metrics.wandb=false)") from None


class WandbTracker:
    """One W&B run for one training process (process 0 only)."""

    def __init__(self, cfg: Config, workdir: Path, resuming: bool):
        import wandb

        m = cfg.metrics
        directory = Path(workdir) / "wandb"
        directory.mkdir(parents=True, exist_ok=True)
        id_file = directory / RUN_ID_FILE
        run_id = id_file.read_text().strip() if resuming and id_file.exists() else ""
        if not run_id:
            run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # as W&B's own
            id_file.write_text(run_id + "\n")
        self.error: str | None = None
        # console="off": W&B would otherwise wrap stdout/stderr, and parallax's one-line errors go there.
        self.run = wandb.init(project=m.wandb_project, name=m.wandb_name or cfg.name, mode=m.wandb_mode,
                              dir=str(workdir), id=run_id, resume="allow", config=flatten(cfg),
                              settings=wandb.Settings(console="off", silent=True))

    def log(self, values: dict, step: int) -> None:
        """A metrics record at its step; None and non-numbers are left out (W&B's charts want numbers)."""
        if self.run is None or step < (self.run.step or 0):
            return
        data = {k: v for k, v in values.items() if k != "step" and isinstance(v, (int, float))
                and not isinstance(v, bool) and math.isfinite(v)}
        try:
            self.run.log(data, step=step)
        except Exception as e:  # best effort, as TensorBoard: metrics.jsonl is the record
            self.error = self.error or f"{type(e).__name__}: {e}"

    def finish(self, failed: bool = False) -> None:
        if self.run is None:
            return
        run, self.run = self.run, None
        try:
            run.finish(exit_code=1 if failed else 0)
        except Exception as e:
            self.error = self.error or f"{type(e).__name__}: {e}"
        if self.error:
            print(f"parallax: warning: W&B could not take every record ({self.error}); metrics.jsonl holds them",
                  file=sys.stderr, flush=True)
