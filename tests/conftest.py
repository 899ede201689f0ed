"""Every test runs on 8 simulated CPU devices; the flags must be set before JAX is imported.

LLVM optimisation is off (`--xla_backend_optimization_level=0`, as `parallax audit` compiles):
the tests are compile-bound on tiny models, and it cuts compile time by ~45% (the 18-case
pipeline grid: 135 s -> 75 s). Partitioning, collectives, buffer assignment and the memory
analysis come from the same optimized HLO either way (BUILD_NOTES.md); only machine-code
generation is cheaper. Subprocesses started by tests inherit both flags.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
