"""POST /v1/update_weights {"path": "...", "abort": false}: new weights from a safetensors file or directory in
the checkpoint's own names, behind the API key like every route but /health and /v1/models.

The update is read and checked off the event loop (memra.weights.update.prepare: a bad name, shape or dtype is
a 400 before anything changes), then handed to the engine (memra.engine.weight_swap: requests in flight finish
on the old weights, or with "abort" end at once; queued ones run on the new). The answer comes when the
weights have landed: {"weights_version": N}. Updates run one at a time: a partial update rebuilds a fused weight
from the values the previous update left (memra.weights.update).
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, StrictBool, StrictStr

from memra.server.bodies import read_json, validate
from memra.weights.update import prepare


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field is refused by name, never ignored
    path: StrictStr
    abort: StrictBool = False


def install_update_weights(app: FastAPI, engine, options, pool) -> None:
    one_at_a_time = asyncio.Lock()  # an update is prepared against the weights the one before it left

    @app.post("/v1/update_weights")
    async def update_weights(request: Request):
        body = validate(UpdateWeightsRequest, await read_json(request, options.max_body_bytes, options.max_json_depth))
        loop = asyncio.get_running_loop()
        async with one_at_a_time:
            prepared = await loop.run_in_executor(pool, prepare, engine.model, body.path)
            version = await asyncio.wrap_future(engine.weight_swaps.submit(prepared, abort=body.abort))
        return {"weights_version": version}
