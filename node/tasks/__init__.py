"""Verifiable task families and their reward functions.

``TaskSource`` is the entry point: it draws seeded prompts from a mix of families, resolves a
peer's prompt id back to its task, and encodes tasks with the model's chat template.
"""

from pathlib import Path

from hivespec.node.tasks.arithmetic import ArithmeticFamily
from hivespec.node.tasks.base import Task, TaskFamily, extract_answer
from hivespec.node.tasks.counting import CountingFamily
from hivespec.node.tasks.jsonl import JsonlFamily, JsonlTaskError
from hivespec.node.tasks.source import DEFAULT_MIX, SYSTEM_PROMPT, MixEntry, TaskSource, chat_prompt_ids

GSM_MINI_PATH = Path(__file__).resolve().parent / "data" / "gsm_mini.jsonl"

__all__ = [
    "DEFAULT_MIX",
    "GSM_MINI_PATH",
    "SYSTEM_PROMPT",
    "ArithmeticFamily",
    "CountingFamily",
    "JsonlFamily",
    "JsonlTaskError",
    "MixEntry",
    "Task",
    "TaskFamily",
    "TaskSource",
    "chat_prompt_ids",
    "extract_answer",
]
