"""OpenAI's Moderations, `POST /v1/moderations`: a codec over the gateway's classify
call (a deployment of kind `classify`: inference/runtimes/classifier.py), answered as
OpenAI's moderation object (`client.moderations.create` reads it).

`model` defaults to SLUICE_MODERATION_MODEL (the shipped prompt-injection classifier,
which `./dev.sh run` deploys). Each input's result has `category_scores` for every
label that flags (a label that is not benign: governance/guardrails/classifier.py),
`categories` true where the score reaches SLUICE_MODERATION_THRESHOLD, and `flagged`
when any is. Text inputs only: a string, a list of strings, or OpenAI's list of
`{"type": "text", "text": ...}` parts (an image part is a 400).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from django.conf import settings
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from governance.guardrails.classifier import counted
from sluice.errors import BadRequest
from streaming.apis import Api, Context, register
from streaming.apis.httpio import send_json
from streaming.pipeline.fold import Fold
from streaming.pipeline.schemas import ModelName, parse

Text = Annotated[str, StringConstraints(min_length=1, max_length=100_000)]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: Text


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["image_url"]


class ModerationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input: Text | Annotated[list[Text], Field(min_length=1, max_length=256)] | Annotated[
        list[TextPart | ImagePart], Field(min_length=1, max_length=256)]
    model: ModelName | None = None


class Moderations(Api):
    path = "/v1/moderations"
    action = "moderations"

    async def serve(self, ctx: Context) -> None:
        req = parse(ModerationRequest, ctx.data)
        inputs = _texts(req.input)
        model = req.model or settings.SLUICE_MODERATION_MODEL
        ctx.call.model = model
        sub = await ctx.call.classify(model, inputs)
        whole = await Fold(sub.events()).whole()
        threshold = float(settings.SLUICE_MODERATION_THRESHOLD)
        flags = counted(whole.labels)
        results = []
        for row in whole.vectors:
            scores = {whole.labels[k]: round(row[k], 6) for k in flags}
            categories = {label: score >= threshold for label, score in scores.items()}
            results.append({"flagged": any(categories.values()), "categories": categories,
                            "category_scores": scores,
                            "category_applied_input_types": {label: ["text"]
                                                             for label in scores}})
        await send_json(ctx.send, 200, {"id": f"modr-{sub.handle.rid}", "model": model,
                                        "results": results}, sub.headers)


def _texts(given: Any) -> list[str]:
    if isinstance(given, str):
        return [given]
    texts = []
    for part in given:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, TextPart):
            texts.append(part.text)
        else:
            raise BadRequest("This moderation model reads text only.", param="input",
                             code="unsupported_input")
    return texts


register(Moderations())
