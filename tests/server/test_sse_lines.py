"""An event's JSON stays on one line for clients that split the stream with str.splitlines()
(httpx's and requests' iter_lines): JSON leaves U+0085, U+2028 and U+2029 raw, which they break at
(seen: `pdserve bench` reported an 'unparsable event' on a random model's text)."""
import json

import httpx

from pdserve.server.streaming import sse


def test_an_event_is_one_line_whatever_the_text():
    text = "a\u2028b\x85c\u2029d\r\ne é \u00a0"
    event = sse({"choices": [{"text": text}]})
    lines = list(httpx._decoders.LineDecoder().decode(event)) + list(httpx._decoders.LineDecoder().flush())
    assert [line for line in lines if line] == [event.strip()]
    assert json.loads(event.removeprefix("data: "))["choices"][0]["text"] == text
