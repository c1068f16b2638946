# Sourced by the lab gate scripts (from the repository's root).
#
# run_lab CMD...: runs the lab in the background and waits for it; a
# SIGTERM, SIGINT or SIGHUP to this script is passed on as SIGTERM, and the
# script waits until the lab has torn everything down (its fluxvmd
# included) before it exits with the lab's status.
run_lab() {
  "$@" &
  local child=$! rc=0
  trap 'kill -TERM "$child" 2>/dev/null || true' TERM INT HUP
  wait "$child" || rc=$?
  while kill -0 "$child" 2>/dev/null; do rc=0; wait "$child" || rc=$?; done
  trap - TERM INT HUP
  return "$rc"
}
