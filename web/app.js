// The chat page's script: the conversation (its turns kept here and sent whole each time, so the
// decode node's prefix cache holds the earlier turns), each reply streamed from
// /v1/chat/completions (server-sent events read from fetch) and tagged with its verdict (the
// X-KVBridge header at once, usage.kvbridge at the end), and the live panel polled from
// /v1/kvbridge/status. An API key is asked for on the first 401 and kept in this script's memory
// only: never in a URL, a cookie or storage.
'use strict';

const $ = (id) => document.getElementById(id);
const page = {
  key: null, keyAsked: null, keyDeclined: false, keyPrompts: 0, history: [], busy: false, model: 'default', last: null,
};

// ---- the API key --------------------------------------------------------------------------------

// Resolves once the dialog closes: true with a key entered (one dialog at a time, whoever asked).
function askKey() {
  if (page.keyAsked) return page.keyAsked;
  page.keyAsked = new Promise((resolve) => {
    const dlg = $('key-dialog');
    $('key-input').value = '';
    dlg.addEventListener('close', function done() {
      dlg.removeEventListener('close', done);
      const v = $('key-input').value.trim();
      $('key-input').value = '';
      page.keyAsked = null;
      if (v) { page.key = v; $('forget').hidden = false; }
      resolve(Boolean(v));
    });
    dlg.showModal();
    page.keyPrompts++;
    $('key-input').focus();
  });
  return page.keyAsked;
}

// fetch with the key when one is held; a 401 asks for it (again) and retries. Once the dialog was
// dismissed without a key, only a message the user sends asks again (the panel's polls do not).
async function api(path, init = {}, interactive = false) {
  for (;;) {
    const headers = Object.assign({}, init.headers || {});
    if (page.key) headers.Authorization = 'Bearer ' + page.key;
    const resp = await fetch(path, Object.assign({}, init, { headers, cache: 'no-store' }));
    if (resp.status !== 401) return resp;
    page.key = null;
    $('forget').hidden = true;
    if (page.keyDeclined && !interactive) throw new Error('this node needs its API key (send a message to enter it)');
    page.keyDeclined = !(await askKey());
    if (page.keyDeclined) throw new Error('this node needs its API key');
  }
}

// ---- the conversation ---------------------------------------------------------------------------

function addMessage(role, text) {
  const li = document.createElement('li');
  li.className = 'msg ' + role;
  li.dataset.role = role;
  const body = document.createElement('div');
  body.className = 'text';
  body.textContent = text;
  li.appendChild(body);
  $('messages').appendChild(li);
  li.scrollIntoView({ block: 'end' });
  return li;
}

function verdictClass(v) {
  if (v === 'complete') return 'complete';
  if (v.startsWith('partial')) return 'partial';
  if (v.startsWith('declined')) return 'declined';
  return 'native';
}

// The reply's tag: the verdict, then (with usage) the token counts and the phases.
function showMeta(li, verdict, usage, ttft) {
  let meta = li.querySelector('.meta');
  if (!meta) { meta = document.createElement('div'); meta.className = 'meta'; li.appendChild(meta); }
  meta.textContent = '';
  const badge = document.createElement('span');
  badge.className = 'badge verdict ' + verdictClass(verdict);
  badge.textContent = verdict;
  meta.appendChild(badge);
  li.dataset.verdict = verdict;
  const add = (text, cls) => {
    const s = document.createElement('span');
    s.textContent = text;
    if (cls) s.className = cls;
    meta.appendChild(s);
  };
  if (ttft !== undefined) add('first token ' + ttft.toFixed(3) + ' s');
  const k = usage && usage.kvbridge;
  if (!k) return;
  add(`cached ${k.cached_tokens} · bridged ${k.bridged_tokens} · native ${k.native_tokens}`, 'tokens');
  const phases = ['tokenize', 'queue', 'lookup', 'prefill', 'transfer', 'native', 'decode']
    .filter((p) => k[p + '_s'] > 0).map((p) => `${p} ${k[p + '_s'].toFixed(3)} s`);
  if (phases.length) add(phases.join(' · '), 'phases');
  if (k.bridge_faults) add('faults: ' + k.bridge_faults, 'error');
}

// The SSE stream of one reply: deltas into li's text; returns {text, usage}.
async function readStream(resp, li, t0, verdict) {
  const reader = resp.body.getReader();
  const dec = new TextDecoder();
  const out = li.querySelector('.text');
  let buf = '', text = '', usage = null, ttft;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf('\n\n')) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of event.split('\n')) {
        if (!line.startsWith('data: ')) continue;
        const data = line.slice(6);
        if (data === '[DONE]') return { text, usage, ttft };
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        const c = chunk.choices && chunk.choices[0];
        if (c && c.delta && c.delta.content) {
          if (ttft === undefined) { ttft = (performance.now() - t0) / 1000; showMeta(li, verdict, null, ttft); }
          text += c.delta.content;
          out.textContent = text;
          li.scrollIntoView({ block: 'end' });
        }
      }
    }
  }
  return { text, usage, ttft };
}

async function send(text) {
  page.busy = true;
  $('send').disabled = true;
  page.history.push({ role: 'user', content: text });
  addMessage('user', text);
  const li = addMessage('assistant', '');
  li.dataset.state = 'streaming';
  const t0 = performance.now();
  try {
    const body = {
      model: page.model, messages: page.history, stream: true, stream_options: { include_usage: true },
      max_tokens: Math.max(1, parseInt($('max-tokens').value, 10) || 64),
    };
    const resp = await api('/v1/chat/completions', {
      method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify(body),
    }, true);
    const verdict = resp.headers.get('X-KVBridge') || '';
    if (!resp.ok) {
      const err = await resp.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || 'HTTP ' + resp.status);
    }
    showMeta(li, verdict, null);
    const r = await readStream(resp, li, t0, verdict);
    const final = (r.usage && r.usage.kvbridge && r.usage.kvbridge.verdict) || verdict;
    showMeta(li, final, r.usage, r.ttft);
    page.history.push({ role: 'assistant', content: r.text });
    li.dataset.state = 'done';
  } catch (e) {
    page.history.pop(); // the turn did not happen: its question is not part of the conversation
    li.dataset.state = 'error';
    li.querySelector('.text').textContent = String(e.message || e);
    showMeta(li, 'error', null);
  } finally {
    page.busy = false;
    $('send').disabled = false;
    $('input').focus();
  }
}

// ---- the live panel -----------------------------------------------------------------------------

function bytes(n) {
  const u = ['B', 'kB', 'MB', 'GB', 'TB'];
  let i = 0;
  while (n >= 1000 && i < u.length - 1) { n /= 1000; i++; }
  return (i ? n.toFixed(1) : Math.round(n)) + ' ' + u[i];
}

function showBridges(list) {
  const box = $('bridges');
  box.textContent = '';
  if (!list.length) {
    const p = document.createElement('p');
    p.className = 'muted small';
    p.textContent = 'none';
    box.appendChild(p);
    return;
  }
  for (const b of list) {
    const div = document.createElement('div');
    div.className = 'bridge';
    div.textContent = `request ${b.request_id}: ${b.ship_tokens} of ${b.prompt_tokens} tokens, ` +
      `layers ${b.layers_complete}/${b.layers.length}, ${bytes(b.bytes)} at ${bytes(b.bytes_per_s)}/s`;
    const bars = document.createElement('div');
    bars.className = 'layers';
    bars.title = 'share of the shipped tokens arrived, by layer';
    for (const f of b.layers) {
      const s = document.createElement('span');
      s.style.height = Math.round(f * 100) + '%';
      bars.appendChild(s);
    }
    div.appendChild(bars);
    box.appendChild(div);
  }
}

function showStatus(s) {
  page.model = s.model || page.model;
  $('model').textContent = s.model || '';
  const peer = s.peer || { state: 'none', addr: '', reason: '' };
  $('peer').dataset.state = peer.state;
  $('peer-state').textContent = peer.state === 'none' ? 'no prefill peer configured' : peer.state;
  $('peer-addr').textContent = peer.addr || '';
  $('peer-reason').textContent = peer.reason || '';
  showBridges(s.bridges || []);
  const total = (s.link && s.link.bytes_total) || 0;
  if (page.last && s.now_s > page.last.now_s) {
    const rate = Math.max(0, total - page.last.total) / (s.now_s - page.last.now_s);
    $('link-rate').textContent = bytes(rate) + '/s';
  }
  page.last = { now_s: s.now_s, total };
  $('link-total').textContent = bytes(total);
  const c = s.cache || {};
  if (c.blocks) {
    $('cache-bar').style.width = (100 * c.committed / c.blocks).toFixed(1) + '%';
    $('cache-text').textContent = `${c.committed} of ${c.blocks} blocks committed (${c.block_tokens} tokens each), ` +
      `${c.in_use} in use, ${c.reserved} reserved, ${c.free} free`;
  }
  const r = s.requests || {};
  $('requests-text').textContent = `${r.served || 0} served now (at most ${r.parallel || 0}), ${r.waiting || 0} waiting`;
  const t = s.prompt_tokens || {};
  $('tokens-text').textContent = `cached ${t.cached || 0} · bridged ${t.bridged || 0} · native ${t.native || 0}`;
}

async function poll() {
  try {
    const resp = await api('/v1/kvbridge/status');
    if (!resp.ok) throw new Error('status: HTTP ' + resp.status);
    showStatus(await resp.json());
    $('status-error').hidden = true;
  } catch (e) {
    $('status-error').textContent = String(e.message || e);
    $('status-error').hidden = false;
  }
  setTimeout(poll, page.busy ? 250 : 1000); // closer while a reply (and maybe its bridge) is under way
}

// ---- wiring -------------------------------------------------------------------------------------

function submit() {
  const text = $('input').value.trim();
  if (!text || page.busy) return;
  $('input').value = '';
  send(text);
}

document.addEventListener('DOMContentLoaded', () => {
  $('composer').addEventListener('submit', (e) => { e.preventDefault(); submit(); });
  $('input').addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) { e.preventDefault(); submit(); }
  });
  $('clear').addEventListener('click', () => { page.history = []; $('messages').textContent = ''; $('input').focus(); });
  $('forget').addEventListener('click', () => { page.key = null; $('forget').hidden = true; });
  $('input').focus();
  poll();
});
