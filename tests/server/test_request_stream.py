"""RequestStream (server/engine_loop.py): its reader gets every output, or the error, however much of
either came before it started reading (the engine's messages race the response's first read)."""
import asyncio

import pytest

from tritonllm.server.engine_loop import RequestStream
from tritonllm.server.fields import ApiError


def output(choice: int, final: bool) -> tuple:
    return (0, choice, [7], "x", None, None, ("length", 0, None) if final else None)


async def read_all(stream: RequestStream) -> list[tuple]:
    return [item async for batch in stream.batches() for item in batch]


def test_outputs_that_all_came_before_the_first_read_are_all_read():
    stream = RequestStream(0, 2)
    sent = [output(0, False), output(1, True), output(0, True)]
    for item in sent:
        stream.put(item)
    assert stream.finished and asyncio.run(read_all(stream)) == sent


def test_an_error_that_came_before_the_first_read_is_raised():
    stream = RequestStream(0, 1)
    stream.put(output(0, False))
    stream.fail(ApiError(500, "the engine failed"))
    with pytest.raises(ApiError, match="the engine failed"):
        asyncio.run(read_all(stream))


def test_an_error_after_the_last_output_changes_nothing():
    stream = RequestStream(0, 1)
    stream.put(output(0, True))
    stream.fail(ApiError(503, "shutting down"))
    assert stream.error is None and asyncio.run(read_all(stream)) == [output(0, True)]


def test_a_waiting_reader_gets_outputs_in_order_then_the_error():
    async def scenario(fail: bool):
        stream = RequestStream(0, 1)
        reader = asyncio.ensure_future(read_all(stream))
        await asyncio.sleep(0)
        stream.put(output(0, False))
        await asyncio.sleep(0)
        if fail:
            stream.fail(ApiError(500, "the engine failed"))
        else:
            stream.put(output(0, True))
        return await reader

    assert asyncio.run(scenario(False)) == [output(0, False), output(0, True)]
    with pytest.raises(ApiError):
        asyncio.run(scenario(True))
