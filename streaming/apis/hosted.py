"""Hosted tools in a request: tools that an API's provider runs on its own side, which
this server cannot run.

Each codec names the tool types it serves itself (`own`: Responses' `function`,
Messages' custom tools, whose `type` is absent or "custom"); every other `type` in
`tools` is hosted: OpenAI's `web_search` (`web_search_preview`, dated variants such as
`web_search_2025_08_26`), `file_search`, `code_interpreter`, `image_generation`,
`computer_use` / `computer_use_preview`, `local_shell`, `mcp`; Anthropic's server
tools (`web_search_20250305`, `code_execution_*`, `bash_*`, `text_editor_*`,
`computer_*`); and any type this server does not know. A tool of an own type, or one
whose `type` is not a tool type at all (absent where required, not a short identifier),
stays for the codec's schema to check: a function tool without a name is still a 400.

The tenant's policy (tenants/tool_policy.py, read from a cache, and only when a request
has hosted tools) decides:
- `drop` (the default): the request goes on without them; the types are named, once
  each in request order, in the reply's `x-sluice-dropped-tools` header and in the
  call's audit event (`detail.dropped_tools`, also when the call is refused later);
- `refuse`: a 400 naming the first one (`tools[1].type`, Messages' `tools.1.type`).
A dropped tool leaves a gap in the numbering: `Hosted.renumbered` puts an error about a
kept tool back under its index in the request as sent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from sluice.errors import ApiError, BadRequest
from streaming.apis import Context
from tenants.models import HostedTools
from tenants.tool_policy import hosted_tools_policy

HEADER = "x-sluice-dropped-tools"
_TYPE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # what may be echoed in a header
_INDEX = re.compile(r"(?<=\btools)(\[|\.)(\d+)")


@dataclass
class Hosted:
    """A request's tools split by `split`: those kept (`kept`, each at `index` in the
    request as sent) and the hosted ones dropped (their types, deduplicated)."""

    kept: list[Any]
    index: list[int] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)

    def renumbered(self, exc: ApiError) -> ApiError:
        """`exc`, naming a kept tool by its index in the request as sent."""
        if not self.dropped:
            return exc

        def back(m: re.Match[str]) -> str:
            i = int(m.group(2))
            return m.group(1) + str(self.index[i] if i < len(self.index) else i)

        exc.message = _INDEX.sub(back, exc.message)
        if exc.param:
            exc.param = _INDEX.sub(back, exc.param)
        return exc


def hosted_type(tool: Any, own: frozenset[str]) -> str | None:
    """The tool's type when it is a hosted tool's, else None."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    if not isinstance(kind, str) or kind in own or not _TYPE.match(kind):
        return None
    return kind


async def split(tenant_id: int, tools: Any, own: frozenset[str], *, dotted: bool = False
                ) -> Hosted:
    """The request's `tools` under the tenant's policy (the module's doc). `dotted`:
    the API names list items as `tools.1` (Anthropic's) rather than `tools[1]`.
    Raises BadRequest under `refuse`."""
    if not isinstance(tools, list):
        return Hosted(tools)
    found = [(i, kind) for i, tool in enumerate(tools)
             if (kind := hosted_type(tool, own)) is not None]
    if not found:
        return Hosted(tools, list(range(len(tools))))
    if await hosted_tools_policy(tenant_id) == HostedTools.REFUSE:
        i, kind = found[0]
        where = f"tools.{i}.type" if dotted else f"tools[{i}].type"
        raise BadRequest(f"{where}: {kind!r} is a hosted tool, which this server cannot "
                         "run (this tenant's hosted tool policy is 'refuse').",
                         param=where,
                         code="invalid_request" if dotted else "unsupported_value")
    gone = {i for i, _kind in found}
    return Hosted([t for i, t in enumerate(tools) if i not in gone],
                  [i for i in range(len(tools)) if i not in gone],
                  list(dict.fromkeys(kind for _i, kind in found)))


async def applied(ctx: Context, own: frozenset[str], *, dotted: bool = False
                  ) -> tuple[dict[str, Any], Hosted]:
    """The request's body with its hosted tools dropped (or a 400 under `refuse`), and
    the split; what was dropped is noted on the call (its header and audit event)."""
    hosted = await split(ctx.principal.tenant_id, ctx.data.get("tools"), own, dotted=dotted)
    if not hosted.dropped:
        return ctx.data, hosted
    named = ",".join(hosted.dropped)
    ctx.call.note({"dropped_tools": named}, {HEADER: named})
    return {**ctx.data, "tools": hosted.kept}, hosted
