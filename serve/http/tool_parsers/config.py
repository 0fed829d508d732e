"""The server's tool-calling settings."""

from __future__ import annotations

import dataclasses

from serve.http.tool_parsers.registry import TOOL_PARSERS


@dataclasses.dataclass
class ToolConfig:
    """The server's tool settings (--tool-call-parser, --enable-auto-tool-choice)."""

    parser: str | None = None
    enable_auto_tool_choice: bool = False

    def __post_init__(self) -> None:
        if self.parser is not None and self.parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {sorted(TOOL_PARSERS)}, got {self.parser!r}")
        if self.enable_auto_tool_choice and self.parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
