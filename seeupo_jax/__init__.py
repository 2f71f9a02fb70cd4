"""seeupo-jax: SeeUPO (arXiv 2602.06554) in JAX/Flax."""

__version__ = "0.1.0"
