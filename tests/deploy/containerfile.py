"""A Containerfile read as its instructions: continuation lines joined, comments and
blank lines dropped, grouped by stage."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Stage:
    base: str
    name: str
    steps: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, rest)

    def args(self, instruction: str) -> list[str]:
        return [rest for instr, rest in self.steps if instr == instruction]


def stages(path: Path) -> list[Stage]:
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = [line.strip() for line in text.splitlines()]
    out: list[Stage] = []
    for line in lines:
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        instruction, rest = instruction.upper(), " ".join(rest.split())
        if instruction == "FROM":
            base, _, name = rest.partition(" AS ")
            out.append(Stage(base.strip(), name.strip()))
        elif out:
            out[-1].steps.append((instruction, rest))
    return out
