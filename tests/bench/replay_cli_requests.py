"""Replay the captured agent-CLI first requests against a running Sluice, through the
official SDKs, and list every field Sluice refuses.

Each fixture from ``capture_cli_requests.py`` is sent as the CLI sent it (model replaced
by ``--model``): Codex's through ``openai`` ``client.responses.create(stream=True)``,
Claude Code's through ``anthropic`` ``client.beta.messages.create`` (the CLI calls the
beta endpoint, ``/v1/messages?beta=true``, with its ``anthropic-beta`` list). When Sluice
answers 4xx naming a parameter, that parameter is removed (the whole list element when the
path has an index) and the request is sent again, until it is accepted or refused
without a parameter; so one run lists every refusal, not only the first.

    .venv/bin/python tests/bench/replay_cli_requests.py --base-url http://127.0.0.1:8000 \\
        --api-key sk-sluice-... [--model echo] [fixture.json ...]
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import re
import sys
from pathlib import Path
from typing import Any

import anthropic
import openai

FIXTURES = Path(__file__).resolve().parents[1] / "streaming" / "fixtures"


def split_known(create: Any, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The body as SDK keyword arguments, and the keys this SDK version does not know."""
    known = set(inspect.signature(create).parameters)
    return ({k: v for k, v in body.items() if k in known},
            {k: v for k, v in body.items() if k not in known})


def drop(body: dict[str, Any], param: str, whole_element: bool) -> Any:
    """Removes what ``param`` names from ``body`` (with ``whole_element``, the list element
    the path indexes); returns what was removed, None when nothing was."""
    parts = [p for p in re.split(r"\.|\[(\d+)\]", param) if p]
    indexed = max((i for i, p in enumerate(parts) if p.isdigit()), default=None)
    if indexed is not None and whole_element:
        parts = parts[:indexed + 1]
    node: Any = body
    for part in parts[:-1]:
        key: Any = int(part) if part.isdigit() else part
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return False
    last: Any = int(parts[-1]) if parts[-1].isdigit() else parts[-1]
    try:
        return node.pop(last)
    except (KeyError, IndexError, TypeError, AttributeError):
        return None


def summary(value: Any) -> str:
    """A short description of a removed value (a tool by its type and name)."""
    if isinstance(value, dict) and "type" in value:
        return f"{{type: {value['type']!r}, name: {value.get('name')!r}}}"
    text = json.dumps(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} chars)"


def error_fields(exc: Any) -> dict[str, Any]:
    body = getattr(exc, "body", None)
    err = body.get("error", body) if isinstance(body, dict) else {}
    if not isinstance(err, dict):
        err = {"message": str(err)}
    return {"status": getattr(exc, "status_code", None), "type": err.get("type"),
            "code": err.get("code"), "param": err.get("param"),
            "message": err.get("message") or str(exc)}


def send_openai(client: openai.OpenAI, body: dict[str, Any]) -> dict[str, Any]:
    kwargs, extra = split_known(client.responses.create, body)
    kwargs["stream"] = True
    events, text, usage, failure = 0, "", None, None
    with client.responses.create(**kwargs, extra_body=extra or None) as stream:
        for event in stream:
            events += 1
            if event.type == "response.output_text.delta":
                text += event.delta
            elif event.type in ("response.completed", "response.incomplete",
                                "response.failed"):
                usage = event.response.usage
                if event.type != "response.completed":
                    failure = event.response.error or event.response.incomplete_details
            elif event.type == "error":
                failure = event
    return {"events": events, "text_chars": len(text),
            "usage": usage.model_dump() if usage else None,
            "failure": str(failure) if failure else None}


def send_anthropic(client: anthropic.Anthropic, body: dict[str, Any],
                   betas: list[str]) -> dict[str, Any]:
    kwargs, extra = split_known(client.beta.messages.create, body)
    kwargs["stream"] = True
    events, text, usage = 0, "", {}
    stream = client.beta.messages.create(**kwargs, betas=betas, extra_body=extra or None)
    for event in stream:
        events += 1
        if event.type == "message_start":
            usage["input_tokens"] = event.message.usage.input_tokens
        elif event.type == "content_block_delta" and event.delta.type == "text_delta":
            text += event.delta.text
        elif event.type == "message_delta":
            usage["output_tokens"] = event.usage.output_tokens
    return {"events": events, "text_chars": len(text), "usage": usage}


def sizes(body: dict[str, Any]) -> dict[str, int]:
    """Characters of the parts that make up the prompt."""
    out = {"body_json": len(json.dumps(body))}
    for key in ("instructions", "input", "system", "messages", "tools"):
        if key in body:
            out[key] = len(json.dumps(body[key]))
    return out


def replay(path: Path, base_url: str, api_key: str, model: str,
           max_tokens: int | None) -> dict[str, Any]:
    data = json.loads(path.read_text())
    body = copy.deepcopy(data["body"])
    body["model"] = model
    is_openai = data["path"].split("?")[0].endswith("/responses")
    if max_tokens is not None:
        body["max_output_tokens" if is_openai else "max_tokens"] = max_tokens
    refusals: list[dict[str, Any]] = []
    result: dict[str, Any] = {"fixture": path.name, "sizes": sizes(body)}
    oa = openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=120)
    an = anthropic.Anthropic(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    betas = [b for b in data["headers"].get("anthropic-beta", "").split(",") if b]
    for _ in range(30):
        try:
            result["accepted"] = (send_openai(oa, body) if is_openai
                                  else send_anthropic(an, body, betas))
            break
        except (openai.APIStatusError, anthropic.APIStatusError) as exc:
            err = error_fields(exc)
            refusals.append(err)
            param = err["param"]
            # Anthropic's error shape has no param: the validator names it first.
            named = re.match(r"([\w\-\[\].]+): ", str(err["message"]))
            if not param and named:
                param = named.group(1)
            extra_field = "Extra inputs are not permitted" in str(err["message"])
            if err["code"] == "tools_not_supported" or "cannot call tools" in str(
                    err["message"]):
                param, extra_field = "tools", True  # the model, not the schema: go on
            removed = drop(body, str(param), not extra_field) if param else None
            if removed is None:
                result["final_refusal"] = err
                break
            err["removed"] = summary(removed)
    result["refusals"] = refusals
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", required=True, help="Sluice, without /v1")
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--model", default="echo")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="override the output limit the CLI asked for")
    parser.add_argument("fixtures", nargs="*", type=Path)
    args = parser.parse_args()
    paths = args.fixtures or [FIXTURES / "codex_0.171.0_first_request.json",
                              FIXTURES / "claude_code_2.1.332_first_request.json"]
    for path in paths:
        print(json.dumps(replay(path, args.base_url.rstrip("/"), args.api_key, args.model,
                                args.max_tokens), indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
