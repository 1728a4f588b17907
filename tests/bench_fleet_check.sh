#!/usr/bin/env bash
# tests/bench_fleet_check.sh KVBRIDGE [--netns] — `kvbridge bench fleet` on a tiny generated model,
# small shape (2 prefill x 3 decode nodes, 8 conversations of 4 turns from 4 clients), once whole
# and once with a prefill node and a decode node SIGKILLed mid-run; the bench prints its table and
# this script asserts it: exit 0, every request answered and equal to the native reply byte for
# byte, none lost or doubled, the verdicts adding up, and with the kills both kills done and the
# phases of the fault table adding up to every request. With --netns every node runs in its own
# network namespace over shaped veth links (root; exits 77, skipped, where that cannot be made).
set -u
K=${1:?usage: bench_fleet_check.sh KVBRIDGE [--netns]}
shift
if [ "${1:-}" = --netns ]; then
  [ "$(id -u)" = 0 ] || { echo "bench_fleet_check: --netns needs root; skipped"; exit 77; }
  ip netns add kvbfcheck$$ 2>/dev/null || { echo "bench_fleet_check: cannot create namespaces here; skipped"; exit 77; }
  ip netns del kvbfcheck$$
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
fail=0
bad() { echo "bench_fleet_check: $*"; fail=1; }
field() { awk -v k="$1" '$1 == k { print $2; exit }' "$WORK/out"; }

check() { # the options of one run
  echo "bench_fleet_check: kvbridge bench fleet $*"
  "$K" bench fleet --conversations 8 --turns 4 --clients 4 "$@" >"$WORK/out" 2>"$WORK/err"
  local rc=$?
  cat "$WORK/out"
  [ $rc = 0 ] || { bad "exit $rc"; tail -20 "$WORK/err"; }
  local n; n=$(field requests)
  [ "$n" = 32 ] || bad "requests '$n', not 32"
  grep -Eq "^equal +$n of $n replies equal to the native reference, byte for byte \([1-9][0-9]* bytes" "$WORK/out" ||
    bad "not every reply equal to native (or no text at all)"
  [ "$(field lost)" = 0 ] || bad "lost '$(field lost)'"
  [ "$(field doubled)" = 0 ] || bad "doubled '$(field doubled)'"
  local v; v=$(awk '$1 == "verdicts" { print $3 + $5 + $7 + $9 }' FS='[ ,]+' "$WORK/out")
  [ "$v" = "$n" ] || bad "verdicts add up to '$v', not $n"
  grep -Eq '^result +PASS' "$WORK/out" || bad "no PASS"
  case "$*" in *--kill*)
    grep -q 'SIGKILL p0' "$WORK/err" && grep -q 'SIGKILL d0' "$WORK/err" || bad "a kill did not happen"
    local p; p=$(awk '/^            (before any kill|after the)/ { s += $(NF - 12) } END { print s }' "$WORK/out")
    [ "$p" = "$n" ] || bad "the fault table's phases add up to '$p', not $n"
    [ "$(grep -c '^            after the' "$WORK/out")" = 2 ] || bad "not two phases after kills";;
  esac
}

check "$@"
check "$@" --kill prefill:6,decode:14
echo "bench_fleet_check: $([ $fail = 0 ] && echo passed || echo FAILED)"
exit $fail
