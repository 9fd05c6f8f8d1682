import asyncio

from service.streams import Hub, sse_message


def test_sse_message_format() -> None:
    assert sse_message({"a": 1}, "metrics", 7) == 'id: 7\nevent: metrics\ndata: {"a": 1}\n\n'


def test_a_reader_lagging_past_the_limit_is_cut_off_and_others_are_not() -> None:
    async def scenario() -> None:
        hub = Hub(buffer=3)
        fast, slow = hub.subscribe("j"), hub.subscribe("j")

        def event(seq: int) -> dict:
            return {"seq": seq, "kind": "metrics", "time": 0.0, "data": {"step": seq}}

        for seq in range(1, 4):
            hub.publish("j", [event(seq)])
            item = await fast.next(1)
            assert item is not None and item["seq"] == seq
            # As the API writes every time: ISO 8601 UTC, not the Unix seconds stored.
            sent = {**event(seq), "time": "1970-01-01T00:00:00Z"}
            assert item["text"] == sse_message(sent, "metrics", seq)
            fast.last_sent = seq
        assert not slow.overflowed  # three behind: at the limit, still fine
        hub.publish("j", [event(4)])
        assert slow.overflowed and not fast.overflowed
        assert await slow.next(0.01) is None
        item = await fast.next(1)
        assert item is not None and item["seq"] == 4 and not item["terminal"]
        hub.unsubscribe("j", slow)
        hub.unsubscribe("j", fast)
        assert hub.subscriber_count("j") == 0

    asyncio.run(scenario())


def test_next_times_out_quietly() -> None:
    async def scenario() -> None:
        sub = Hub(buffer=10).subscribe(None)
        assert await sub.next(0.05) is None

    asyncio.run(scenario())
