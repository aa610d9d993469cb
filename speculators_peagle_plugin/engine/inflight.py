"""A closed-loop client for a vLLM ``LLMEngine``: exactly ``concurrency`` requests in flight.

One engine serves every concurrency of a sweep: it is built with ``max_num_seqs`` = the
largest concurrency, and :func:`drive` decides how many requests the engine holds. The
scheduler can only run requests that were added, so adding ``concurrency`` of them and
one more each time one finishes keeps the engine at exactly ``concurrency`` running
requests (fewer only as the prompt list runs out), like ``concurrency`` users who each
send their next request when the previous answer arrives. A finished request may bring
follow-ups (a conversation's next turn), which run before the requests not started yet, so
that their prompt's prefix is still in the engine's prefix cache. Pure Python, so that the
fast tests can drive a fake engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

Request = tuple[str, object, object]  # (request id, prompt, sampling params)


def drive(
    engine,
    requests: Sequence[Request],
    concurrency: int,
    on_finished: Callable[[object], Iterable[Request] | None],
) -> int:
    """Feed ``requests`` (``(request_id, prompt, sampling params)``) to ``engine`` keeping
    ``concurrency`` in flight; ``on_finished`` gets every finished ``RequestOutput`` and may
    return follow-up requests, which go ahead of every request not started yet, in order.

    Args:
        engine: anything with vLLM ``LLMEngine``'s ``add_request(id, prompt, params)``,
            ``step() -> [RequestOutput]`` and ``has_unfinished_requests()``.
        concurrency: requests in flight, >= 1.

    Returns the largest number of requests the engine held at once.
    Example: 5 requests, concurrency 2 -> the engine holds 2 until the last one runs alone;
    a follow-up of the first to finish is the next request added.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}.")
    pending = list(reversed(requests))
    in_flight, most = 0, 0

    def refill() -> None:
        nonlocal in_flight, most
        while pending and in_flight < concurrency:
            engine.add_request(*pending.pop())
            in_flight += 1
        most = max(most, in_flight)

    refill()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                in_flight -= 1
                pending.extend(reversed(list(on_finished(out) or ())))
        refill()
    return most
