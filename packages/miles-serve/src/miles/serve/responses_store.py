"""The Responses API's stored responses: what `previous_response_id` continues and
`GET /v1/responses/{id}` returns.

In memory and bounded: the newest `capacity` responses are kept (SGLang keeps every one, without
bound); continuing an evicted one is a 404 that says so. A stored response keeps the messages its
prompt was rendered from, so a continuation is rendered from the conversation itself (input,
then each earlier answer as an assistant turn), the way SGLang and OpenAI rebuild it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from miles.sglang.protocol import BadRequest, NotFound

DEFAULT_CAPACITY = 1024


@dataclass
class Stored:
    response: dict[str, Any]  # the response object as it was answered
    messages: list[dict[str, Any]]  # the conversation its prompt was rendered from


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, Stored] = OrderedDict()

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        self._entries[response["id"]] = Stored(response, messages)
        self._entries.move_to_end(response["id"])
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> Stored:
        check_id(response_id)
        stored = self._entries.get(response_id)
        if stored is None:
            raise NotFound(
                f"Response with id '{response_id}' not found (miles serve keeps the newest "
                f"{self.capacity} stored responses, in memory).",
                param="response_id",
            )
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._entries[response_id]

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """The messages that continue `response_id`: its own, then its answer."""
        stored = self.get(response_id)
        answer = "".join(
            part.get("text", "")
            for item in stored.response["output"]
            if item.get("type") == "message"
            for part in item.get("content", [])
        )
        return [*stored.messages, {"role": "assistant", "content": answer}]


def check_id(response_id: str) -> None:
    if not response_id.startswith("resp"):  # SGLang's check and words
        raise BadRequest(
            f"Invalid 'response_id': '{response_id}'. Expected an ID that begins with 'resp'.",
            param="response_id",
        )
