#!/usr/bin/env python3
"""The official `openai` client against a real kvbridge decode node bridged to a prefill node.

Usage: openai_node_check.py PORT
Streams a chat completion (include_usage) whose prompt is long enough to bridge, and checks the
X-KVBridge header, the deltas, finish_reason and usage.kvbridge; then logprobs, in a body and a stream, and an echoed prompt's
(a loglikelihood as lm-eval-harness asks for it); JSON mode, and structured outputs from a Pydantic
model through the client's parse helper. Exit 0 with
"openai node check: N passed, 0 failed"; 1 on a failure; 77 when the openai package is absent.
"""
import sys

try:
    from openai import OpenAI
except ImportError:
    print("openai_node_check: the openai package is not installed in this Python", file=sys.stderr)
    sys.exit(77)

port = int(sys.argv[1])
client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
passed = failed = 0


def check(name, cond, detail=""):
    global passed, failed
    if cond:
        passed += 1
    else:
        failed += 1
        print(f"FAIL {name}: {detail}", file=sys.stderr)


doc = "The quarry shipped granite on barges every evening. " * 40
raw = client.chat.completions.with_raw_response.create(
    model="any", messages=[{"role": "user", "content": doc + "What did it ship?"}],
    max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True})
check("header", raw.headers.get("x-kvbridge") == "complete", raw.headers.get("x-kvbridge"))
stream = raw.parse()
text, finish, usage = "", None, None
for chunk in stream:
    if chunk.choices:
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    if chunk.usage:
        usage = chunk.usage
check("deltas", len(text) > 0, repr(text))
check("finish", finish in ("length", "stop"), finish)
kb = (usage.model_extra or {}).get("kvbridge") if usage else None
check("usage", usage is not None and usage.completion_tokens >= 1, usage)
check("kvbridge", kb is not None and kb["verdict"] == "complete" and kb["bridged_tokens"] > 0, kb)
phases = ("tokenize_s", "queue_s", "lookup_s", "prefill_s", "transfer_s", "native_s", "decode_s")
check("phases", kb is not None and all(isinstance(kb.get(p), (int, float)) and kb[p] >= 0 for p in phases), kb)
check("tokenized", kb is not None and 0 < kb.get("tokenize_s", 0) < 10, kb)  # a real chat template and tokenizer ran
check("one attempt", kb is not None and kb.get("bridge_attempts") == 1 and kb.get("bridge_faults") == "", kb)

# logprobs through the client's own types: one entry per reply token, each the most likely (greedy)
# of its top 3, in descending order, the stream's entries the same as the body's
lp_args = dict(model="any", messages=[{"role": "user", "content": doc + "Once more?"}], max_tokens=8,
               temperature=0, logprobs=True, top_logprobs=3)
body = client.chat.completions.create(**lp_args)
entries = body.choices[0].logprobs.content if body.choices[0].logprobs else None
check("logprobs body", entries is not None and len(entries) == body.usage.completion_tokens, body.choices[0])
for e in entries or []:
    tops = [t.logprob for t in e.top_logprobs]
    check("logprobs top", len(tops) == 3 and tops == sorted(tops, reverse=True) and e.logprob == tops[0]
          and e.token == e.top_logprobs[0].token and bytes(e.bytes).decode("utf-8", "replace") == e.token
          and e.logprob <= 0, e)
streamed = []
for chunk in client.chat.completions.create(**lp_args, stream=True):
    if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
        streamed += chunk.choices[0].logprobs.content
check("logprobs stream", [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries or []],
      (streamed, entries))

# a loglikelihood as lm-eval-harness asks for one: echo, logprobs 1, one token; every prompt token
# has its logprob (the first none), each top dict holds the token's own
ctx = doc + "It shipped granite"
ll = client.completions.create(model="any", prompt=ctx, echo=True, logprobs=1, max_tokens=1, temperature=0)
lp = ll.choices[0].logprobs
n_all = ll.usage.prompt_tokens + ll.usage.completion_tokens
check("echo text", ll.choices[0].text.startswith(ctx), ll.choices[0].text[-40:])
check("echo logprobs", lp is not None and len(lp.token_logprobs) == n_all and len(lp.tokens) == n_all
      and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
      and all(v is not None and v <= 0 for v in lp.token_logprobs[1:]), lp and lp.token_logprobs[:3])
check("echo tops", lp is not None and all(max(t.values()) >= v for t, v in zip(lp.top_logprobs[1:], lp.token_logprobs[1:])),
      lp and lp.top_logprobs[:3])
check("echo verdict", (ll.usage.model_extra or {}).get("kvbridge", {}).get("verdict", "").startswith("declined: prompt logprobs"),
      ll.usage)

# JSON mode through the client's own parameter: the reply starts an object, and one that ended
# by itself parses as one
import json
jm = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Answer in JSON."}],
                                    max_tokens=24, temperature=0, response_format={"type": "json_object"})
jtext, jfinish = jm.choices[0].message.content, jm.choices[0].finish_reason
ok = jtext.startswith("{")
if jfinish == "stop":
    try:
        ok = ok and isinstance(json.loads(jtext), dict)
    except ValueError:
        ok = False
check("json mode", ok, (jfinish, jtext))

# Structured outputs through the client's own helper: it turns a Pydantic model into a strict
# json_schema response_format. The reply holds the schema's properties in order; one that ended by
# itself parses into the model (this generated model may instead run to max_tokens: then the
# client raises LengthFinishReasonError, and the text so far must still start as the schema says)
import re
import openai
from pydantic import BaseModel


class Place(BaseModel):  # nested: the client sends it as a $ref into the schema's $defs
    city: str


class Answer(BaseModel):
    place: Place
    year: int


try:
    parsed = client.chat.completions.parse(model="any", messages=[{"role": "user", "content": "Where and when?"}],
                                           max_tokens=48, temperature=0, response_format=Answer)
    msg = parsed.choices[0].message
    check("json schema: parsed", isinstance(msg.parsed, Answer), (msg.content, msg.parsed))
    print(f"structured output (parsed): {msg.content}")
except openai.LengthFinishReasonError as e:
    stext = e.completion.choices[0].message.content or ""
    head = re.sub(r"\s+", "", stext)[:8]  # the first key may hold no blanks; only blanks precede it
    check("json schema: ran to max_tokens, a prefix", head == '{"place"'[:len(head)] and len(stext) > 0, stext)
    print(f"structured output (ran to max_tokens): {stext!r}")
try:
    client.chat.completions.create(model="any", messages=[{"role": "user", "content": "x"}], response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]+$"}}}}})
    check("json schema: unsupported keyword refused", False, "no exception")
except openai.BadRequestError as e:
    body = e.body if isinstance(e.body, dict) else {}
    check("json schema: unsupported keyword refused", "pattern" in body.get("message", ""), repr(e.body))
print(f"openai node check: {passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
