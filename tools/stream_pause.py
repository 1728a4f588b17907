#!/usr/bin/env python3
"""How long a decode node's stream to one client pauses when another client's long prompt arrives.

One client streams a reply (SSE, /v1/completions); a second later another client sends a long
prompt of token ids. Prints the streaming client's longest gap between two chunks beside the long
prompt's verdict, time to its reply, native compute time and transfer time (usage.kvbridge): with
the prompt computed in one piece the stream pauses for all of it; computed in slices between decode
batches, for about one slice. Against a decode node with a peer the long prompt is bridged: its
transfer holds the engine, and the stream goes on only if decode steps run during it.
Standard library only. Usage: stream_pause.py PORT [--prompt-tokens N] [--stream-tokens N] [--seed S]
"""
import argparse
import http.client
import json
import threading
import time

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("port", type=int)
ap.add_argument("--prompt-tokens", type=int, default=1024, help="the long prompt (default 1024)")
ap.add_argument("--stream-tokens", type=int, default=60, help="the streamed reply (default 60)")
ap.add_argument("--delay", type=float, default=1.0, help="seconds before the long prompt is sent")
ap.add_argument("--seed", type=int, default=0, help="which long prompt (runs with other seeds share no prefix)")
args = ap.parse_args()
res = {}


def post(body):
    c = http.client.HTTPConnection("127.0.0.1", args.port, timeout=900)
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return c.getresponse()


def stream():
    r = post({"model": "m", "prompt": list(range(10, 74)), "max_tokens": args.stream_tokens,
              "temperature": 0, "stream": True})
    times = []
    for line in iter(r.readline, b""):
        if line.startswith(b"data: ") and b"[DONE]" not in line:
            times.append(time.time())
    res["gap"] = max((b - a for a, b in zip(times, times[1:])), default=0.0)
    res["chunks"] = len(times)


def long_prompt():
    time.sleep(args.delay)
    ids = [((i + args.seed * 1000003) * 7919) % 30000 + 5 for i in range(args.prompt_tokens)]
    t0 = time.time()
    d = json.loads(post({"model": "m", "prompt": ids, "max_tokens": 1, "temperature": 0}).read())
    res["wall_s"] = time.time() - t0
    res["kb"] = d["usage"]["kvbridge"]


threads = [threading.Thread(target=stream), threading.Thread(target=long_prompt)]
for t in threads:
    t.start()
for t in threads:
    t.join()
kb = res["kb"]
print(f"longest pause of the stream {res['gap']:.2f} s over {res['chunks']} chunks; "
      f"the {args.prompt_tokens}-token prompt: {kb['verdict']}, {res['wall_s']:.2f} s to its reply, "
      f"native compute {kb['native_s']:.2f} s, transfer {kb['transfer_s']:.2f} s")
