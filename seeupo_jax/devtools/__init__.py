"""Developer tools that read what a compiled program does; training and sampling never use them.

    hlo_collectives.py   the collective ops of a compiled XLA program and the bytes they move
    aot.py               ahead-of-time compiles for TPU slices and GPU nodes: abstract train
                         states and batches, per-chip bytes, flops and roofline bounds

The benchmarks and tests that measure a sharding layout use them
(`from seeupo_jax.devtools import hlo_collectives`).
"""
