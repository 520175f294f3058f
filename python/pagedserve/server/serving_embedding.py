"""POST /v1/embeddings (vLLM's serving_embedding.py): each input runs as a
prefill-only request through the same engine and scheduler as generation
(PoolingParams; engine/pooling.py), and its final hidden states are pooled
into one unit vector (--embedding-pooling last|mean)."""

from __future__ import annotations

import base64

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from ..engine.outputs import PoolingRequestOutput
from ..pooling_params import PoolingParams
from .embeddings_protocol import MAX_INPUTS, EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from .errors import APIError
from .protocol import PromptTokensDetails
from .serving import OpenAIServing, response_id


def encode_embedding(vector, encoding_format: str) -> list[float] | str:
    """A float32 vector [hidden_size] as the response carries it: a list of
    floats (each float32 exactly), or base64 of its little-endian float32
    bytes (what the openai SDK decodes with numpy)."""
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


class OpenAIServingEmbedding(OpenAIServing):
    """Answers EmbeddingRequests."""

    async def create(self, req: EmbeddingRequest, raw: Request) -> EmbeddingResponse:
        """Raises APIError 400 (bad input, a prompt that leaves no token of
        max_model_len free, `dimensions`), 404 (model), 503 (engine
        failure); ClientDisconnected aborts every input's request."""
        self.check_model(req.model)
        if req.dimensions is not None:
            raise APIError(400, f"`dimensions` is not supported by this server: {self.model_name}'s embeddings have "
                                f"its hidden size ({self.core.model.config.get_text_config().hidden_size})",
                           param="dimensions", code="unsupported_parameter")
        self.check_priority(req.priority)
        if isinstance(req.input, list) and req.input and not isinstance(req.input[0], int) \
                and len(req.input) > MAX_INPUTS:
            raise APIError(400, f"`input` holds {len(req.input)} inputs; at most {MAX_INPUTS} per request",
                           param="input")
        prompts = await run_in_threadpool(self.prompts, req.input, req.add_special_tokens, "input")
        prompts = [self.truncate(req, p, keep_free=1) for p in prompts]  # -1: max_model_len - 1, what fits
        for i, p in enumerate(prompts):
            if len(p) >= self.core.max_model_len:
                raise APIError(400, f"embedding an input of {len(p)} tokens needs one token of the context free "
                                    f"(max_model_len {self.core.max_model_len}): the engine runs it as a prefill "
                                    f"that samples one token and drops it; use truncate_prompt_tokens "
                                    f"{self.core.max_model_len - 1} or a shorter input",
                               param="input" if len(prompts) == 1 else f"input[{i}]")
        params = PoolingParams(self.core.args.embedding_pooling, normalize=req.normalize)
        request_id = response_id(raw, "embd")
        outputs: list[PoolingRequestOutput] = await self.generate_final(
            raw, prompts, [params] * len(prompts), request_id, None, req.priority)
        if any(o.embedding is None for o in outputs):
            raise APIError(503, "the engine stopped before every input was embedded", "service_unavailable")
        data = await run_in_threadpool(lambda: [EmbeddingData(index=i, embedding=encode_embedding(
            o.embedding, req.encoding_format)) for i, o in enumerate(outputs)])
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        cached = sum(o.num_cached_tokens for o in outputs)
        return EmbeddingResponse(id=request_id, model=self.model_name, data=data,
                                 usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens,
                                                      prompt_tokens_details=PromptTokensDetails(cached_tokens=cached)))
