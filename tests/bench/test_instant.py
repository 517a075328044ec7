"""`tandem.bench.instant`: the instant OpenAI chat server the gateway benchmark measures its client against.
The official `openai` client gets its canned completion over real HTTP on 127.0.0.1, many turns on one
keep-alive connection; requests it does not answer get 400 and a closed connection, and it keeps serving."""

import socket

import openai
import pytest

from tandem.bench.instant import MAX_HEAD_BYTES, InstantChatServer, canned_completion


@pytest.fixture
def instant():
    server = InstantChatServer(max_tokens=5).start()
    yield server
    server.stop()


def _raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):  # the server closes the connection after a 400
            chunks.append(chunk)
    return b"".join(chunks)


def test_the_openai_client_gets_the_canned_completion_turn_after_turn(instant):
    client = openai.OpenAI(base_url=instant.url + "/v1", api_key="x", max_retries=0, timeout=10)
    messages = [{"role": "user", "content": "hi"}]
    for _ in range(3):
        resp = client.chat.completions.create(model="tandem", messages=messages, max_tokens=5)
        assert resp.usage.completion_tokens == 5
        assert resp.choices[0].message.content == " ok" * 5
        assert resp.choices[0].finish_reason == "length"
        messages.append(resp.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": "more"})
    client.close()
    assert instant.cpu_s() > 0


def test_requests_it_does_not_answer_get_400_and_it_keeps_serving(instant):
    bad = [
        b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n\r\n",  # no Content-Length
        b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: -3\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 2\r\ncontent-length: 2\r\n\r\n{}",
        b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 999999999999\r\n\r\n",
    ]
    for data in bad:
        assert _raw(instant.port, data).startswith(b"HTTP/1.1 400 "), data
    long_head = b"POST / HTTP/1.1\r\nx: " + b"a" * MAX_HEAD_BYTES + b"\r\n\r\n"
    try:  # closed unanswered: an end of stream, or a reset as the head was not all read
        assert _raw(instant.port, long_head) == b""
    except ConnectionResetError:
        pass
    body = b'{"messages": []}'
    two = b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    with socket.create_connection(("127.0.0.1", instant.port), timeout=5) as s:
        s.sendall(two + two)  # two requests on one connection
        want = canned_completion(5)
        got = b""
        while got.count(want) < 2:
            chunk = s.recv(65536)
            assert chunk, got
            got += chunk
    assert got.count(b"HTTP/1.1 200 OK") == 2


def test_max_tokens_below_one_is_refused():
    with pytest.raises(ValueError, match="max_tokens=0"):
        InstantChatServer(max_tokens=0)
