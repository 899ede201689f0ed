"""parallax: JAX/XLA SPMD training over one ('data', 'tensor', 'pipe', 'expert') mesh.

Importing the package does not import JAX, so the CLI can size the simulated CPU device count
before JAX starts. Import the submodules (`parallax.parallel.sharding`, `parallax.model.transformer`,
...) directly.
"""

__version__ = "0.1.0"
