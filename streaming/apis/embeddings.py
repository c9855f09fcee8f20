"""OpenAI's Embeddings, `POST /v1/embeddings`: a codec over the gateway's embed call,
answered as one `list` of `embedding`s (floats, or base64 of little-endian float32s
with `encoding_format: "base64"`)."""

from __future__ import annotations

from streaming.apis import Api, Context, bodies, register
from streaming.apis.httpio import send_json
from streaming.pipeline.schemas import EmbeddingRequest, parse


class Embeddings(Api):
    path = "/v1/embeddings"
    action = "embeddings"

    async def serve(self, ctx: Context) -> None:
        req = parse(EmbeddingRequest, ctx.data)
        sub = await ctx.call.embed(req)
        await send_json(ctx.send, 200, await bodies.embeddings(sub, req), sub.headers)


register(Embeddings())
