"""The training program's host-side parts: what runs around the jitted learner update.

`checkpoints` saves and resumes the learner state, the PRNG key and the loop's progress with
orbax (keep-last-N, a save interval, atomic saves, a fall back past unreadable checkpoints, a
clear error when the workdir belongs to a different model or config); `metrics_log` writes one
JSON line per iteration plus TensorBoard events (skipping torn lines when it reads), plots the
curves and formats evaluation tables; `workdir` checks and locks a run's directory;
`config` turns the ConfigDict into one frozen, typed config tree, checked once, before anything
is built (`config.typed`). The model's HF
safetensors export stays in `seeupo_jax.models.checkpoint`.
"""
