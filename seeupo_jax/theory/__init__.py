"""Theory checks: multi-turn contextual bandits with exact returns.

Modules: `bandit` (the problem, enumeration, exact J and J*), `instances`
(instance families), `policies` (tabular and shared log-linear),
`algorithms` (SeeUPO and baselines built from `seeupo_jax.losses`),
`report` (statistics, table, plots), `sweep` (the comparison behind
`python experiments/run.py --config=bandit`). See docs/theory.md.
"""
