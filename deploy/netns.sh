#!/usr/bin/env bash
# A multi-host tectonic-py cluster on one machine: every metadata server and chunk store
# runs in its own network namespace ("host") with its own address, joined by veth pairs
# to one bridge; the client (tectonic put/get, mount) stays in the root namespace.
#
#   deploy/netns.sh up DIR [--chunkstores N] [--metadata-servers M] [--shards S] [--ec rs-4-2]
#                          [--subnet 10.213.7] [--prefix tecto] [--rate 1gbit] [--delay 2ms]
#                          [--node-timeout S] [--heartbeat-interval S] [--metadata-engine etcd]
#   deploy/netns.sh cut  DIR NAME     # "host" NAME (md0, cs3, et1, ...) loses its network link
#   deploy/netns.sh heal DIR NAME     # and gets it back
#   deploy/netns.sh down DIR          # stop exactly what `up` started and delete what it made
#
# Addresses: SUBNET.1/24 on the bridge in the root namespace, SUBNET.10+i for metadata
# server i, SUBNET.100+i for chunk store i, and with --metadata-engine etcd SUBNET.50+i for
# etcd member i (three members, each its own host: the namespace survives any one of them). The script only ever creates, changes and
# deletes the bridge, veths and namespaces it names in DIR/netns.state; it touches no other
# interface, route or firewall rule. --rate (tc tbf) and --delay (tc netem, needs the
# sch_netem kernel module) shape each host's link in both directions (inside the namespace
# and on the bridge side), so transfers see the bandwidth and latency of a real network.
#
# Needs root (ip netns, veth, bridge). Run `down` even after a failed `up`: it removes
# whatever part was made.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}

die() { echo "netns.sh: error: $*" >&2; exit 1; }

usage() { sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

[ $# -ge 2 ] || usage
cmd=$1; DIR=$2; shift 2
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
STATE=$DIR/netns.state

# --- state: one "kind name" line per thing made, and "pid N" per daemon started ----------
record() { echo "$*" >> "$STATE"; }

state_get() { [ -f "$STATE" ] && awk -v k="$1" '$1 == k { print $2 }' "$STATE" || true; }

cmd_up() {
    local chunkstores=10 metadata_servers=1 shards=64 ec=rs-6-3 subnet=10.213.7 prefix=tecto
    local rate="" delay="" node_timeout=10 heartbeat=1 engine=sqlite
    while [ $# -gt 0 ]; do
        case $1 in
            --chunkstores) chunkstores=$2; shift 2 ;;
            --metadata-servers) metadata_servers=$2; shift 2 ;;
            --shards) shards=$2; shift 2 ;;
            --ec) ec=$2; shift 2 ;;
            --subnet) subnet=$2; shift 2 ;;
            --prefix) prefix=$2; shift 2 ;;
            --rate) rate=$2; shift 2 ;;
            --delay) delay=$2; shift 2 ;;
            --node-timeout) node_timeout=$2; shift 2 ;;
            --heartbeat-interval) heartbeat=$2; shift 2 ;;
            --metadata-engine) engine=$2; shift 2 ;;
            *) die "unknown option $1" ;;
        esac
    done
    [[ $subnet =~ ^10\.[0-9]{1,3}\.[0-9]{1,3}$ ]] || die "--subnet must look like 10.X.Y (a private /24)"
    [[ $prefix =~ ^[a-z][a-z0-9]{0,5}$ ]] || die "--prefix must be 1-6 lowercase letters/digits"
    [[ $chunkstores =~ ^[0-9]+$ ]] && [ "$chunkstores" -ge 1 ] && [ "$chunkstores" -le 60 ] \
        || die "--chunkstores must be 1..60"
    [[ $metadata_servers =~ ^[0-9]+$ ]] && [ "$metadata_servers" -ge 1 ] && [ "$metadata_servers" -le 9 ] \
        || die "--metadata-servers must be 1..9"
    [[ $engine == sqlite || $engine == etcd ]] || die "--metadata-engine must be sqlite or etcd"
    if [ "$engine" = etcd ]; then
        command -v etcd >/dev/null || die "--metadata-engine etcd needs etcd (apt-get install etcd-server)"
    fi
    [ "$(id -u)" -eq 0 ] || die "needs root (ip netns, veth, bridge)"
    [ -x "$PYTHON" ] || die "no python at $PYTHON: run deploy/install.sh first"
    [ ! -f "$STATE" ] || die "$STATE exists: run '$0 down $DIR' first"
    ip -o addr show | grep -q " inet $subnet\." && die "subnet $subnet.0/24 is already in use here"
    local bridge=${prefix}-br
    ip link show "$bridge" >/dev/null 2>&1 && die "bridge $bridge already exists"
    ip netns add "${prefix}-probe" 2>/dev/null || die "ip netns add is not permitted here"
    ip netns del "${prefix}-probe"

    : > "$STATE"
    # a failed start-up removes whatever part it made before reporting the error
    trap 'rc=$?; if [ $rc -ne 0 ]; then cmd_down >&2; fi' EXIT
    record subnet "$subnet"
    record prefix "$prefix"
    ip link add "$bridge" type bridge
    record bridge "$bridge"
    ip addr add "$subnet.1/24" dev "$bridge"
    ip link set "$bridge" up

    # make_host NAME ADDRESS: namespace + veth pair, host side on the bridge
    make_host() {
        local name=$1 addr=$2 ns=${prefix}-$1 outer=${prefix}-v$1
        ip netns add "$ns"
        record netns "$ns"
        ip link add "$outer" type veth peer name eth0 netns "$ns"
        record veth "$outer"
        ip link set "$outer" master "$bridge" up
        ip -n "$ns" addr add "$addr/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
        shape_link ip netns exec "$ns" tc qdisc add dev eth0
        shape_link tc qdisc add dev "$outer"
    }

    # shape_link TC-COMMAND...: latency with netem (root), bandwidth with tbf (under netem,
    # or root alone): tbf needs no sch_netem, which some kernels lack
    shape_link() {
        local tbf=(tbf rate "$rate" burst 512kb latency 100ms)
        if [ -n "$delay" ]; then
            "$@" root handle 1: netem delay "$delay" \
                || die "tc netem failed (is sch_netem in this kernel?): --delay cannot be applied"
            if [ -n "$rate" ]; then "$@" parent 1:1 handle 10: "${tbf[@]}"; fi
        elif [ -n "$rate" ]; then
            "$@" root "${tbf[@]}"
        fi
    }

    # launch NS LOG CMD...: start a daemon inside a namespace, remember its PID
    launch() {
        local ns=$1 log=$2; shift 2
        setsid ip netns exec "$ns" "$@" > "$log" 2>&1 < /dev/null &
        record pid $!
    }

    # the cluster secret (every process) and the capability key (daemons only: the cluster
    # file names the secret, never the key), created 0600 before any byte is written
    for key in secret capability_key; do
        (umask 077; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$DIR/$key")
        chmod 600 "$DIR/$key"
    done

    # etcd: three members, each in a namespace of its own, before the metadata servers
    local engine_args=() engine_toml="" endpoints=""
    if [ "$engine" = etcd ]; then
        local members="" i
        for i in 0 1 2; do members+="${members:+,}et$i=http://$subnet.$((50 + i)):2380"; done
        for i in 0 1 2; do
            local addr="$subnet.$((50 + i))"
            make_host "et$i" "$addr"
            launch "${prefix}-et$i" "$DIR/et$i.log" etcd --name "et$i" --data-dir "$DIR/et$i" \
                --listen-client-urls "http://$addr:2379" --advertise-client-urls "http://$addr:2379" \
                --listen-peer-urls "http://$addr:2380" --initial-advertise-peer-urls "http://$addr:2380" \
                --initial-cluster "$members" --initial-cluster-state new \
                --initial-cluster-token "netns-$prefix" --max-txn-ops 16384 \
                --max-request-bytes 33554432
            endpoints+="${endpoints:+,}http://$addr:2379"
        done
        engine_args=(--engine etcd --etcd-endpoints "$endpoints" --etcd-prefix "/tectonic/netns-$prefix")
        engine_toml=$'\n[metadata_engine]\nkind = "etcd"\n'"endpoints = [\"${endpoints//,/\", \"}\"]"$'\n'"prefix = \"/tectonic/netns-$prefix\""$'\n'
    fi

    # shards are dealt round-robin-free: contiguous ranges, one per metadata server
    local per=$(( (shards + metadata_servers - 1) / metadata_servers ))
    local servers_toml="" registry=""
    for ((i = 0; i < metadata_servers; i++)); do
        local lo=$((i * per)) hi=$(( (i + 1) * per - 1 ))
        if [ "$hi" -ge "$shards" ]; then hi=$((shards - 1)); fi
        [ "$lo" -le "$hi" ] || die "more metadata servers than shards"
        local addr="$subnet.$((10 + i))"
        make_host "md$i" "$addr"
        mkdir -p "$DIR/md$i"
        rm -f "$DIR/md$i/ready.json"
        launch "${prefix}-md$i" "$DIR/md$i/log" "$PYTHON" -m tectonic_py.cli.main metadata \
            --data-dir "$DIR/md$i" --listen "$addr:7100" --shards "$lo-$hi" \
            --total-shards "$shards" --secret-file "$DIR/secret" \
            --capability-key-file "$DIR/capability_key" \
            --ready-file "$DIR/md$i/ready.json" --node-timeout "$node_timeout" \
            "${engine_args[@]}"
        # under etcd the registry moves with its shard: chunk stores get every server
        if [ "$i" -eq 0 ] || [ "$engine" = etcd ]; then registry+="${registry:+,}$addr:7100"; fi
        servers_toml+=$'\n[[metadata_servers]]\n'"address = \"$addr:7100\""$'\n'"shards = [$(seq -s ', ' "$lo" "$hi")]"$'\n'
    done
    for ((i = 0; i < chunkstores; i++)); do
        local addr="$subnet.$((100 + i))"
        make_host "cs$i" "$addr"
        mkdir -p "$DIR/cs$i/data"
        rm -f "$DIR/cs$i/ready.json"
        launch "${prefix}-cs$i" "$DIR/cs$i/log" "$PYTHON" -m tectonic_py.cli.main chunkstore \
            --data-dir "$DIR/cs$i/data" --listen "$addr:7200" --node-id "cs$i" \
            --failure-domain "host$i" --secret-file "$DIR/secret" --registry "$registry" \
            --capability-key-file "$DIR/capability_key" \
            --heartbeat-interval "$heartbeat" --ready-file "$DIR/cs$i/ready.json"
    done

    # wait (bounded) for every daemon's ready file; a daemon that died fails fast
    local want=$((metadata_servers + chunkstores)) deadline=$((SECONDS + 60))
    while :; do
        local ready=0
        for f in "$DIR"/md*/ready.json "$DIR"/cs*/ready.json; do
            if [ -f "$f" ]; then ready=$((ready + 1)); fi
        done
        [ "$ready" -ge "$want" ] && break
        for pid in $(state_get pid); do
            kill -0 "$pid" 2>/dev/null || die "a daemon (pid $pid) exited during start-up; see $DIR/*/log"
        done
        [ $SECONDS -lt $deadline ] || die "only $ready of $want daemons became ready in 60 s; see $DIR/*/log"
        sleep 0.2
    done

    {
        echo "# tectonic-py cluster file, written by deploy/netns.sh"
        echo "name = \"netns-$prefix\""
        echo "secret_file = \"secret\""
        echo "shards = $shards"
        echo "default_ec = \"$ec\""
        echo "$servers_toml"
        echo "$engine_toml"
    } > "$DIR/cluster.toml.tmp"
    mv "$DIR/cluster.toml.tmp" "$DIR/cluster.toml"
    # new files inherit the root directory's policy: make it the one asked for
    "$PYTHON" -m tectonic_py.cli.main mkdir "$DIR/cluster.toml" / -p --ec "$ec"
    trap - EXIT
    echo "cluster of $metadata_servers metadata server(s) ($engine) and $chunkstores chunk stores is up"
    echo "cluster file: $DIR/cluster.toml"
}

cmd_link() {
    local updown=$1 name=${2:-}
    [ -n "$name" ] || die "which host? (md0, cs3, ...)"
    local prefix outer
    prefix=$(state_get prefix)
    [ -n "$prefix" ] || die "no cluster recorded in $STATE"
    outer=${prefix}-v$name
    grep -qx "veth $outer" "$STATE" || die "no host $name in this cluster"
    ip link set "$outer" "$updown"
    ip netns exec "${prefix}-$name" ip link set eth0 "$updown"
}

# ours PID: the process still runs one of our daemons (its command line names a path in
# DIR), so a PID reused by another process after a crash or reboot is never signalled
ours() { tr '\0' '\n' < "/proc/$1/cmdline" 2>/dev/null | grep -qF -- "$DIR/"; }

cmd_down() {
    [ -f "$STATE" ] || { echo "nothing recorded in $STATE"; return 0; }
    local pids="" pid
    for pid in $(state_get pid); do
        if ours "$pid"; then pids+=" $pid"; fi
    done
    for pid in $pids; do kill -TERM "$pid" 2>/dev/null || true; done
    # bounded wait for a clean exit, then SIGKILL what is left (only our own PIDs)
    for _ in $(seq 50); do
        local alive=0
        for pid in $pids; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ $alive -eq 0 ] && break
        sleep 0.1
    done
    for pid in $pids; do kill -KILL "$pid" 2>/dev/null || true; done
    for veth in $(state_get veth); do ip link del "$veth" 2>/dev/null || true; done
    for ns in $(state_get netns); do ip netns del "$ns" 2>/dev/null || true; done
    for br in $(state_get bridge); do ip link del "$br" 2>/dev/null || true; done
    rm -f "$STATE"
    echo "netns cluster in $DIR is down"
}

case $cmd in
    up) cmd_up "$@" ;;
    cut) cmd_link down "$@" ;;
    heal) cmd_link up "$@" ;;
    down) cmd_down ;;
    *) usage ;;
esac
