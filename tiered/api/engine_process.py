"""The engine process: an Engine behind two ZMQ sockets (requests in, responses out).

It drains every waiting request message before each step, so the scheduler sees all of them
(a scoring call's N items arrive together), runs one request per step, and sends each result
as soon as it is computed. A request the engine refuses gets a response with `error` set.
"""

from __future__ import annotations

import logging

import zmq

from tiered.api.protocol import Ready, ScoreRequest, ScoreResponse, decode, encode
from tiered.config import Config
from tiered.engine import Engine, ScoreParams
from tiered.hybrid.forward import ForwardInputError

log = logging.getLogger(__name__)


def serve_engine(config: Config, request_addr: str, response_addr: str) -> None:
    """Run until the process is terminated."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine: %(message)s", datefmt="%H:%M:%S")
    ctx = zmq.Context()
    requests = ctx.socket(zmq.PULL)
    requests.connect(request_addr)
    responses = ctx.socket(zmq.PUSH)
    responses.connect(response_addr)
    with Engine(config) as engine:
        responses.send(encode(Ready(engine.max_model_len, engine.model.args.vocab_size)))
        poller = zmq.Poller()
        poller.register(requests, zmq.POLLIN)
        while True:
            busy = len(engine.scheduler) > 0
            if dict(poller.poll(0 if busy else 100)):
                while True:
                    try:
                        frame = requests.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    _submit(engine, decode(frame), responses)
            result = engine.step()
            if result is not None:
                responses.send(
                    encode(
                        ScoreResponse(
                            request_id=result.request_id,
                            token_id=result.token_id,
                            logprobs=list(result.logprobs.items()),
                            top_logprobs=result.top_logprobs,
                            num_tokens=result.num_tokens,
                            num_device_hit_tokens=result.split.num_device_hit_tokens,
                            num_host_hit_tokens=result.split.num_host_hit_tokens,
                            queued_seconds=result.queued_seconds,
                            compute_seconds=result.compute_seconds,
                            jct_error=engine.jct.error,
                        )
                    )
                )


def _submit(engine: Engine, req: ScoreRequest, responses: zmq.Socket) -> None:
    try:
        engine.submit(req.token_ids, ScoreParams(tuple(req.logprob_token_ids), req.top_logprobs), req.request_id)
    except ForwardInputError as exc:
        responses.send(encode(ScoreResponse(request_id=req.request_id, error=str(exc))))
