# tools/device/stages.sh — sourced by the device scripts: the clock every step's timeout is cut from
# (T0, DEADLINE seconds for the whole call), `left` (seconds a step may still take), `want STAGE`
# (whether STAGES names it) and `say` (a timestamped line, also appended to $LOG when the script set
# one). Set DEADLINE, STAGES and LOG (optional) before sourcing.
T0=${T0:-$(date +%s)}
left() { echo $((DEADLINE - ($(date +%s) - T0) - 5)); }
want() { case " $STAGES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
say() {
  if [ -n "${LOG:-}" ]; then echo "[$(($(date +%s) - T0))s] $*" | tee -a "$LOG"
  else echo "[$(($(date +%s) - T0))s] $*"; fi
}
