"""Developer tools that read what a compiled program does; training and sampling never use them.

    hlo_collectives.py   the collective ops of a compiled XLA program and the bytes they move

The benchmarks and tests that measure a sharding layout use them
(`from seeupo_jax.devtools import hlo_collectives`).
"""
