"""Chat messages of tool use in TRL's conversational format: the assistant's tool call and the tool's result.

The environments build their scripted episodes from these, and the datasets (``kdamoe.posttraining.data``) their
conversations, so what the model is trained on matches what TRL renders during rollouts.
"""

from __future__ import annotations

import json


def tool_call_message(name: str, arguments: dict) -> dict:
    """An assistant turn with one tool call. The arguments are JSON text: the chat template writes a string
    as-is, so the rendered call is byte-identical to a dict rendered by ``tojson`` (``json.dumps`` defaults)
    — what the model sees at training time equals what TRL renders from a parsed call — and Arrow needs no
    union schema across tools with different arguments."""
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def tool_result_message(name: str, value) -> dict:
    return {"role": "tool", "name": name, "content": str(value)}
