"""The chat message type: what environments send and receive and chat templates render."""

from __future__ import annotations

from typing import Any

Message = dict[str, Any]
"""A chat message: {"role": "system" | "user" | "assistant" | "tool", "content": str, ...}."""
