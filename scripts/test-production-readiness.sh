#!/usr/bin/env bash
# Production readiness of a running fluxvmd node: control (REST reachable,
# token accepted, a wrong token refused), Service Fabric pins (the owned
# pin root on bpffs, schema and program generation of the pinned meta map,
# the programs' maps are this root's), Network Fabric health (every
# configured VM-edge and north-south interface attached, XDP as configured,
# advertisements published, backend health) and an optional VIP probe.
# Prints one line per check, `PASS|FAIL|WARN|SKIP <check>: <detail>`, then
# a summary; exits 1 when a check FAILs, 2 on a usage error.
#
#   scripts/test-production-readiness.sh [options]
#
#   -a, --api URL            REST API, host:port meaning http (default:
#                            $FLUXVM_ADDR, else api.listen of the config, else
#                            http://127.0.0.1:7788)
#   -c, --config FILE        the daemon's configuration (default
#                            /etc/fluxvm/fluxvmd.toml; env FLUXVM_CONFIG)
#   -t, --token-file FILE    bearer token file (first token line); default
#                            $FLUXVM_TOKEN, $FLUXVM_READ_TOKEN, $FLUXVM_ADMIN_TOKEN,
#                            then the config's api.read_token_file,
#                            api.admin_token_file (a read token is enough)
#       --cacert FILE        CA for an https API
#       --netns NAME|PATH    run the REST and interface checks in this network
#                            namespace (/run/netns/NAME; entered with nsenter,
#                            so bpffs stays visible)
#       --vip ADDR:PORT      probe a VIP: TCP connect ([v6]:port for IPv6)
#       --vip-http PATH      probe with an HTTP GET of PATH instead (2xx-4xx ok)
#       --vip-netns NAME     namespace of the VIP probe (default: --netns)
#       --timeout SECONDS    per probe and request (default 3)
#       --expect-schema N    schema version the binary you deploy has
#       --expect-generation N  program generation the binary you deploy has
#       --no-auth-check      do not check that a wrong token gets 401
#   -h, --help
#
# Needs curl and jq; bpftool (optional, run as root) adds the pinned meta,
# link and attachment cross-checks, which SKIP without it.
set -euo pipefail

usage() { awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; }

API="${FLUXVM_ADDR:-}"
CONFIG="${FLUXVM_CONFIG:-/etc/fluxvm/fluxvmd.toml}"
TOKEN_FILE=""
CACERT=""
NETNS=""
VIP=""
VIP_HTTP=""
VIP_NETNS=""
VIP_NETNS_SET=0
TIMEOUT=3
EXPECT_SCHEMA=""
EXPECT_GEN=""
AUTH_CHECK=1

die_usage() { echo "test-production-readiness.sh: $*" >&2; echo "(-h for help)" >&2; exit 2; }
need_arg() { [ $# -ge 2 ] || die_usage "$1 needs a value"; }
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    -a|--api) need_arg "$@"; API="$2"; shift 2 ;;
    -c|--config) need_arg "$@"; CONFIG="$2"; shift 2 ;;
    -t|--token-file) need_arg "$@"; TOKEN_FILE="$2"; shift 2 ;;
    --cacert) need_arg "$@"; CACERT="$2"; shift 2 ;;
    --netns) need_arg "$@"; NETNS="$2"; shift 2 ;;
    --vip) need_arg "$@"; VIP="$2"; shift 2 ;;
    --vip-http) need_arg "$@"; VIP_HTTP="$2"; shift 2 ;;
    --vip-netns) need_arg "$@"; VIP_NETNS="$2"; VIP_NETNS_SET=1; shift 2 ;;
    --timeout) need_arg "$@"; TIMEOUT="$2"; shift 2 ;;
    --expect-schema) need_arg "$@"; EXPECT_SCHEMA="$2"; shift 2 ;;
    --expect-generation) need_arg "$@"; EXPECT_GEN="$2"; shift 2 ;;
    --no-auth-check) AUTH_CHECK=0; shift ;;
    *) die_usage "unknown argument $1" ;;
  esac
done
[ "$VIP_NETNS_SET" = 1 ] || VIP_NETNS="$NETNS"
[[ "$TIMEOUT" =~ ^[0-9]+$ ]] && [ "$TIMEOUT" -gt 0 ] || die_usage "--timeout must be a positive number of seconds"
[ -z "$EXPECT_SCHEMA" ] || [[ "$EXPECT_SCHEMA" =~ ^[0-9]+$ ]] || die_usage "--expect-schema must be a number"
[ -z "$EXPECT_GEN" ] || [[ "$EXPECT_GEN" =~ ^[0-9]+$ ]] || die_usage "--expect-generation must be a number"

npass=0 nfail=0 nwarn=0 nskip=0
pass() { npass=$((npass + 1)); echo "PASS $1: $2"; }
fail() { nfail=$((nfail + 1)); echo "FAIL $1: $2"; }
warn() { nwarn=$((nwarn + 1)); echo "WARN $1: $2"; }
skip() { nskip=$((nskip + 1)); echo "SKIP $1: $2"; }
summary() {
  echo "summary: $npass pass, $nfail fail, $nwarn warn, $nskip skip"
  [ "$nfail" -eq 0 ]
}

# ns_path NAME: the namespace file of NAME (a path as is).
ns_path() { case "$1" in */*) echo "$1" ;; *) echo "/run/netns/$1" ;; esac; }
# in_ns NS CMD...: run CMD in network namespace NS ("" = this one). nsenter
# switches the network namespace only (ip netns exec would remount /sys
# and hide bpffs).
in_ns() {
  local ns="$1"; shift
  if [ -z "$ns" ]; then "$@"; else nsenter --net="$(ns_path "$ns")" -- "$@"; fi
}

# --- tools -------------------------------------------------------------
missing=()
for tool in curl jq; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if { [ -n "$NETNS" ] || [ -n "$VIP_NETNS" ]; } && ! command -v nsenter >/dev/null; then missing+=(nsenter); fi
if [ ${#missing[@]} -gt 0 ]; then
  fail tools "missing ${missing[*]} (apt-get install curl jq util-linux)"
  summary || exit 1
fi
BPFTOOL=""
if command -v bpftool >/dev/null && [ "$(id -u)" = 0 ]; then
  BPFTOOL=bpftool
  pass tools "curl, jq, bpftool"
else
  pass tools "curl, jq (no bpftool or not root: the kernel cross-checks SKIP)"
fi
for ns in "$NETNS" "$VIP_NETNS"; do
  if [ -n "$ns" ] && [ ! -e "$(ns_path "$ns")" ]; then
    fail netns "$(ns_path "$ns") does not exist"
    summary || exit 1
  fi
done

# --- configuration -----------------------------------------------------
# toml_keys FILE: "key<TAB>value" for the keys of [sandbox.dataplane.service]
# and of its api table (as api.KEY). Comments stripped, multi-line arrays
# joined; enough for the daemon's keys, not a general TOML parser.
toml_keys() {
  awk '
    function strip(s,    i, c, q, out) {
      q = ""; out = ""
      for (i = 1; i <= length(s); i++) {
        c = substr(s, i, 1)
        if (q == "" && c == "#") break
        if (q == "" && (c == "\"" || c == "\x27")) q = c
        else if (q != "" && c == q) q = ""
        out = out c
      }
      return out
    }
    function depth(s,    t) { t = s; return gsub(/\[/, "[", t) - gsub(/\]/, "]", t) }
    {
      line = strip($0)
      if (pending != "") {
        val = val " " line
        if (depth(val) <= 0) { emit(pending, val); pending = "" }
        next
      }
      if (line ~ /^[ \t]*\[/) {
        t = line; gsub(/^[ \t]*\[+[ \t]*|[ \t]*\]+[ \t]*$/, "", t); gsub(/[ \t"]/, "", t)
        table = t; next
      }
      if (table != "sandbox.dataplane.service" && table != "sandbox.dataplane.service.api") next
      if (line !~ /=/) next
      k = line; sub(/=.*/, "", k); gsub(/[ \t"]/, "", k)
      v = line; sub(/^[^=]*=/, "", v)
      if (table == "sandbox.dataplane.service.api") k = "api." k
      if (depth(v) > 0) { pending = k; val = v; next }
      emit(k, v)
    }
    function emit(k, v) { gsub(/^[ \t]+|[ \t]+$/, "", v); printf "%s\t%s\n", k, v }
  ' "$1"
}
conf_get() { # KEY: the raw value, "" when absent
  printf '%s\n' "$CONF_KEYS" | awk -F'\t' -v k="$1" '$1 == k { v = $2 } END { print v }'
}
unquote() { local v="$1"; v="${v#\"}"; v="${v%\"}"; v="${v#\'}"; v="${v%\'}"; printf '%s' "$v"; }

CONF_KEYS=""
HAVE_CONFIG=0
if [ -r "$CONFIG" ]; then
  CONF_KEYS="$(toml_keys "$CONFIG")"
  HAVE_CONFIG=1
fi
PIN_ROOT="$(unquote "$(conf_get pin_root)")"; PIN_ROOT="${PIN_ROOT:-/sys/fs/bpf/fluxvm/service}"
# Without a configuration the mode is not known: each north-south
# interface's mode is taken from the status and checked with the kernel.
XDP_MODE="$(unquote "$(conf_get xdp_mode)")"; XDP_MODE="${XDP_MODE:-off}"
[ "$HAVE_CONFIG" = 1 ] || XDP_MODE="(no configuration)"
ADV_PATH="$(unquote "$(conf_get advertisements_path)")"; ADV_PATH="${ADV_PATH:-/run/fluxvm/service-advertisements.json}"
VM_EDGE=() NS_IFS=()
if [ "$HAVE_CONFIG" = 1 ]; then
  mapfile -t VM_EDGE < <(conf_get vm_edge_interfaces | grep -o 'name[ \t]*=[ \t]*"[^"]*"' | sed 's/.*"\(.*\)"/\1/' || true)
  mapfile -t NS_IFS < <(conf_get north_south_interfaces | grep -o '"[^"]*"' | tr -d '"' || true)
  pass config "$CONFIG: pin_root $PIN_ROOT, ${#VM_EDGE[@]} vm-edge, ${#NS_IFS[@]} north-south, xdp_mode $XDP_MODE"
elif [ -e "$CONFIG" ]; then
  fail config "$CONFIG is not readable"
else
  skip config "$CONFIG not found: interfaces and pin_root taken from the status (-c to name the file)"
fi
if [ -z "$API" ]; then
  listen="$(unquote "$(conf_get api.listen)")"; listen="${listen:-127.0.0.1:7788}"
  scheme=http; [ -z "$(conf_get api.tls_cert_file)" ] || scheme=https
  API="$scheme://$listen"
fi
case "$API" in http://*|https://*) ;; *) API="http://$API" ;; esac
API="${API%/}"

# --- token -------------------------------------------------------------
first_token() { grep -v '^[[:space:]]*\(#\|$\)' "$1" 2>/dev/null | head -n1 | tr -d '[:space:]'; }
TOKEN="" TOKEN_FROM=""
if [ -n "$TOKEN_FILE" ]; then
  TOKEN="$(first_token "$TOKEN_FILE" || true)"; TOKEN_FROM="$TOKEN_FILE"
elif [ -n "${FLUXVM_TOKEN:-}" ]; then
  TOKEN="$FLUXVM_TOKEN"; TOKEN_FROM=FLUXVM_TOKEN
elif [ -n "${FLUXVM_READ_TOKEN:-}" ]; then
  TOKEN="$FLUXVM_READ_TOKEN"; TOKEN_FROM=FLUXVM_READ_TOKEN
elif [ -n "${FLUXVM_ADMIN_TOKEN:-}" ]; then
  TOKEN="$FLUXVM_ADMIN_TOKEN"; TOKEN_FROM=FLUXVM_ADMIN_TOKEN
else
  for k in api.read_token_file api.admin_token_file; do
    f="$(unquote "$(conf_get "$k")")"
    if [ -n "$f" ] && [ -r "$f" ]; then TOKEN="$(first_token "$f" || true)"; TOKEN_FROM="$f ($k)"; break; fi
  done
fi

if [[ "$TOKEN" == *[[:cntrl:]]* ]]; then
  echo "test-production-readiness.sh: the token of $TOKEN_FROM has control characters" >&2
  TOKEN=""
fi
# curl_quote S: S as the inside of a double-quoted curl config string (\
# and " escaped).
curl_quote() { local v="${1//\\/\\\\}"; printf '%s' "${v//\"/\\\"}"; }
# api GET PATH TOKEN: prints the body to $BODY_FILE and the status code
# (000 when the request failed). The token goes through curl's config on
# stdin, never the command line.
BODY_FILE="$(mktemp)"
trap 'rm -f "$BODY_FILE" "$BODY_FILE.err"' EXIT
api() {
  local extra=()
  [ -z "$CACERT" ] || extra+=(--cacert "$CACERT")
  printf 'header = "Authorization: Bearer %s"\n' "$(curl_quote "$2")" |
    in_ns "$NETNS" curl -sS -K - -o "$BODY_FILE" -w '%{http_code}' --max-time "$TIMEOUT" "${extra[@]}" "$API$1" 2>"$BODY_FILE.err" || true
}
# curl_err: why the last request got no answer.
curl_err() { head -n1 "$BODY_FILE.err" 2>/dev/null | sed 's/^curl: ([0-9]*) //'; }

# --- control: REST and token ------------------------------------------
STATUS=""
if [ -z "$TOKEN" ]; then
  fail rest "no token: -t FILE, FLUXVM_TOKEN, FLUXVM_READ_TOKEN or FLUXVM_ADMIN_TOKEN, or api.read_token_file in $CONFIG"
else
  code="$(api /v1/network/services/status "$TOKEN")"
  case "$code" in
    200)
      if jq -e '.schema_version' "$BODY_FILE" >/dev/null 2>&1; then
        STATUS="$(cat "$BODY_FILE")"
        pass rest "GET $API/v1/network/services/status: 200 with the token of $TOKEN_FROM"
      else
        fail rest "GET $API/v1/network/services/status: 200 but not a status document"
      fi ;;
    401|403) fail rest "GET $API/v1/network/services/status: $code: the token of $TOKEN_FROM is refused" ;;
    000) fail rest "GET $API/v1/network/services/status: no answer${NETNS:+ in netns $NETNS}: $(curl_err)" ;;
    *) fail rest "GET $API/v1/network/services/status: $code: $(head -c 200 "$BODY_FILE")" ;;
  esac
fi
if [ "$AUTH_CHECK" = 0 ]; then
  skip auth "--no-auth-check"
else
  code="$(api /v1/network/services/status "fluxvm-readiness-wrong-token-$RANDOM")"
  case "$code" in
    401) pass auth "a wrong token gets 401" ;;
    000) fail auth "no answer from $API: $(curl_err)" ;;
    *) fail auth "a wrong token gets $code, want 401" ;;
  esac
fi

ST_SCHEMA="" ST_GEN="" ST_ROOT=""
st() { jq -r "$1" <<<"$STATUS"; }
if [ -n "$STATUS" ]; then
  ST_SCHEMA="$(st .schema_version)"
  ST_GEN="$(st .program_generation)"
  ST_ROOT="$(st .pin_root)"
  if [ "$HAVE_CONFIG" = 0 ]; then
    PIN_ROOT="$ST_ROOT"
    mapfile -t VM_EDGE < <(st '.interfaces[]? | select(.kind == "vm-edge") | .name')
    mapfile -t NS_IFS < <(st '.interfaces[]? | select(.kind == "north-south") | .name')
  fi
elif [ "$HAVE_CONFIG" = 0 ]; then
  PIN_ROOT=""
fi

# --- pins: the owned root ----------------------------------------------
root_ok=1
if [ -z "$PIN_ROOT" ]; then
  skip pin_root "unknown: no configuration and no status"; root_ok=0
elif [ -n "$STATUS" ] && [ "$ST_ROOT" != "$PIN_ROOT" ]; then
  fail pin_root "the daemon uses $ST_ROOT, this node's configuration says $PIN_ROOT"; root_ok=0
elif [ ! -d "$PIN_ROOT" ]; then
  fail pin_root "$PIN_ROOT is not a directory"; root_ok=0
elif [ "$(stat -f -c %T "$PIN_ROOT" 2>/dev/null)" != bpf_fs ]; then
  fail pin_root "$PIN_ROOT is not on bpffs ($(stat -f -c %T "$PIN_ROOT" 2>/dev/null))"; root_ok=0
elif [ "$(stat -f -c %T "$(dirname "$PIN_ROOT")" 2>/dev/null)" != bpf_fs ]; then
  fail pin_root "$PIN_ROOT is a bpffs mount itself, not a directory of its own below one"; root_ok=0
else
  if [ -z "$STATUS" ]; then pass pin_root "$PIN_ROOT on bpffs (the configuration's; no status to compare)"
  elif [ "$HAVE_CONFIG" = 1 ]; then pass pin_root "$PIN_ROOT on bpffs, the daemon's and the configuration's"
  else pass pin_root "$PIN_ROOT on bpffs (the daemon's; no configuration to compare)"; fi
fi

META_ID=""
if [ "$root_ok" = 1 ]; then
  nmaps="$( (find "$PIN_ROOT/maps" -maxdepth 1 -name 'fluxvm_*' 2>/dev/null || true) | wc -l)"
  nlinks="$( (find "$PIN_ROOT/links" -maxdepth 1 -mindepth 1 2>/dev/null || true) | wc -l)"
  if [ ! -e "$PIN_ROOT/maps/fluxvm_meta" ]; then
    fail pins "$PIN_ROOT/maps/fluxvm_meta missing ($nmaps maps pinned)"
  elif [ ! -d "$PIN_ROOT/links" ]; then
    fail pins "$PIN_ROOT/links missing"
  else
    if [ -n "$BPFTOOL" ]; then
      META_ID="$(bpftool map show pinned "$PIN_ROOT/maps/fluxvm_meta" -j 2>/dev/null | jq -r '.id // empty' || true)"
    fi
    pass pins "$nmaps maps in $PIN_ROOT/maps, $nlinks links in $PIN_ROOT/links${META_ID:+, fluxvm_meta is map $META_ID}"
  fi
else
  skip pins "no usable pin root"
fi

# --- schema and generation: binary (status) vs pins vs expected ---------
P_SCHEMA="" P_GEN=""
if [ -n "$META_ID" ]; then
  meta="$(bpftool map lookup pinned "$PIN_ROOT/maps/fluxvm_meta" key 0 0 0 0 -j 2>/dev/null || true)"
  read -r P_SCHEMA P_GEN < <(jq -r '
    def hex: ascii_downcase | ltrimstr("0x") | explode
      | reduce .[] as $c (0; . * 16 + (if $c >= 97 then $c - 87 else $c - 48 end));
    def le32($o): [.value[$o:$o+4][] | hex] | .[0] + 256 * .[1] + 65536 * .[2] + 16777216 * .[3];
    [(.formatted.value.schema_version // le32(0)), (.formatted.value.program_generation // le32(4))] | @tsv
  ' <<<"$meta" 2>/dev/null || true) || true
fi
META_ERR=""
if [ -n "$META_ID" ] && { ! [[ "$P_SCHEMA" =~ ^[0-9]+$ ]] || ! [[ "$P_GEN" =~ ^[0-9]+$ ]]; }; then
  META_ERR="fluxvm_meta (map $META_ID) is pinned but its value could not be read (bpftool map lookup: $(head -c 160 <<<"${meta:-nothing}" | tr '\n' ' '))"
  P_SCHEMA="" P_GEN=""
fi
check_version() { # NAME FIELD RUNNING PINNED EXPECT
  local name="$1" field="$2" running="$3" pinned="$4" expect="$5" detail bad=""
  detail="the daemon's binary has ${running:-? (no status)}"
  if [ -n "$expect" ] && [ -n "$running" ] && [ "$running" != "$expect" ]; then bad="the daemon reports $field $running, want $expect"; fi
  if [ -n "$pinned" ]; then
    detail="$detail, the pinned fluxvm_meta $pinned"
    if [ -z "$bad" ] && [ -n "$running" ] && [ "$pinned" != "$running" ]; then bad="pinned fluxvm_meta has $field $pinned, the daemon's binary $running"; fi
    if [ -z "$bad" ] && [ -n "$expect" ] && [ "$pinned" != "$expect" ]; then bad="pinned fluxvm_meta has $field $pinned, want $expect"; fi
  fi
  [ -z "$expect" ] || detail="$detail, expected $expect"
  [ -z "$bad" ] && [ -n "$META_ERR" ] && bad="$META_ERR; $detail"
  if [ -n "$bad" ]; then
    fail "$name" "$bad"
  elif [ -z "$pinned" ] && { [ -z "$expect" ] || [ -z "$running" ]; }; then
    skip "$name" "$detail; nothing to compare it with (bpftool reads the pins; --expect-$name)"
  else
    pass "$name" "$detail"
  fi
}
check_version schema schema_version "$ST_SCHEMA" "$P_SCHEMA" "$EXPECT_SCHEMA"
check_version generation program_generation "$ST_GEN" "$P_GEN" "$EXPECT_GEN"

if [ -z "$STATUS" ]; then
  for c in interfaces xdp advertisements health; do
    skip "$c" "no status from the API"
  done
else
  # --- interfaces --------------------------------------------------------
  # link_prog PIN: "<prog id> <prog name> <map ids...>" of a pinned link.
  link_prog() {
    local pid
    pid="$(bpftool link show pinned "$1" -j 2>/dev/null | jq -r '.prog_id // empty' || true)"
    [ -n "$pid" ] || return 0
    bpftool prog show id "$pid" -j 2>/dev/null | jq -r '"\(.id) \(.name) \(.map_ids // [] | join(" "))"' || true
  }
  # link_kernel PIN: "<type> <ifindex> <attach type>" of a pinned link as
  # the kernel reports it (bpf(2): BPF_OBJ_GET, BPF_OBJ_GET_INFO_BY_FD), for
  # a bpftool that does not decode the link (tcx: bpftool 7.3 and later).
  # Types: 6 xdp, 11 tcx; attach types: 46 tcx_ingress, 47 tcx_egress. A
  # detached link has ifindex 0. Nothing when python3 is missing.
  link_kernel() {
    command -v python3 >/dev/null || return 0
    python3 - "$1" <<'PY' 2>/dev/null || true
import ctypes, os, struct, sys
nr = {"x86_64": 321, "aarch64": 280}[os.uname().machine]
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.syscall.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_long]
path = ctypes.create_string_buffer(sys.argv[1].encode())
attr = ctypes.create_string_buffer(struct.pack("=QIIi", ctypes.addressof(path), 0, 0, 0).ljust(128, b"\0"))
fd = libc.syscall(nr, 7, attr, 128)
if fd < 0:
    sys.exit(1)
info = ctypes.create_string_buffer(128)
attr = ctypes.create_string_buffer(struct.pack("=IIQ", fd, 128, ctypes.addressof(info)).ljust(128, b"\0"))
if libc.syscall(nr, 15, attr, 128) < 0:
    sys.exit(1)
typ = struct.unpack_from("=I", info, 0)[0]
ifindex, attach = struct.unpack_from("=II", info, 16)
print(typ, ifindex, attach)
PY
  }
  # link_attach PIN: "<ifindex> <attach>" of a pinned link, attach one of
  # tcx_ingress, tcx_egress, xdp (else what was found); from bpftool when
  # it decodes the link, else from the kernel; nothing when neither can.
  link_attach() {
    local js t i a
    js="$(bpftool link show pinned "$1" -j 2>/dev/null || true)"
    read -r t i a < <(jq -r '[(.type | tostring), (.ifindex // "" | tostring), (.attach_type // "" | tostring)] | @tsv' <<<"$js" 2>/dev/null || true) || true
    if [ -n "$i" ]; then
      [ "$t" != xdp ] || a=xdp
      echo "$i ${a:-$t}"; return
    fi
    read -r t i a < <(link_kernel "$1") || true
    [ -n "$i" ] || return 0
    case "$t/$a" in
      6/*) a=xdp ;;
      11/46) a=tcx_ingress ;;
      11/47) a=tcx_egress ;;
      *) a="type$t/attach$a" ;;
    esac
    echo "$i $a"
  }
  # check_link IF PIN PROG ATTACH: "" when the pin holds a link of PROG on
  # this root's maps attached to IF's ifindex (the status's) as ATTACH
  # (tcx_ingress, tcx_egress, xdp), "warn: ..." when the attachment cannot
  # be confirmed (old bpftool and no python3), else why not.
  check_link() {
    local ifc="$1" pin="$2" want="$3" want_attach="$4" info att idx
    [ -e "$pin" ] || { echo "link pin $pin missing"; return; }
    [ -n "$BPFTOOL" ] || return 0
    info="$(link_prog "$pin")"
    [ -n "$info" ] || { echo "$pin holds no live link"; return; }
    # shellcheck disable=SC2086
    set -- $info
    [ "$2" = "$want" ] || { echo "$pin runs program $2, want $want"; return; }
    if [ -n "$META_ID" ] && [[ " ${*:3} " != *" $META_ID "* ]]; then
      echo "$pin runs $want on maps of another pin root (not fluxvm_meta $META_ID)"; return
    fi
    idx="$(jq -r --arg n "$ifc" '.interfaces[]? | select(.name == $n) | .ifindex' <<<"$STATUS")"
    att="$(link_attach "$pin")"
    if [ -z "$att" ]; then
      echo "warn: $pin: attachment not confirmed (this bpftool does not decode the link; python3 reads it from the kernel)"; return
    fi
    # shellcheck disable=SC2086
    set -- $att
    if [ "$1" = 0 ]; then echo "$pin: link detached (attached to no interface)"
    elif [ "$1" != "$idx" ]; then echo "$pin: link attached to ifindex $1, $ifc is $idx"
    elif [ "$2" != "$want_attach" ]; then echo "$pin: link attached as $2, want $want_attach"
    fi
  }
  # dev_ifindex IF: the interface's ifindex in the checked namespace.
  dev_ifindex() { in_ns "$NETNS" ip -o link show dev "$1" 2>/dev/null | awk -F': ' 'NR == 1 { print $1 }' || true; }
  # net_show IF: bpftool net show dev IF -j, in the checked namespace.
  net_show() { in_ns "$NETNS" bpftool net show dev "$1" -j 2>/dev/null || true; }

  # hook_attach HOOK: how HOOK's tcx link is attached.
  hook_attach() { case "$1" in from_vm|ns_in) echo tcx_ingress ;; *) echo tcx_egress ;; esac; }
  check_iface() { # KIND NAME HOOK...
    local kind="$1" ifc="$2"; shift 2
    local js problems=() notes=() hooks=() h mode idx devidx why
    js="$(jq -c --arg n "$ifc" '.interfaces[]? | select(.name == $n)' <<<"$STATUS")"
    if [ -z "$js" ]; then fail "interface $ifc" "configured $kind, not in the status"; return; fi
    [ "$(jq -r .kind <<<"$js")" = "$kind" ] || problems+=("kind $(jq -r .kind <<<"$js"), configured $kind")
    [ -z "$(jq -r '.problem // empty' <<<"$js")" ] || problems+=("problem: $(jq -r .problem <<<"$js")")
    idx="$(jq -r .ifindex <<<"$js")"
    if command -v ip >/dev/null; then
      devidx="$(dev_ifindex "$ifc")"
      if [ -z "$devidx" ]; then problems+=("no such device${NETNS:+ in netns $NETNS}")
      elif [ "$devidx" != "$idx" ]; then problems+=("ifindex $devidx, the status says $idx (recreated?)"); fi
    fi
    for h in "$@"; do
      mode="$(jq -r --arg h "$h" '.hooks[]? | select(.hook == $h) | .mode' <<<"$js")"
      if [ -z "$mode" ]; then problems+=("hook $h not attached (status)"); continue; fi
      hooks+=("$h/$mode")
      if [ "$mode" = tcx ]; then
        why="$(check_link "$ifc" "$PIN_ROOT/links/tcx_${idx}_$h" "fluxvm_$h" "$(hook_attach "$h")")"
        case "$why" in
          "") ;;
          warn:*) notes+=("${why#warn: }") ;;
          *) problems+=("$why") ;;
        esac
      elif [ -n "$BPFTOOL" ]; then
        net_show "$ifc" | jq -e --arg p "fluxvm_$h" '[.[]?.tc[]? | select(.name == $p)] | length > 0' >/dev/null ||
          problems+=("bpftool net show dev $ifc lists no $mode program fluxvm_$h")
      fi
    done
    if [ ${#problems[@]} -gt 0 ]; then
      local msg; msg="$(printf '%s; ' "${problems[@]}")"
      fail "interface $ifc" "$kind: ${msg%; }"
    elif [ ${#notes[@]} -gt 0 ]; then
      local msg; msg="$(printf '%s; ' "${notes[@]}")"
      warn "interface $ifc" "$kind ifindex $idx: ${hooks[*]}; ${msg%; }"
    else
      local checked="status, link pins"
      [ -z "$BPFTOOL" ] || checked="status, link pins, programs and their attachment via bpftool"
      pass "interface $ifc" "$kind ifindex $idx: ${hooks[*]} ($checked)"
    fi
  }
  if [ ${#VM_EDGE[@]} -eq 0 ] && [ ${#NS_IFS[@]} -eq 0 ]; then
    skip interfaces "none configured"
  fi
  for ifc in "${VM_EDGE[@]}"; do check_iface vm-edge "$ifc" from_vm to_vm; done
  for ifc in "${NS_IFS[@]}"; do check_iface north-south "$ifc" ns_in ns_out; done

  # Link pins of interfaces the daemon no longer serves (renamed or
  # removed from the configuration while it was stopped).
  if [ "$root_ok" = 1 ] && [ -d "$PIN_ROOT/links" ]; then
    known=" $(st '[.interfaces[]?.ifindex] | map(tostring) | join(" ")') "
    stale=()
    for f in "$PIN_ROOT"/links/tcx_* "$PIN_ROOT"/links/xdp_*; do
      [ -e "$f" ] || continue
      b="$(basename "$f")"; i="${b#tcx_}"; i="${i#xdp_}"; i="${i%%_*}"
      [[ "$known" == *" $i "* ]] || stale+=("$b")
    done
    if [ ${#stale[@]} -gt 0 ]; then warn links "pinned for interfaces the daemon does not serve: ${stale[*]}"
    else pass links "every tcx/xdp link pin is of an interface the daemon serves"; fi
  fi

  # --- XDP on the north-south interfaces ---------------------------------
  if [ ${#NS_IFS[@]} -eq 0 ]; then
    skip xdp "no north-south interface (xdp_mode $XDP_MODE)"
  fi
  for ifc in "${NS_IFS[@]}"; do
    got="$(jq -r --arg n "$ifc" '.interfaces[]? | select(.name == $n) | .xdp // "off"' <<<"$STATUS")"
    idx="$(jq -r --arg n "$ifc" '.interfaces[]? | select(.name == $n) | .ifindex' <<<"$STATUS")"
    # Why auto left XDP off there: an offload XDP would misread.
    xproblem="$(jq -r --arg n "$ifc" '.interfaces[]? | select(.name == $n) | .xdp_problem // empty' <<<"$STATUS")"
    case "$XDP_MODE" in
      auto) ok_modes="native generic"; [ -z "$xproblem" ] || ok_modes="off" ;;
      "(no configuration)") ok_modes="off native generic" ;;
      *) ok_modes="$XDP_MODE" ;;
    esac
    if [[ " $ok_modes " != *" $got "* ]]; then
      fail "xdp $ifc" "runs ${got:-nothing}, xdp_mode is $XDP_MODE"; continue
    fi
    if [ "$got" = off ]; then
      if [ -e "$PIN_ROOT/links/xdp_$idx" ]; then fail "xdp $ifc" "XDP off but $PIN_ROOT/links/xdp_$idx is pinned"
      elif [ -n "$xproblem" ]; then warn "xdp $ifc" "off, TC alone (xdp_mode $XDP_MODE): $xproblem"
      elif [ "$HAVE_CONFIG" = 1 ]; then pass "xdp $ifc" "off, as configured"
      else pass "xdp $ifc" "off (the status; no configuration to compare)"; fi
      continue
    fi
    why="$(check_link "$ifc" "$PIN_ROOT/links/xdp_$idx" fluxvm_xdp_ns xdp)"
    xnote=""
    case "$why" in warn:*) xnote="; ${why#warn: }"; why="" ;; esac
    if [ -z "$why" ] && [ -n "$BPFTOOL" ]; then
      want_kernel=driver; [ "$got" = generic ] && want_kernel=generic
      kmode="$(net_show "$ifc" | jq -r '[.[]?.xdp[]?][0].mode // empty' || true)"
      [ "$kmode" = "$want_kernel" ] || why="the kernel shows XDP mode ${kmode:-none} on $ifc, want $want_kernel"
    fi
    if [ -n "$why" ]; then fail "xdp $ifc" "$why"
    elif [ -n "$xnote" ]; then warn "xdp $ifc" "$got (xdp_mode $XDP_MODE)$xnote"
    else pass "xdp $ifc" "$got (xdp_mode $XDP_MODE)${BPFTOOL:+, pinned link and the kernel agree}"; fi
  done

  # --- advertisements ----------------------------------------------------
  a_path="$(st '.advertisements.path // ""')"
  a_gen="$(st '.advertisements.generation // 0')"
  a_err="$(st '.advertisements.last_error // ""')"
  a_sum="generation $a_gen, $(st '.advertisements.advertised // 0') advertised, $(st '.advertisements.withdrawn // 0') withdrawn"
  if [ -n "$a_err" ]; then
    fail advertisements "last publish failed: $a_err"
  elif [ -z "$a_path" ]; then
    skip advertisements "kept in memory only (no advertisements_path); $a_sum"
  elif [ "$HAVE_CONFIG" = 1 ] && [ "$a_path" != "$ADV_PATH" ]; then
    fail advertisements "published to $a_path, the configuration says $ADV_PATH"
  elif [ "$a_gen" = 0 ]; then
    fail advertisements "nothing published yet to $a_path"
  elif [ ! -s "$a_path" ]; then
    fail advertisements "$a_path missing or empty (status $a_sum)"
  elif ! f_gen="$(jq -er '.generation' "$a_path" 2>/dev/null)"; then
    fail advertisements "$a_path is not a snapshot document"
  elif [ "$f_gen" != "$a_gen" ]; then
    fail advertisements "$a_path has generation $f_gen, the status $a_gen"
  else
    pass advertisements "$a_path: $a_sum"
  fi

  # --- backend health -----------------------------------------------------
  code="$(api /v1/network/services/health "$TOKEN")"
  if [ "$code" != 200 ]; then
    fail health "GET /v1/network/services/health: $code"
  else
    h_svc="" h_be="" h_bad=""
    read -r h_svc h_be h_bad < <(jq -r '[(.services | length), ([.services[].backends[]] | length),
      ([.services[].backends[] | select(.observed == "unhealthy")] | length)] | @tsv' "$BODY_FILE" 2>/dev/null || true) || true
    if [ -z "$h_bad" ]; then
      fail health "GET /v1/network/services/health: not a health report"
    elif [ "$h_bad" -gt 0 ]; then
      warn health "$h_bad of $h_be backends unhealthy: $(jq -r '[.services[] | .name as $s | .backends[]
        | select(.observed == "unhealthy") | "\($s) \(.address):\(.port)"] | join(", ")' "$BODY_FILE")"
    else
      pass health "$h_svc services with health checks, $h_be backends, none unhealthy"
    fi
  fi
fi

# --- VIP probe ---------------------------------------------------------
if [ -z "$VIP" ]; then
  skip vip "no --vip"
else
  if [[ "$VIP" =~ ^\[(.*)\]:([0-9]+)$ ]] || [[ "$VIP" =~ ^([^:]+):([0-9]+)$ ]]; then
    v_addr="${BASH_REMATCH[1]}" v_port="${BASH_REMATCH[2]}"
    where="${VIP_NETNS:+ from netns $VIP_NETNS}"
    start_ms=$(date +%s%3N)
    if [ -n "$VIP_HTTP" ]; then
      host="$v_addr"; [[ "$v_addr" != *:* ]] || host="[$v_addr]"
      code="$(in_ns "$VIP_NETNS" curl -s -o /dev/null -w '%{http_code}' --max-time "$TIMEOUT" "http://$host:$v_port$VIP_HTTP" || true)"
      ms=$(( $(date +%s%3N) - start_ms ))
      if [[ "$code" =~ ^[234] ]]; then pass "vip $VIP" "HTTP GET $VIP_HTTP: $code in ${ms}ms$where"
      else fail "vip $VIP" "HTTP GET $VIP_HTTP: ${code:-000} (no answer within ${TIMEOUT}s)$where"; fi
    else
      if in_ns "$VIP_NETNS" timeout "$TIMEOUT" bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$v_addr" "$v_port" 2>/dev/null; then
        pass "vip $VIP" "TCP connect in $(( $(date +%s%3N) - start_ms ))ms$where"
      else
        fail "vip $VIP" "TCP connect failed or timed out (${TIMEOUT}s)$where"
      fi
    fi
  else
    fail "vip $VIP" "not ADDR:PORT or [ADDR]:PORT"
  fi
fi

summary || exit 1
