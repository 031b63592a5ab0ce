"""gateway.generation.merge_entries: entries run concurrently, and none runs ahead of its reader."""
from __future__ import annotations

import asyncio

from loraplex.errors import NotFoundError
from loraplex.v1 import common_pb2, gateway_pb2
from gateway.generation import merge_entries

NUM_MESSAGES = 200


def _entry(index: int, produced: list[int], fail: bool = False):
    async def factory():
        async def stream():
            for i in range(NUM_MESSAGES):
                produced[index] += 1
                yield gateway_pb2.GenerateResponse(index=index, text=str(i))
            if fail:
                raise NotFoundError("gone")
            yield gateway_pb2.GenerateResponse(index=index, finish_reason=common_pb2.STOP)
        return stream()
    return index, factory, None


def test_an_entry_waits_for_its_reader_instead_of_queueing_its_whole_stream():
    async def main() -> list[int]:
        produced = [0, 0]
        merged = merge_entries([_entry(0, produced), _entry(1, produced)])
        first = await anext(merged)
        for _ in range(50):
            await asyncio.sleep(0)      # the entries get every chance to run ahead of a reader that stalls
        ahead = sum(produced)
        await merged.aclose()
        assert first.text == "0"
        return [ahead]
    [ahead] = asyncio.run(main())
    assert ahead <= 12, f"{ahead} messages produced for a reader that took one"


def test_every_message_arrives_and_a_failing_entry_ends_alone_with_error():
    async def main() -> list[gateway_pb2.GenerateResponse]:
        produced = [0, 0]
        return [m async for m in merge_entries([_entry(0, produced), _entry(1, produced, fail=True)])]
    out = asyncio.run(main())
    texts = {i: [m.text for m in out if m.index == i and not m.finish_reason] for i in (0, 1)}
    assert texts[0] == texts[1] == [str(i) for i in range(NUM_MESSAGES)]
    ends = {m.index: m for m in out if m.finish_reason}
    assert ends[0].finish_reason == common_pb2.STOP
    assert ends[1].finish_reason == common_pb2.ERROR and ends[1].error.startswith("NOT_FOUND: gone")
