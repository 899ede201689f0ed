"""A training run: processes and signals, optimizer, state and layout, data, the step, checkpoints, metrics, `build` and the loop."""
