"""The table of llama.cpp's chat template collection that docs/guides/tool-calls.md shows: for each
template, the tool-call family llamabatch reads in it, its thinking form, and what is polyfilled.
Reads the collection scripts/build_native.sh keeps; `python scripts/template_table.py` prints it
(tests/test_chat.py checks that the page holds what it prints)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from llamabatch.chat import ChatTemplate, Reasoning, ToolFormat  # noqa: E402
from tiny_model import real_templates_folder  # noqa: E402

HEADER = "| template | tool calls | thinking | system role |\n| --- | --- | --- | --- |"
ASK = [{"role": "user", "content": "Hi"}]


def thinking(template: ChatTemplate) -> str:
    on = Reasoning.of(template.source, template.render(ASK, enable_thinking=True))
    if on is None:
        return "none"
    off = Reasoning.of(template.source, template.render(ASK, enable_thinking=False))
    opened = f"`{on.markup.open.strip()}` " + ("opened by the prompt" if on.open else "opened by the model")
    if off is None:
        return f"{opened}; off: the template closes it"
    if off.open:
        return f"{opened}; off: closed in the prompt"
    return f"{opened}; off: closed as it opens"


def row(path: Path) -> str:
    template = ChatTemplate(path.read_text(), path.stem, "<s>", "</s>")
    format = ToolFormat.detect(template.source)
    calls = format.name if format.renders_tools else "generic (tools described in a system message)"
    system = "yes" if template.has_system_role else "folded into the first user message"
    return f"| {path.stem} | {calls} | {thinking(template)} | {system} |"


def table() -> str:
    return "\n".join([HEADER, *(row(path) for path in sorted(real_templates_folder().glob("*.jinja")))])


if __name__ == "__main__":
    print(table())
