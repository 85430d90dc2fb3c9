"""Which models a key may see: one rule for every path that names a model (the OpenAI
endpoints, the Open Inference Protocol over REST and gRPC, the seeds' shapes, batches).

A key limited to some models (its ``allowed_models``) is answered for any other model exactly
as for a model that does not exist: the same status, body and code (``model_not_found``),
decided before the model is looked up, so a scoped key cannot learn which models exist.
"""

from __future__ import annotations

from accounts.grants import KeyGrant
from serving.gateway.errors import ModelNotFound
from serving.gateway.routing import ModelRoute, find_model


async def find_model_for(grant: KeyGrant, name: str) -> ModelRoute:
    """The model ``name`` as ``grant`` may use it; ``ModelNotFound`` when it does not exist or
    is outside the key's allowed models (the two are indistinguishable)."""
    if not grant.may_use(name):
        raise ModelNotFound(name)
    return await find_model(name)
