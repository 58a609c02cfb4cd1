# Sourced by hack/kind-e2e.sh: a Docker engine for kind, and the host left as it was found.
# shellcheck shell=bash
#
# engine_up: if a Docker engine answers (and KIND_E2E_OWN_DOCKERD is unset), kind uses it and
#   nothing here touches the host. Otherwise Debian's dockerd (apt-get install docker.io) is
#   started with a data root in the cache (~/.cache/kube-fence/kind/docker: loaded images survive
#   for the next run) and an exec root and socket of its own, so it shares nothing with another
#   engine or containerd. It runs with --iptables=false --ip-forward=false --ip-masq=false
#   --bridge=none: it adds no iptables rule and no docker0 bridge and leaves ip_forward alone;
#   kind's network is a plain bridge the host reaches directly, the API server's port is
#   published by docker-proxy on 127.0.0.1, and containers get no route beyond the machine.
#   Where the capability bounding set is not full, `docker run --privileged` cannot work, and
#   hack/kind/docker-bin/docker goes first on PATH (see that file).
# engine_down: stops that dockerd, then puts back what a Docker engine or a kind node may change
#   on the host (interfaces, iptables, forwarding and bridge sysctls, the sysctls a kubelet sets
#   that are not per network namespace) and says what it put back; returns non-zero (saying what)
#   when the host could not be put back as it was. Safe to call twice.

engine_owned=false
engine_dir=$kf_cache/kind/docker
engine_run=/run/kf-kind-docker
engine_state=""
# Host sysctls a Docker engine or a kind node's kubelet / kube-proxy may set.
engine_sysctls=(net.ipv4.ip_forward net.ipv4.conf.all.forwarding net.ipv4.conf.default.forwarding
  net.ipv6.conf.all.forwarding net.ipv6.conf.default.forwarding net.ipv4.conf.all.route_localnet
  net.bridge.bridge-nf-call-iptables net.bridge.bridge-nf-call-ip6tables net.bridge.bridge-nf-call-arptables
  vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops kernel.keys.root_maxkeys
  kernel.keys.root_maxbytes net.netfilter.nf_conntrack_max)

engine_say() { printf '[kind-engine %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

engine_snapshot() { # $1 = directory
  local k
  for k in "${engine_sysctls[@]}"; do
    [[ -e /proc/sys/${k//.//} ]] && printf '%s=%s\n' "$k" "$(cat "/proc/sys/${k//.//}")"
  done > "$1/sysctl"
  ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1 | sort > "$1/links"
  for t in iptables ip6tables; do
    { "$t-save" 2>/dev/null || true; } | sed -e '/^#/d' -e 's/\[[0-9]*:[0-9]*\]/[0:0]/' > "$1/$t"
  done
}

engine_up() {
  if [[ -z ${KIND_E2E_OWN_DOCKERD:-} ]] && docker info >/dev/null 2>&1; then
    engine_say "using the Docker engine that answers ($(docker version -f '{{.Server.Version}}' 2>/dev/null))"
    KF_REAL_DOCKER=$(command -v docker)
    engine_privileged
    return 0
  fi
  command -v dockerd >/dev/null 2>&1 || { engine_say "error: no Docker engine answers and dockerd is not installed (apt-get install docker.io)"; return 1; }
  [[ $(id -u) -eq 0 ]] || { engine_say "error: starting a Docker engine needs root"; return 1; }
  if [[ -S $engine_run/docker.sock ]] && DOCKER_HOST=unix://$engine_run/docker.sock docker info >/dev/null 2>&1; then
    engine_say "error: a dockerd started by an earlier run (KEEP_CLUSTER) still answers on $engine_run/docker.sock; stop it first: hack/kind-e2e.sh --down"
    return 1
  fi
  mkdir -p "$engine_run"
  engine_state=$engine_run/host-before
  rm -rf "$engine_state" && mkdir -p "$engine_state"
  engine_snapshot "$engine_state"
  engine_owned=true
  mkdir -p "$engine_dir/data" "$engine_run"
  # Debian's docker CLI matches its daemon; kind runs whatever `docker` is first on PATH.
  export KF_REAL_DOCKER=/usr/bin/docker
  [[ -x $KF_REAL_DOCKER ]] || KF_REAL_DOCKER=$(command -v docker)
  engine_say "starting dockerd (data root $engine_dir/data, exec root $engine_run/exec; no iptables, no docker0)"
  dockerd --data-root "$engine_dir/data" --exec-root "$engine_run/exec" --pidfile "$engine_run/dockerd.pid" \
    -H "unix://$engine_run/docker.sock" --iptables=false --ip6tables=false --ip-forward=false --ip-masq=false \
    --bridge=none --storage-driver=overlay2 --log-level=warn >"$engine_dir/dockerd.log" 2>&1 &
  echo $! > "$engine_run/dockerd.pid.started"
  export DOCKER_HOST=unix://$engine_run/docker.sock
  local i
  for i in $(seq 1 60); do
    "$KF_REAL_DOCKER" info >/dev/null 2>&1 && break
    kill -0 "$(cat "$engine_run/dockerd.pid.started")" 2>/dev/null || { tail -20 "$engine_dir/dockerd.log" >&2; engine_say "error: dockerd exited"; return 1; }
    sleep 0.5
  done
  "$KF_REAL_DOCKER" info >/dev/null 2>&1 || { tail -20 "$engine_dir/dockerd.log" >&2; engine_say "error: dockerd did not answer in 30 s"; return 1; }
  engine_privileged
  engine_say "dockerd $("$KF_REAL_DOCKER" version -f '{{.Server.Version}}') answers on $DOCKER_HOST"
}

# Capabilities the bounding set lacks make --privileged fail: kind then goes through the wrapper.
engine_privileged() {
  export KF_REAL_DOCKER
  local i bnd last missing="" names=(CHOWN DAC_OVERRIDE DAC_READ_SEARCH FOWNER FSETID KILL SETGID SETUID SETPCAP
    LINUX_IMMUTABLE NET_BIND_SERVICE NET_BROADCAST NET_ADMIN NET_RAW IPC_LOCK IPC_OWNER SYS_MODULE SYS_RAWIO
    SYS_CHROOT SYS_PTRACE SYS_PACCT SYS_ADMIN SYS_BOOT SYS_NICE SYS_RESOURCE SYS_TIME SYS_TTY_CONFIG MKNOD LEASE
    AUDIT_WRITE AUDIT_CONTROL SETFCAP MAC_OVERRIDE MAC_ADMIN SYSLOG WAKE_ALARM BLOCK_SUSPEND AUDIT_READ PERFMON BPF
    CHECKPOINT_RESTORE)
  bnd=$((16#$(awk '/^CapBnd:/{print $2}' /proc/self/status)))
  last=$(cat /proc/sys/kernel/cap_last_cap)
  for i in $(seq 0 "$last"); do
    (( (bnd >> i) & 1 )) || missing+="${missing:+ }${names[$i]:-$i}"
  done
  export PATH
  if [[ -n $missing ]]; then
    engine_say "the capability bounding set lacks $missing: \`docker run --privileged\` goes through hack/kind/docker-bin/docker"
    export KF_PRIVILEGED_DROP=$missing
    export KF_PRIVILEGED_ENTRY=$PWD/hack/kind/privileged-entry
    PATH=$PWD/hack/kind/docker-bin:$PATH
  elif $engine_owned; then
    # still run the daemon's own CLI
    mkdir -p "$engine_run/bin" && ln -sf "$KF_REAL_DOCKER" "$engine_run/bin/docker"
    PATH=$engine_run/bin:$PATH
  fi
}

# engine_adopt: take over a dockerd a KEEP_CLUSTER run left running (to stop it: engine_down).
engine_adopt() {
  local pid
  pid=$(cat "$engine_run/dockerd.pid.started" 2>/dev/null || true)
  [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null || return 1
  engine_owned=true
  engine_state=$engine_run/host-before
  [[ -d $engine_state ]] || engine_state=""
  export DOCKER_HOST=unix://$engine_run/docker.sock
  KF_REAL_DOCKER=/usr/bin/docker
  [[ -x $KF_REAL_DOCKER ]] || KF_REAL_DOCKER=$(command -v docker)
  engine_privileged
}

engine_down() {
  $engine_owned || return 0
  engine_owned=false
  local pid i k v now
  pid=$(cat "$engine_run/dockerd.pid.started" 2>/dev/null || true)
  if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; then
    engine_say "stopping dockerd (pid $pid)"
    kill "$pid"
    for i in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$pid" 2>/dev/null && { engine_say "dockerd did not stop in 30 s; killing it"; kill -9 "$pid"; }
  fi
  rm -f "$engine_run/dockerd.pid.started"
  # mounts left under our exec root / data root (only ours, by path)
  awk -v a="$engine_run" -v b="$engine_dir/data" '$2 ~ "^"a || $2 ~ "^"b {print $2}' /proc/self/mounts | sort -r \
    | while read -r m; do umount -l "$m" 2>/dev/null || true; done
  [[ -n $engine_state ]] || return 0
  local after
  after=$(mktemp -d "${TMPDIR:-/tmp}/kf-kind-host.XXXXXX")
  engine_snapshot "$after"
  # interfaces Docker made (kind's network bridge, veths, docker0)
  comm -13 "$engine_state/links" "$after/links" | while read -r l; do
    case $l in br-*|veth*|docker0) engine_say "deleting interface $l"; ip link delete "$l" 2>/dev/null || true ;; esac
  done
  while IFS='=' read -r k v; do
    now=$(cat "/proc/sys/${k//.//}" 2>/dev/null || true)
    if [[ $now != "$v" ]]; then
      engine_say "restoring $k: $now -> $v"
      printf '%s' "$v" > "/proc/sys/${k//.//}" 2>/dev/null || true
    fi
  done < "$engine_state/sysctl"
  for t in iptables ip6tables; do
    if ! cmp -s "$engine_state/$t" "$after/$t"; then
      engine_say "$t rules changed while the engine ran; removing Docker's"
      engine_remove_docker_rules "$t"
    fi
  done
  # What is left different from before, checked afresh.
  engine_snapshot "$after"
  local left=""
  while read -r l; do
    case $l in br-*|veth*|docker0) left+=" interface $l;" ;; esac
  done < <(comm -13 "$engine_state/links" "$after/links")
  while read -r k; do left+=" $k;"; done < <(comm -13 <(sort "$engine_state/sysctl") <(sort "$after/sysctl") | cut -d= -f1)
  for t in iptables ip6tables; do
    cmp -s "$engine_state/$t" "$after/$t" || { diff "$engine_state/$t" "$after/$t" >&2 || true; left+=" $t rules (diff above);"; }
  done
  if [[ -n $left ]]; then
    engine_say "error: the host is not as before:$left (the state before is kept in $engine_state)"
    rm -rf "$after"
    return 1
  fi
  rm -rf "$engine_state" "$after"
  engine_state=""
  engine_say "the host is as before: interfaces, iptables and sysctls checked"
}

# What a Docker engine with iptables on leaves: DOCKER* chains, jumps to them, FORWARD DROP, MASQUERADE.
engine_remove_docker_rules() {
  local t=$1 table chain policy
  for table in filter nat; do
    { "$t-save" -t "$table" 2>/dev/null || true; } | sed -nE '/^-A .*(-j DOCKER|docker0|br-)/s/^-A/-D/p' \
      | while read -r rule; do eval "$t -t $table $rule" 2>/dev/null || true; done
    for chain in $("$t-save" -t "$table" 2>/dev/null | sed -n 's/^:\(DOCKER[^ ]*\) .*/\1/p'); do
      "$t" -t "$table" -F "$chain" 2>/dev/null || true
    done
    for chain in $("$t-save" -t "$table" 2>/dev/null | sed -n 's/^:\(DOCKER[^ ]*\) .*/\1/p'); do
      "$t" -t "$table" -X "$chain" 2>/dev/null || true
    done
  done
  policy=$(sed -n 's/^:FORWARD \([A-Z]*\) .*/\1/p' "$engine_state/$t" | head -1)
  [[ -n $policy ]] && "$t" -P FORWARD "$policy" 2>/dev/null || true
}
