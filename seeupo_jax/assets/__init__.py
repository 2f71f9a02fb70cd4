"""Data files shipped with seeupo_jax (the tokenizer training corpus)."""
