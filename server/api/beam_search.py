"""``use_beam_search`` on /v1/completions and /v1/chat/completions, as vLLM serves it: the
search runs here, in front of the engine (server/engine/beam_search.py), each step's beams
submitted as engine requests of one token; the answer is one finished output whose ``n``
completions are the best beams, best first. Streamed, it arrives whole in one chunk per
choice, as in vLLM.

Only what beam search honours may come with it: the fields that steer sampling (stop
strings, penalties, logit bias, structured outputs, tools...) are refused with a 400
naming them instead of being ignored.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from pydantic import ValidationError

from server.api.admission import Lease
from server.api.errors import APIError
from server.api.protocol import SamplingFields
from server.api.serving import RequestTag, ServingContext, accumulate
from server.engine.beam_search import MAX_BEAM_WIDTH, BeamSearch, BeamSearchParams
from server.engine.inputs import PromptBuilder
from server.engine.lora.request import LoRARequest
from server.engine.outputs import RequestOutput

# request fields beam search does not honour: refused when set (their unset values)
_NOT_WITH_BEAMS = {
    "stop": (None, []), "stop_token_ids": (None, []), "logit_bias": (None, {}),
    "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0),
    "repetition_penalty": (None, 1.0), "top_p": (None, 1.0), "top_k": (None, -1, 0),
    "min_p": (None, 0.0), "min_tokens": (None, 0), "seed": (None,), "bad_words": (None, []),
    "allowed_token_ids": (None, []), "structured_outputs": (None,), "guided_json": (None,),
    "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "response_format": (None,), "tools": (None, []), "prompt_logprobs": (None,),
    "echo": (None, False), "best_of": (None, 1), "suffix": (None, ""),
}


def beam_params(req: SamplingFields, max_tokens: int, logprobs: int | None
                ) -> BeamSearchParams | None:
    """The search ``req`` asks for (None: no ``use_beam_search``); a 400 naming a field that
    cannot come with it. ``n`` is the beam width (vLLM's reading)."""
    extra = req.model_extra or {}
    if not extra.get("use_beam_search"):
        return None
    for name, unset in _NOT_WITH_BEAMS.items():
        value = getattr(req, name, extra.get(name))
        if name == "response_format" and getattr(value, "type", None) == "text":
            continue  # plain text, as without it
        if name == "best_of" and value == req.n:
            continue
        if value not in unset:
            raise APIError(400, f"{name} cannot be used with use_beam_search (beam search "
                                "ranks beams by the model's own logprobs)", name)
    if logprobs is not None and logprobs > MAX_BEAM_WIDTH * 2:
        raise APIError(400, "logprobs with use_beam_search: at most "
                            f"{MAX_BEAM_WIDTH * 2}", "logprobs")
    try:
        return BeamSearchParams(
            beam_width=req.n, max_tokens=max_tokens, ignore_eos=bool(req.ignore_eos),
            temperature=req.temperature or 0.0,
            length_penalty=float(extra.get("length_penalty", 1.0)),
            early_stopping=bool(extra.get("early_stopping", False)),
            include_stop_str_in_output=bool(req.include_stop_str_in_output))
    except (ValidationError, TypeError, ValueError) as exc:
        if isinstance(exc, ValidationError) and exc.errors()[0]["loc"] == ("beam_width",):
            raise APIError(400, f"n: at most {MAX_BEAM_WIDTH} beams with use_beam_search",
                           "n") from None
        raise APIError(400, f"use_beam_search: {exc}", "length_penalty") from None


async def submit_beam_search(ctx: ServingContext, tag: RequestTag, build: PromptBuilder,
                             params: BeamSearchParams, *, index: int | None = None,
                             lora: LoRARequest | None = None, logprobs: int | None = None
                             ) -> AsyncIterator[RequestOutput]:
    """Admits the search's ``beam_width`` sequences (429 / 503 as for any request), builds
    its prompt on a worker, and returns the stream of its one finished output."""
    num_waiting = ctx.engine.stats().num_waiting if ctx.max_waiting_requests else 0
    lease = ctx.clients.admit(tag.client, params.beam_width, num_waiting,
                              ctx.max_waiting_requests)
    try:
        given = await ctx.workers.run(tag.client, build)
    except BaseException:
        lease.release()
        raise
    prompt = given.prompt
    ids = ctx.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    return _search(ctx, tag, ids, params, index, lora, logprobs, lease)


async def _search(ctx: ServingContext, tag: RequestTag, ids: list[int],
                  params: BeamSearchParams, index: int | None, lora: LoRARequest | None,
                  logprobs: int | None, lease: Lease) -> AsyncIterator[RequestOutput]:
    search = BeamSearch(ids, params, ctx.engine.tokenizer.hf.eos_token_id, ctx.max_model_len)
    expansion = search.expansion_params()
    base = tag.engine_id(index)
    running: list[str] = []
    try:
        while not search.done:
            running = [f"{base}-beam{search.steps}.{j}" for j in range(len(search.beams))]
            streams = await asyncio.gather(*(
                ctx.engine.submit(rid, beam, expansion, client=tag.client,
                                  offload=ctx.workers.offload(tag.client), lora_request=lora)
                for rid, beam in zip(running, search.pending())))
            finals = await asyncio.gather(*(accumulate(s) for s in streams))
            if any(not f.outputs[0].logprobs for f in finals):
                raise APIError(503, "the beam search was interrupted: the engine aborted its "
                                    "requests (shutdown or sleep)")
            search.advance([f.outputs[0].logprobs[0] for f in finals])
        running = []
        yield await ctx.workers.run(tag.client, search.output, base,
                                    ctx.engine.tokenizer.decode, logprobs)
    finally:
        for rid in running:  # a client gone mid-step: its expansions stop too
            ctx.engine.abort(rid)
        lease.release()
