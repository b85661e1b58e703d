#!/usr/bin/env bash
# README command 1: install everything, start an embedded cluster, mount it, and prove it
# with a torch.save / torch.load round trip of a real state dict through the mount.
#
#   sudo bash deploy/quickstart.sh          # set up (idempotent: reuses a running cluster)
#   sudo bash deploy/quickstart.sh stop     # unmount and stop the cluster
#
# Environment: TECTONIC_DEMO_DIR (default ./demo-cluster) holds the cluster's data and
# cluster.toml; TECTONIC_MOUNT (default $TECTONIC_DEMO_DIR/mnt) is the mount point.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
DEMO=${TECTONIC_DEMO_DIR:-$REPO/demo-cluster}
MNT=${TECTONIC_MOUNT:-$DEMO/mnt}
T=$REPO/.venv/bin/tectonic
PY=$REPO/.venv/bin/python

die() { echo "quickstart: error: $*" >&2; exit 1; }

stop() {
    if mountpoint -q "$MNT" 2>/dev/null; then
        "$T" umount "$MNT" || "$T" umount --lazy "$MNT"
        echo "unmounted $MNT"
    fi
    if [ -f "$DEMO/mount.json" ]; then
        # the mount daemon exits by itself once unmounted; wait for it (bounded)
        pid=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["pid"])' "$DEMO/mount.json")
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        rm -f "$DEMO/mount.json"
    fi
    if [ -x "$T" ]; then "$T" cluster down --dir "$DEMO"; fi
}

if [ "${1:-}" = "stop" ]; then stop; exit 0; fi
[ $# -eq 0 ] || die "usage: $0 [stop]"

echo "== 1/4 installing (apt packages, $REPO/.venv)"
bash deploy/install.sh
[ -e /dev/fuse ] || die "/dev/fuse is missing: load the fuse module (modprobe fuse) or run the container with --device /dev/fuse"

echo "== 2/4 starting the embedded cluster in $DEMO"
mkdir -p "$DEMO"
if [ -f "$DEMO/cluster.pid" ] && [ -f "$DEMO/cluster.toml" ] && "$T" status "$DEMO/cluster.toml" >/dev/null 2>&1; then
    echo "a cluster is already running in $DEMO: reusing it"
else
    "$T" cluster up --detach --dir "$DEMO"
fi

echo "== 3/4 mounting on $MNT"
if ! stat "$MNT" >/dev/null 2>&1 && [ -e "$(dirname "$MNT")" ]; then
    # a mount whose daemon died ("Transport endpoint is not connected"): clear it
    fusermount3 -uz "$MNT" 2>/dev/null || true
fi
mkdir -p "$MNT"
if mountpoint -q "$MNT"; then
    echo "$MNT is already mounted: reusing it"
else
    # returns once the mount is up (or with the mount's one-line error)
    "$T" mount "$DEMO/client.toml" "$MNT" --ready-file "$DEMO/mount.json" --log-file "$DEMO/mount.log"
fi

echo "== 4/4 torch.save / torch.load round trip through $MNT"
"$PY" - "$MNT" <<'PYEOF'
import os, sys, tempfile, time, warnings, zipfile
import torch

warnings.filterwarnings("ignore", message=".*enable_nested_tensor.*")

mnt = sys.argv[1]
torch.manual_seed(0)
# a real model's weights: a small Transformer, about 90 MB of float32 tensors
model = torch.nn.Transformer(d_model=512, nhead=8, num_encoder_layers=3,
                             num_decoder_layers=3, dim_feedforward=2048)
state = model.state_dict()
nbytes = sum(t.numel() * t.element_size() for t in state.values())
os.makedirs(os.path.join(mnt, "quickstart"), exist_ok=True)
path = os.path.join(mnt, "quickstart", "transformer.pt")

t0 = time.perf_counter()
torch.save(state, path)
t1 = time.perf_counter()
loaded = torch.load(path, weights_only=True)
t2 = time.perf_counter()
# a second save, to another name: the steady state, with torch and the mount warmed up
again = os.path.join(mnt, "quickstart", "transformer.again.pt")
t6 = time.perf_counter()
torch.save(state, again)
t7 = time.perf_counter()
os.unlink(again)

# file level: torch.save wrote a zip whose every member carries the CRC-32 torch computed
# while saving; reading them all back through the mount must match each one
with zipfile.ZipFile(path) as archive:
    bad_member = archive.testzip()
# tensor level: every tensor back with the same dtype, shape and bytes
same_tensors = state.keys() == loaded.keys() and all(
    state[k].dtype == loaded[k].dtype and state[k].shape == loaded[k].shape
    and state[k].numpy().tobytes() == loaded[k].numpy().tobytes() for k in state)
# the ceiling, measured now on this machine: the same save to local disk ending in fsync
# (close on the mount is durable, so fsync makes it a fair match), and the load from there
with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(mnt))) as scratch:
    local = os.path.join(scratch, "transformer.pt")
    t3 = time.perf_counter()
    with open(local, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    t4 = time.perf_counter()
    torch.load(local, weights_only=True)
    t5 = time.perf_counter()
mb = os.path.getsize(path) / 1e6
save, save2, load = mb / (t1 - t0), mb / (t7 - t6), mb / (t2 - t1)
disk_save, disk_load = mb / (t4 - t3), mb / (t5 - t4)
print(f"saved {len(state)} tensors ({nbytes / 1e6:.1f} MB of weights, a {mb:.1f} MB file) "
      f"through the mount:")
print(f"  first save   {save:6.0f} MB/s = {save / disk_save:.2f} x local disk with fsync "
      f"({disk_save:.0f} MB/s, measured now)")
print(f"  second save  {save2:6.0f} MB/s = {save2 / disk_save:.2f} x local disk with fsync")
print(f"  load         {load:6.0f} MB/s = {load / disk_load:.2f} x a local load from the page "
      f"cache ({disk_load:.0f} MB/s)")
print("  1.00 x would be this machine's own disk. A save through the mount is durable when "
      "close() returns\n  (RS(6,3) over the chunk stores: at least k+1 chunks of every block "
      "fsync'd), as a local save is\n  after fsync; here the chunk stores, the metadata "
      "servers and the mount share the machine's cores\n  with torch.")
if bad_member is not None or not same_tensors:
    print(f"MISMATCH: bad zip member: {bad_member}, tensors equal: {same_tensors}")
    sys.exit(1)
print("round trip bit-exact: every zip member's CRC and every tensor's bytes match")
PYEOF

ENV_HINT=""
[ -z "${TECTONIC_DEMO_DIR:-}" ] || ENV_HINT+="TECTONIC_DEMO_DIR=$DEMO "
[ -z "${TECTONIC_MOUNT:-}" ] || ENV_HINT+="TECTONIC_MOUNT=$MNT "
cat <<EOT

tectonic-py is running.
  mount point:   $MNT
  cluster file:  $DEMO/cluster.toml
  use it:        torch.save(model.state_dict(), "$MNT/ckpt/step_1000.pt")
                 ls -l $MNT/quickstart
  without FUSE:  $T ls $DEMO/client.toml /quickstart
  health:        $T status $DEMO/cluster.toml
  stop:          ${ENV_HINT}bash $REPO/deploy/quickstart.sh stop
                 (= $T umount $MNT; $T cluster down --dir $DEMO)
EOT
