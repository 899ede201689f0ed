"""Cost model, compiled-program audit, presets and the planner: reading a layout without running it."""
