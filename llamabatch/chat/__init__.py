"""Chat: the model's template rendered with Jinja, tool calls and reasoning parsed out of its answers."""

from .reasoning import Reasoning
from .template import ChatTemplate
from .tools import ToolCall, ToolFormat, Tools

__all__ = ["ChatTemplate", "Reasoning", "ToolCall", "ToolFormat", "Tools"]
