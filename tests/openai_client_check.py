#!/usr/bin/env python3
"""The official `openai` Python client against a kvbridge HTTP server (issue 6 acceptance: "the
official openai Python client streams a chat completion").

Usage: openai_client_check.py PORT [MODEL [API_KEY]]

The server under test (tests/test_http_server.c) runs a fake handler that echoes the last user
message (or the prompt) word by word with the verdict "partial 3/8" and fixed kvbridge counts.
Checks: models.list / retrieve; a non-streaming chat completion (content, finish_reason, usage,
usage.kvbridge, the X-KVBridge header); a STREAMING chat completion with include_usage (role
chunk, deltas joined == the message, finish_reason, final usage chunk with usage.kvbridge, the
header on the stream); a legacy completion (non-streaming and streaming); max_tokens -> "length";
a 400 from a bad parameter and a 404 from another model surface as the client's exception types.
With API_KEY (a server started with that key): every check above runs with it as the client's
api_key, and a client with a wrong key gets openai.AuthenticationError (401, code invalid_api_key)
on models.list, a chat completion and a streaming one.
Exit 0 and "openai client check: N passed, 0 failed" when all pass; exit 1 otherwise; exit 77 when
the openai package is missing (the C test skips then).
"""
import sys

try:
    import openai
    from openai import OpenAI
except ImportError:  # the C test turns this into a skip
    print("openai_client_check: the openai package is not installed in this Python", file=sys.stderr)
    sys.exit(77)

VERDICT = "partial 3/8"
KVB_EXPECT = {"verdict": VERDICT, "cached_tokens": 5, "bridged_tokens": 12, "native_tokens": 7}

passed = 0
failed = 0


def check(name, cond, detail=""):
    global passed, failed
    if cond:
        passed += 1
    else:
        failed += 1
        print(f"FAIL {name}: {detail}", file=sys.stderr)


def kvbridge_block(usage):
    extra = getattr(usage, "model_extra", None) or {}
    return extra.get("kvbridge") or getattr(usage, "kvbridge", None)


def check_kvbridge(name, usage):
    kb = kvbridge_block(usage)
    check(f"{name}: usage.kvbridge present", isinstance(kb, dict), repr(usage))
    if not isinstance(kb, dict):
        return
    for k, v in KVB_EXPECT.items():
        check(f"{name}: usage.kvbridge.{k}", kb.get(k) == v, f"{kb.get(k)!r} != {v!r}")
    for phase in ("tokenize_s", "queue_s", "lookup_s", "prefill_s", "transfer_s", "native_s", "decode_s"):
        check(f"{name}: usage.kvbridge.{phase}", isinstance(kb.get(phase), (int, float)), repr(kb))


def main():
    port = int(sys.argv[1])
    model = sys.argv[2] if len(sys.argv) > 2 else "kvb-test"
    api_key = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] else None
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key or "x", max_retries=0, timeout=30)

    if api_key:  # a wrong key is refused before anything runs
        wrong = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key + "-wrong", max_retries=0,
                       timeout=30)
        calls = {
            "models.list": lambda: wrong.models.list(),
            "chat": lambda: wrong.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}]),
            "chat stream": lambda: list(wrong.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], stream=True)),
        }
        for name, call in calls.items():
            try:
                call()
                check(f"wrong key, {name}: raised", False, "no exception")
            except openai.AuthenticationError as e:
                body = e.body if isinstance(e.body, dict) else {}
                check(f"wrong key, {name}: 401", e.status_code == 401, str(e.status_code))
                check(f"wrong key, {name}: code", body.get("code") == "invalid_api_key", repr(e.body))
                check(f"wrong key, {name}: message", body.get("message") == "Incorrect API key provided.",
                      repr(e.body))
                check(f"wrong key, {name}: WWW-Authenticate",
                      e.response.headers.get("www-authenticate") == "Bearer",
                      repr(e.response.headers.get("www-authenticate")))

    # models
    models = client.models.list()
    ids = [m.id for m in models.data]
    check("models.list", ids == [model], repr(ids))
    check("models.retrieve", client.models.retrieve(model).id == model)

    # non-streaming chat, with the raw response for the header
    text = "the quick brown fox jumps over the lazy dog"
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "system", "content": "echo"}, {"role": "user", "content": text}],
        max_tokens=64,
        temperature=0,
        extra_body={"kvbridge": {"bridge": "auto"}, "top_k": 5},
    )
    check("chat: X-KVBridge header", raw.headers.get("x-kvbridge") == VERDICT, repr(raw.headers.get("x-kvbridge")))
    chat = raw.parse()
    check("chat: object", chat.object == "chat.completion", chat.object)
    check("chat: content", chat.choices[0].message.content == text, repr(chat.choices[0].message.content))
    check("chat: role", chat.choices[0].message.role == "assistant")
    check("chat: finish_reason", chat.choices[0].finish_reason == "stop", chat.choices[0].finish_reason)
    check("chat: usage.completion_tokens", chat.usage.completion_tokens == len(text.split()), repr(chat.usage))
    check("chat: usage.total_tokens",
          chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens)
    check("chat: cached_tokens detail", chat.usage.prompt_tokens_details.cached_tokens == 5)
    check_kvbridge("chat", chat.usage)

    # STREAMING chat with include_usage, through the streaming-response wrapper for the header
    text = "streaming works one token at a time"
    with client.chat.completions.with_streaming_response.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        stream=True,
        stream_options={"include_usage": True},
    ) as resp:
        check("stream: X-KVBridge header", resp.headers.get("x-kvbridge") == VERDICT,
              repr(resp.headers.get("x-kvbridge")))
        check("stream: content-type", resp.headers.get("content-type", "").startswith("text/event-stream"))
        pieces, finish, usage, roles, n_chunks = [], None, None, [], 0
        for chunk in resp.parse():
            n_chunks += 1
            check("stream: chunk object", chunk.object == "chat.completion.chunk", chunk.object)
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                if ch.delta.role:
                    roles.append(ch.delta.role)
                if ch.delta.content:
                    pieces.append(ch.delta.content)
                if ch.finish_reason:
                    finish = ch.finish_reason
    check("stream: several chunks", n_chunks >= len(text.split()) + 2, str(n_chunks))
    check("stream: role first", roles == ["assistant"], repr(roles))
    check("stream: deltas join to the message", "".join(pieces) == text, repr("".join(pieces)))
    check("stream: one delta per word", len(pieces) == len(text.split()), repr(pieces))
    check("stream: finish_reason", finish == "stop", repr(finish))
    check("stream: usage chunk", usage is not None and usage.completion_tokens == len(text.split()), repr(usage))
    if usage is not None:
        check_kvbridge("stream", usage)

    # plain streaming iteration (what most users write)
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "a b c"}],
                                            stream=True)
    got = "".join((c.choices[0].delta.content or "") for c in stream if c.choices)
    check("stream (plain): content", got == "a b c", repr(got))

    # max_tokens -> length
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "one two three four"}],
                                          max_completion_tokens=2)
    check("max tokens: content", chat.choices[0].message.content == "one two", repr(chat.choices[0].message.content))
    check("max tokens: finish_reason", chat.choices[0].finish_reason == "length", chat.choices[0].finish_reason)

    # legacy completions
    cmpl = client.completions.create(model=model, prompt="Once upon a time", max_tokens=16)
    check("completion: object", cmpl.object == "text_completion", cmpl.object)
    check("completion: text", cmpl.choices[0].text == "Once upon a time", repr(cmpl.choices[0].text))
    check("completion: finish_reason", cmpl.choices[0].finish_reason == "stop")
    check_kvbridge("completion", cmpl.usage)
    parts = [c.choices[0].text for c in client.completions.create(model=model, prompt="x y z", stream=True)
             if c.choices]
    check("completion stream: text", "".join(parts) == "x y z", repr(parts))

    # errors map to the client's exception types
    try:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], temperature=7)
        check("400: raised", False, "no exception")
    except openai.BadRequestError as e:
        body = e.body if isinstance(e.body, dict) else {}
        check("400: param", body.get("param") == "temperature", repr(e.body))
    try:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
        check("404: raised", False, "no exception")
    except openai.NotFoundError as e:
        body = e.body if isinstance(e.body, dict) else {}
        check("404: code", body.get("code") == "model_not_found", repr(e.body))
    try:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "FAIL_CONTEXT"}])
        check("context: raised", False, "no exception")
    except openai.BadRequestError as e:
        body = e.body if isinstance(e.body, dict) else {}
        check("context: code", body.get("code") == "context_length_exceeded", repr(e.body))
    try:
        for _ in client.chat.completions.create(model=model, stream=True,
                                                messages=[{"role": "user", "content": "FAIL_MIDSTREAM"}]):
            pass
        check("mid-stream error: raised", False, "no exception")
    except openai.APIError as e:
        check("mid-stream error: message", "decoder failed" in str(e), str(e))

    print(f"openai client {openai.__version__}" + (" (with an API key)" if api_key else ""))
    print(f"openai client check: {passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
