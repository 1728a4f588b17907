#!/usr/bin/env python3
"""The decode node's chat page in a real browser: headless Chromium (Debian's package) driven over
the DevTools protocol on a pipe (--remote-debugging-pipe: Python's standard library only, nothing
downloaded), against real nodes on loopback with a generated tiny model.

Usage: browser_check.py --kvbridge BIN --out DIR
1. A decode node bridged to a CPU prefill node, with --api-key: the page asks for the key on the
   status panel's 401 (again after a wrong one) and keeps it in memory only (no URL, cookie or storage holds it); the panel
   shows the peer up; a message typed and sent with Enter (Shift+Enter a newline) streams its
   reply in several pieces, tagged `complete` with bridged tokens; the second turn sends the
   history and finds it cached; a phone-sized viewport stacks the panel under the chat.
2. A decode node without a key whose prefill peer is down: no key asked, the peer shown down, the
   reply's verdict `declined` and its tokens native.
No Content-Security-Policy violation or script error on the way. Screenshots (PNG) go to DIR,
their paths printed. Exit 0: all passed; 1: a failure; 77: no chromium here.
"""
import argparse, base64, fcntl, json, os, select, shutil, socket, subprocess, sys, tempfile, time

KEY = "browser-check-key-0123"
DOC = "The harbour was built of granite from the ridge above the town, and barges left on every tide. " * 4
failures = []


def check(name, cond, detail=""):
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else f": {detail}"), flush=True)
    if not cond:
        failures.append(name)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Browser:
    """Chromium over the DevTools pipe: fd 3 takes commands, fd 4 gives replies, each JSON + NUL."""

    def __init__(self, exe, profile):
        cmd_r, cmd_w = os.pipe()
        res_r, res_w = os.pipe()
        hi_cmd, hi_res = fcntl.fcntl(cmd_r, fcntl.F_DUPFD, 10), fcntl.fcntl(res_w, fcntl.F_DUPFD, 10)

        def child_fds():
            os.dup2(hi_cmd, 3)
            os.dup2(hi_res, 4)

        args = [exe, "--headless=new", "--remote-debugging-pipe", "--no-first-run", "--no-default-browser-check",
                "--disable-gpu", "--disable-extensions", "--disable-background-networking", "--disable-sync",
                "--window-size=1200,900", f"--user-data-dir={profile}", "about:blank"]
        if os.geteuid() == 0:
            args.insert(1, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
        self.proc = subprocess.Popen(args, preexec_fn=child_fds, close_fds=False, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        for fd in (cmd_r, res_w, hi_cmd, hi_res):
            os.close(fd)
        self.w, self.r, self.buf, self.next_id, self.events = cmd_w, res_r, b"", 0, []

    def _read_message(self, deadline):
        while b"\0" not in self.buf:
            left = deadline - time.time()
            if left <= 0 or not select.select([self.r], [], [], left)[0]:
                raise TimeoutError("no reply from the browser")
            chunk = os.read(self.r, 1 << 20)
            if not chunk:
                raise RuntimeError("the browser closed its pipe")
            self.buf += chunk
        msg, self.buf = self.buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method, params=None, session=None, timeout=30):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self.w, json.dumps(msg).encode() + b"\0")
        deadline = time.time() + timeout
        while True:
            m = self._read_message(deadline)
            if m.get("id") == self.next_id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            self.events.append(m)

    def close(self):
        try:
            self.call("Browser.close", timeout=5)
        except Exception:
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Page:
    def __init__(self, browser):
        self.b = browser
        target = browser.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.s = browser.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.call(domain + ".enable")

    def call(self, method, params=None, timeout=30):
        return self.b.call(method, params, self.s, timeout)

    def eval(self, expr):
        r = self.call("Runtime.evaluate", {"expression": expr, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait(self, expr, timeout=20, what=None):
        deadline = time.time() + timeout
        while time.time() < deadline:
            v = self.eval(expr)
            if v:
                return v
            time.sleep(0.1)
        raise TimeoutError(f"waited {timeout} s for {what or expr}")

    def goto(self, url):
        self.call("Page.navigate", {"url": url})
        self.wait("document.readyState === 'complete' && typeof page === 'object'", what="the page to load")

    def key(self, key, shift=False):
        """A real key press, as the keyboard sends it (keydown, then keyup)."""
        code = {"Enter": 13}.get(key, 0)
        mods = 8 if shift else 0
        for t in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", {"type": t, "key": key, "code": key, "windowsVirtualKeyCode": code,
                                                 "modifiers": mods, **({"text": "\r"} if t == "keyDown" else {})})

    def type(self, text):
        self.call("Input.insertText", {"text": text})

    def screenshot(self, path):
        with open(path, "wb") as f:
            f.write(base64.b64decode(self.call("Page.captureScreenshot", {"format": "png"})["data"]))
        print(f"screenshot: {path}", flush=True)

    def problems(self):
        """CSP violations, console errors and uncaught exceptions seen so far on this page."""
        out = []
        for e in self.b.events:
            if e.get("sessionId") != self.s:
                continue
            if e["method"] == "Runtime.exceptionThrown":
                out.append(e["params"]["exceptionDetails"].get("text", "exception"))
            elif e["method"] == "Log.entryAdded" and e["params"]["entry"]["level"] == "error":
                out.append(e["params"]["entry"].get("text", ""))
            elif e["method"] == "Runtime.consoleAPICalled" and e["params"]["type"] == "error":
                out.append(str(e["params"]["args"]))
        # the status poll's first 401 (no key yet) is how the page learns it needs one
        return [p for p in out if "status of 401" not in p]


def start_nodes(kv, model, tmp, psk):
    """A prefill node and, on it, a decode node with the key; a decode node with a dead peer, no key."""
    procs = []
    env = dict(os.environ, KVB_PSK=psk)
    pp, d1, d2, dead = free_port(), free_port(), free_port(), free_port()
    logs = [open(os.path.join(tmp, n), "w") for n in ("prefill.log", "decode.log", "decode_down.log")]
    procs.append(subprocess.Popen([kv, "serve", "--role", "prefill", "--listen", f"127.0.0.1:{pp}", "-m", model],
                                  env=env, stdout=logs[0], stderr=logs[0]))
    procs.append(subprocess.Popen([kv, "serve", "--role", "decode", "--http", f"127.0.0.1:{d1}", "--peer",
                                   f"127.0.0.1:{pp}", "-m", model, "--api-key", KEY], env=env, stdout=logs[1],
                                  stderr=logs[1]))
    procs.append(subprocess.Popen([kv, "serve", "--role", "decode", "--http", f"127.0.0.1:{d2}", "--peer",
                                   f"127.0.0.1:{dead}", "-m", model], env=env, stdout=logs[2], stderr=logs[2]))
    return procs, d1, d2


def wait_health(port, want_peer, timeout=30):
    import urllib.request
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if json.load(r).get("peer") in want_peer:
                    return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


LAST = "document.querySelector('#messages li.assistant:last-of-type')"


def send_turn(p, text):
    """Types text (its first line ended by Shift+Enter), sends it with Enter; waits for the reply.
    Returns (reply element's verdict, meta text, text updates seen while it streamed)."""
    n = p.eval("document.querySelectorAll('#messages li.assistant').length")
    p.eval("document.getElementById('input').focus()")
    first, rest = text.split("\n", 1)
    p.type(first)
    p.key("Enter", shift=True)
    check("shift+enter is a newline, not a send", p.eval("document.getElementById('input').value.includes('\\n') && "
                                                         "document.querySelectorAll('#messages li').length") ==
          2 * n, p.eval("document.getElementById('input').value"))
    p.type(rest)
    # count the reply's text changes as they arrive (a streamed reply changes many times)
    p.eval("window.updates = 0; new MutationObserver((ms) => { for (const m of ms) for (const a of m.addedNodes)"
           " if (a.classList && a.classList.contains('assistant')) new MutationObserver(() => window.updates++)"
           ".observe(a.querySelector('.text'), {childList: true, characterData: true, subtree: true}); })"
           ".observe(document.getElementById('messages'), {childList: true}); true")
    p.key("Enter")
    p.wait(f"document.querySelectorAll('#messages li.assistant').length === {n + 1} && "
           f"{LAST}.dataset.state !== 'streaming'", timeout=60, what="the reply")
    state = p.eval(f"{LAST}.dataset.state")
    check("the reply finished", state == "done", p.eval(f"{LAST}.innerText"))
    return p.eval(f"{LAST}.dataset.verdict"), p.eval(f"{LAST}.querySelector('.meta').innerText"), p.eval("window.updates")


def token_count(meta, name):
    words = meta.replace("·", " ").split()
    return int(words[words.index(name) + 1]) if name in words else -1


def bridged_node(p, port, out):
    p.goto(f"http://127.0.0.1:{port}/")
    for i, key in enumerate(("wrong-key-0000", KEY)):  # a wrong key is answered 401 again: the page asks again
        p.wait(f"document.getElementById('key-dialog').open && page.keyPrompts === {i + 1}",
               what=f"the key dialog, time {i + 1} (status answered 401)")
        p.eval("document.getElementById('key-input').focus()")
        p.type(key)
        p.key("Enter")
    p.wait("document.getElementById('peer').dataset.state === 'up'", what="the peer shown up")
    time.sleep(1.2)  # another poll of the panel, with the key held
    check("the right key is not asked for again", p.eval("page.keyPrompts") == 2 and
          not p.eval("document.getElementById('key-dialog').open"), p.eval("page.keyPrompts"))
    # the page samples (no seed), so a reply may end at the tiny model's end token after a token or two;
    # its completions ask for at least 8 tokens here (vLLM's min_tokens, which the API takes), so that
    # "streamed in pieces" does not depend on the draw
    p.eval("const f0 = window.fetch; window.fetch = (u, o) => { if (String(u).includes('/v1/chat/completions') && "
           "o && o.body) { const b = JSON.parse(o.body); b.min_tokens = 8; o = Object.assign({}, o, "
           "{body: JSON.stringify(b)}); } return f0(u, o); }; true")
    verdict, meta, updates = send_turn(p, DOC + "\nWhat was the harbour built of?")
    check("first turn bridged", verdict == "complete" and token_count(meta, "bridged") > 0, f"{verdict} / {meta}")
    check("reply streamed in pieces", updates >= 3, updates)
    check("phases shown", "prefill" in meta and "transfer" in meta, meta)
    verdict, meta, _ = send_turn(p, "Thank you.\nAnd where did the barges go?")
    check("second turn sends the history, found cached", token_count(meta, "cached") > 0, f"{verdict} / {meta}")
    stored = p.eval("JSON.stringify([location.href, document.cookie, Object.keys(localStorage), "
                    "Object.keys(sessionStorage)])")
    check("the key is in no URL, cookie or storage", KEY not in stored and "key" not in stored.lower(), stored)
    p.wait("/[1-9]/.test(document.getElementById('link-total').textContent)", what="link bytes in the panel")
    check("cache use shown", "committed" in p.eval("document.getElementById('cache-text').textContent"))
    p.screenshot(os.path.join(out, "browser_check_bridged.png"))
    p.call("Emulation.setDeviceMetricsOverride", {"width": 390, "height": 844, "deviceScaleFactor": 2, "mobile": True})
    time.sleep(0.3)
    layout = p.eval("(() => { const c = document.getElementById('chat').getBoundingClientRect(),"
                    " a = document.getElementById('panel').getBoundingClientRect();"
                    " return [a.top >= c.bottom - 1, document.documentElement.scrollWidth <= innerWidth]; })()")
    check("phone: panel under the chat, nothing wider than the screen", layout == [True, True], layout)
    p.screenshot(os.path.join(out, "browser_check_phone.png"))
    p.call("Emulation.clearDeviceMetricsOverride")


def peer_down_node(p, port, out):
    p.goto(f"http://127.0.0.1:{port}/")
    p.wait("document.getElementById('peer').dataset.state === 'down'", what="the peer shown down")
    check("no key asked without --api-key", not p.eval("document.getElementById('key-dialog').open"))
    check("the peer's reason shown", len(p.eval("document.getElementById('peer-reason').textContent")) > 0)
    verdict, meta, _ = send_turn(p, DOC + "\nWhat was the harbour built of?")
    check("peer down: verdict declined, tokens native", verdict.startswith("declined") and
          token_count(meta, "native") > 0 and token_count(meta, "bridged") == 0, f"{verdict} / {meta}")
    p.screenshot(os.path.join(out, "browser_check_peer_down.png"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvbridge", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if not exe:
        print("browser_check: SKIP: no chromium (apt-get install chromium)")
        return 77
    os.makedirs(a.out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="kvb_browser_")
    model = os.path.join(tmp, "tiny.gguf")
    subprocess.run([a.kvbridge, "gen-model", "--preset", "tiny", "--out", model], check=True,
                   stdout=subprocess.DEVNULL)
    procs, d1, d2 = start_nodes(a.kvbridge, model, tmp, "browser-check-psk-0123456789")
    browser = None
    try:
        check("nodes up", wait_health(d1, ("up",)) and wait_health(d2, ("down",)))
        browser = Browser(exe, os.path.join(tmp, "profile"))
        p = Page(browser)
        bridged_node(p, d1, a.out)
        p2 = Page(browser)
        peer_down_node(p2, d2, a.out)
        check("no CSP violation or script error", not p.problems() and not p2.problems(),
              p.problems() + p2.problems())
    except Exception as e:  # a wait that timed out, the browser gone: a failure with its reason
        check("browser session", False, repr(e))
    finally:
        if browser:
            browser.close()
        for pr in procs:
            pr.terminate()
        for pr in procs:
            try:
                pr.wait(10)
            except subprocess.TimeoutExpired:
                pr.kill()
        if failures:
            for n in ("prefill.log", "decode.log", "decode_down.log"):
                print(f"--- {n}\n" + open(os.path.join(tmp, n)).read()[-2000:])
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"browser check: {'FAILED: ' + ', '.join(failures) if failures else 'all passed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
