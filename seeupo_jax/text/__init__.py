"""The text layer: chat messages, tokenizers and chat-template token ids, below everything else.

    messages.py      the chat message type (`Message`) environments speak and templates render
    tokenizer.py     a checkpoint's own tokenizer, or the small offline default
    chat_tokens.py   prompt and observation token ids from the chat template, append only

It imports nothing else from the package; the environments (`seeupo_jax.envs`) and the rollout
build on it. The modules are imported by name (`from seeupo_jax.text import tokenizer`), so
`seeupo_jax.envs` reads the message type without importing transformers.
"""
