"""The responses kept for `previous_response_id`: in memory, the last `capacity` of them
(--max-stored-responses), each as the conversation it ends (chat messages, as the template
takes them: its input and every earlier turn, then its own output; not its instructions,
which OpenAI does not carry over either).

Ids that can no longer be continued (pushed out by newer responses, or answered with
`store: false`) are remembered, as bare ids, a few times longer, so that a request naming one
is told why rather than "unknown"."""
from collections import OrderedDict

from pdserve.errors import RequestError

PARAM = "previous_response_id"


class ResponseStore:
    def __init__(self, capacity: int, forgotten_factor: int = 4):
        self.capacity = capacity
        self._conversations: OrderedDict[str, list[dict]] = OrderedDict()
        self._gone: OrderedDict[str, str] = OrderedDict()   # id -> why it cannot be continued
        self._gone_capacity = max(64, capacity * forgotten_factor)

    def __len__(self) -> int:
        return len(self._conversations)

    def put(self, response_id: str, conversation: list[dict]) -> None:
        if self.capacity == 0:
            self._forget(response_id, "this server stores no responses (--max-stored-responses 0)")
            return
        self._conversations[response_id] = conversation
        while len(self._conversations) > self.capacity:
            old, _ = self._conversations.popitem(last=False)
            self._forget(old, f"it is no longer stored: this server keeps the last {self.capacity} responses "
                              "(--max-stored-responses)")

    def not_stored(self, response_id: str) -> None:
        """A response answered with store: false."""
        self._forget(response_id, "it was created with store: false")

    def conversation(self, response_id: str) -> list[dict]:
        """The stored conversation (a copy's worth: callers extend it), or a 400 saying why not."""
        found = self._conversations.get(response_id)
        if found is not None:
            return list(found)
        why = self._gone.get(response_id, "no response with this id was created by this server")
        raise RequestError(f"previous_response_id {response_id!r} cannot be continued: {why}", param=PARAM)

    def _forget(self, response_id: str, why: str) -> None:
        self._gone[response_id] = why
        while len(self._gone) > self._gone_capacity:
            self._gone.popitem(last=False)
