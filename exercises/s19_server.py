"""S19 exercises: reading a server-sent event stream, joining its chunks into the response,
checking a request the way the server does.

Fill in each function, then grade your work:

    make grade            # or: python exercises/grade.py s19

The chapter's code is in code/s19_protocol.py (`StreamWriter`, `collect_response`,
`parse_request`, `APIError`) and code/s19_server.py (the server around them). Write your own
versions here: the graded tests compare you with the OpenAI Python client's own SSE decoder
(`openai._streaming.SSEDecoder`); with streams worked by hand and with S06's single-request
engine run alone on the same prompts (the text and finish reason a stream must join to) and the
tokenizer's count of each prompt (its usage); with the status, param and code S19's
`parse_request` gives the same request body; and with the exception the official client raises
when it reads your error object. Reference solutions are in exercises/solutions/ -- try first,
peek later.

The wire format, in short. A streamed response is a byte stream of events; an event is one or
more lines ending with a blank line; a line is ended by LF, CR or CRLF. A line "data: x" adds
"x" to the event's data (several data lines are joined with "\\n"; one space after the colon
is dropped); a line starting with ":" is a comment; other fields (event, id, retry) are not
needed here. OpenAI's streams put one JSON chunk in each event's data and end with the event
"data: [DONE]".
"""
from __future__ import annotations

from typing import Iterable, Sequence


# Exercise 1: events out of a byte stream (3 points) ------------------------------------------
# The bytes arrive in pieces of any size: a piece may end in the middle of a line, of a CRLF,
# or of a multi-byte UTF-8 character. An event is complete only at its blank line; whatever
# follows the last blank line when the stream ends is not an event.

def sse_data(chunks: Iterable[bytes]) -> list[str]:
    """The data of every complete event in the byte stream, in order.

    chunks: the bytes as they arrived (any split). Lines end with b"\\n", b"\\r" or b"\\r\\n";
    each line is decoded as UTF-8. A line "data" or "data:<value>" appends value (one leading
    space removed) to the event's data lines; a line that starts with ":" is ignored, and so
    is a line of any other field. A blank line ends the event: if it has data lines, its data,
    the lines joined with "\\n", is the next item of the result; an event without data lines
    yields nothing.
    Example: sse_data([b'data: {"a": 1}\\n', b'\\n: ping\\n\\ndata: [DO', b'NE]\\r\\n\\r\\n'])
    -> ['{"a": 1}', "[DONE]"].
    """
    raise NotImplementedError("exercise 1")


# Exercise 2: joining a stream into its response (4 points) -----------------------------------
# A client that streams still wants the whole answer in the end. Each chunk carries, for one
# choice (its index), a piece of text: "text" in a text_completion chunk, "delta"."content" in
# a chat.completion.chunk (the first chat chunk of each choice only says "role": "assistant").
# A choice's finish_reason is null until its last chunk. With stream_options.include_usage the
# last chunk before [DONE] has "choices": [] and the usage. An error after the stream began
# arrives as an event whose data is an OpenAI error object, {"error": {...}}.

def join_stream(data: Sequence[str]) -> dict:
    """The response a stream adds up to, from the data of its events (exercise 1's result).

    Returns {"choices": [{"index": i, "text": ..., "finish_reason": ...}, ...], "usage": the
    usage object or None}: one choice per index, sorted by index, its text the pieces joined
    in order (for chat, the delta contents), its finish_reason the one its last chunk gave.
    Raises ValueError when the data does not end with "[DONE]" (the stream was cut), when an
    event is an error object (the message names the error's message), or when an event comes
    after [DONE].
    Example: join_stream(['{"object": "text_completion", "choices": [{"index": 0, "text": "Hi",
    "finish_reason": null}]}', '{"object": "text_completion", "choices": [{"index": 0,
    "text": "!", "finish_reason": "length"}]}', "[DONE]"]) -> {"choices": [{"index": 0,
    "text": "Hi!", "finish_reason": "length"}], "usage": None}.
    """
    raise NotImplementedError("exercise 2")


# Exercise 3: the server's first line of defence (3 points) -----------------------------------
# A request the client got wrong is answered with a 4xx status and OpenAI's error object,
# {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}, never with a 500, and
# never by running the engine. The rules below are a subset of S19's; the chapter's Deep dive
# lists them all. A request may break several rules at once (a prompt too long for the context
# and a bad temperature, say): then only the FIRST one broken, in the order listed, answers,
# as in S19's parse_request. The order is part of the specification and the tests hold you
# to it.

def check_request(kind: str, body: dict, model_name: str, prompt_tokens: int,
                  max_context: int) -> tuple[int, dict] | None:
    """(HTTP status, error object) for the first rule `body` breaks, or None if it breaks none.

    kind: "completion" (the body has a prompt) or "chat" (it has messages); prompt_tokens: the
    prompt's length in tokens (chat: after the chat template), counted by the caller. The
    error object is {"error": {"message": a non-empty explanation, "type":
    "invalid_request_error", "param": the field at fault, "code": a code or None}}. The rules,
    checked in this order (the first one broken answers; code None unless one is named):
      1. model missing or not a non-empty string: 400, param "model"; another model than
         model_name: 404, param "model", code "model_not_found";
      2. n (default 1) not an integer in [1, 128]: 400, "n";
      3. stream (default false) not a boolean: 400, "stream";
      4. stream_options present (not null) while stream is not true: 400, "stream_options";
      5. prompt_tokens >= max_context (no room for one token): 400, param "prompt"
         (completion) or "messages" (chat), code "context_length_exceeded";
      6. stop a list of more than 4 strings: 400, "stop";
      7. temperature present and not a number in [0, 100]: 400, "temperature";
      8. top_p present and not a number in [0, 1]: 400, "top_p";
      9. max_tokens present and not an integer >= 1 (for chat, max_completion_tokens wins
         over it when both are given, and is the param named): 400, that field;
      10. prompt_tokens + max_tokens > max_context (an explicit max_tokens that does not
         fit): 400, the max-tokens field, code "context_length_exceeded".
    A boolean is not an integer or a number here (as in Python's JSON, true is not 1).
    """
    raise NotImplementedError("exercise 3")
