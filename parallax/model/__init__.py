"""Single-device math: layers, attention, FP8, MoE and the transformer. Logical axis names only; parallelism (ZeRO-3 placement, the expert exchange, FP8's amax axes) is injected."""
