"""The benchmark report: ``bench/REPORT.md`` and ``bench/report.png`` from a results dict.

``bench.run_all`` measures; this module only renders, so a report can be rewritten from a saved
``results.json`` (``--render-only``) without measuring again. Each section of the report is one
function that returns its Markdown lines; a part that was skipped or failed renders as ``-`` or
as its error, never as an exception, because a half-finished run must still leave a report.
Each section names the command that reproduces its figures (``_reproduce``): a reader who
doubts a figure reruns that part alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MiB = 1024 * 1024
GiB = 1024 * MiB


# --- formatting ------------------------------------------------------------------------------


def size_label(n: int) -> str:
    """``16MiB`` for 16 MiB: the unit that divides ``n`` exactly, as the loadtest CLI spells it."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"


def _get(d: Any, *path: Any) -> Any:
    for key in path:
        if isinstance(d, dict):
            d = d.get(key)
        elif isinstance(d, list) and isinstance(key, int) and -len(d) <= key < len(d):
            d = d[key]
        else:
            return None
    return d


def _fmt(v: Any, digits: int = 0) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def _ratio(a: Any, b: Any) -> str:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or not b:
        return "-"
    return f"{a / b:.2f}"


def _burst_label(b: dict[str, Any]) -> str:
    return f"{b.get('ranks')} x {size_label(int(b.get('shard_size') or 0))}"


def _mbps(gbps: Any) -> float | None:
    return gbps * 1000 if isinstance(gbps, (int, float)) else None


def _mib(v: Any) -> str:
    return "-" if not isinstance(v, (int, float)) else f"{v / MiB:,.0f} MiB"


def _flatten(d: Any, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    if isinstance(d, dict):
        for k, v in d.items():
            if k in ("status", "timeline", "rank_times", "trace"):
                continue
            out.extend(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(d, list):
        for i, v in enumerate(d[:12]):
            out.extend(_flatten(v, f"{prefix}[{i}]"))
    elif isinstance(d, (int, float)) and not isinstance(d, bool):
        out.append((prefix, d))
    return out


def _bursts(results: dict[str, Any]) -> list[dict[str, Any]]:
    tec = results.get("tectonic") or {}
    return [b for b in tec.get("bursts") or [] if isinstance(b, dict)]


def _reproduce(part: str, *alone: str) -> list[str]:
    """The commands that reproduce a section: run_all's part alone, and the script or CLI
    it runs (with the sizes of a full run)."""
    text = f"Reproduce: `python -m bench.run_all --only {part}`"
    if alone:
        text += "; alone: " + ", ".join(f"`{c}`" for c in alone)
    return [text + ".", ""]


def _not_run(r: Any, what: str) -> list[str]:
    """A part's line when it has no figures: skipped, failed (with its error), or absent."""
    if not isinstance(r, dict) or not r:
        return [f"Not measured in this run ({what} was skipped).", ""]
    return [f"**Failed:** `{str(r.get('error', ''))[:500]}`", ""]


def _creates_until_last_open(burst: dict[str, Any]) -> Any:
    """A burst's ranks over the time until its last create returned: the loadtest's
    ``creates_per_s_until_last_open``, which results written before that name existed
    carried as ``creates_per_s`` (now files over the burst's wall time)."""
    if "creates_per_s_until_last_open" in burst:
        return burst["creates_per_s_until_last_open"]
    return burst.get("creates_per_s")


# --- the Markdown report ---------------------------------------------------------------------


def render_report(results: dict[str, Any], plot_name: str, notes: str = "") -> str:
    """The whole report, section by section, as one Markdown string."""
    lines: list[str] = []
    for section in (
        _header(results, plot_name),
        _headline(results),
        _onedir(results),
        _creates(results),
        _restore(results),
        _packs(results),
        _inplace(results),
        _appends(results),
        _metrics(results),
        _save(results),
        _sharing(results),
        _targets(results),
        _burst_table(results),
        _metadata(results),
        _ceilings(results),
        _other_scripts(results),
        _footer(results, notes),
    ):
        lines.extend(section)
    return "\n".join(lines)


def _header(results: dict[str, Any], plot_name: str) -> list[str]:
    m = results.get("machine", {})
    lb, la = results.get("load_before") or [0, 0, 0], results.get("load_after") or [0, 0, 0]
    lines = [
        "# tectonic-py benchmark report",
        "",
        (
            f"Generated by `python -m bench.run_all` on {results.get('started')} (finished "
            f"{results.get('finished')}), commit `{m.get('commit')}`, {m.get('cpus')} vCPU, "
            f"{m.get('memory_gib')} GiB, kernel {m.get('kernel')}, Python {m.get('python')}."
        ),
        (
            f"Load average at start {lb[0]:.1f}, at end {la[0]:.1f}: the machine's 2 cores are "
            "shared with other users' test runs, so MB/s figures are noisy (up to 2x between "
            "runs); CPU-seconds per GiB are steadier. Every ratio is to a ceiling measured in this "
            "same run."
        ),
        "",
        (
            "Regenerate it: `python -m bench.run_all`, from a directory outside the checkout with "
            "the checkout on `PYTHONPATH` (`-m` puts the working directory first on `sys.path`, "
            "and the daemons the run starts would import whatever checkout that holds); "
            "`--no-peers` leaves out GlusterFS and JuiceFS, `--only PARTS` reruns parts alone. "
            + _duration(results)
        ),
    ]
    if results.get("smoke"):
        lines += ["", "**Smoke run: tiny sizes, figures meaningless.**"]
    lines += ["", f"![benchmark plot]({plot_name})", ""]
    return lines


def _duration(results: dict[str, Any]) -> str:
    """Expected beside taken, so the next run's estimate can be corrected by this one."""
    import datetime

    expected = results.get("expected_s")
    text = "" if expected is None else f"Expected about {expected / 60:.0f} min"
    try:
        taken = (
            datetime.datetime.fromisoformat(str(results.get("finished")))
            - datetime.datetime.fromisoformat(str(results.get("started")))
        ).total_seconds()
    except ValueError:
        return text + "." if text else ""
    text += f"{'; this' if text else 'This'} run took {taken / 60:.1f} min"
    skipped = results.get("skipped")
    return text + (f" (skipped: {', '.join(skipped)})." if skipped else ".")


def _headline(results: dict[str, Any]) -> list[str]:
    """tectonic-py beside its ceilings and the peer: the FUSE, stream and burst rows."""
    lines = [
        "## tectonic-py beside its ceilings and the peer (GlusterFS 4+2 dispersed)",
        "",
        (
            "MB/s are 10^6 bytes per second. CPU-s/GiB counts every process involved (the workload, "
            "the FUSE daemon, metadata servers and chunk stores; for GlusterFS glusterd, the six "
            "bricks, the self-heal daemon and the FUSE client). Reads are cold (remounted)."
        ),
        "",
        (
            "| workload | tectonic-py MB/s | CPU-s/GiB | ceiling | ceiling MB/s | ratio to ceiling "
            "| GlusterFS MB/s | GlusterFS CPU-s/GiB | ratio to GlusterFS |"
        ),
        "|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    lines += _fuse_rows(results)
    lines += _stream_rows(results)
    lines += _mount_burst_rows(results)
    lines.append("")
    lines += _peer_note(results)
    lines += _reproduce(
        "ceilings,nullfs,fuse,bursts,peer",
        "python -m bench.bench_fuse --size 2048",
        "python -m bench.gluster --install --json",
    )
    return lines


def _fuse_rows(results: dict[str, Any]) -> list[str]:
    null = results.get("nullfs") or {}
    tec = results.get("tectonic") or {}
    peer = results.get("peer") or {}
    nd_w, nd_r = _get(null, "dd_write", "mbps"), _get(null, "dd_read", "mbps")
    rows = [
        ("dd write bs=1M conv=fsync (FUSE)", ("fuse_dd", "dd_write"), "nullfs dd write", nd_w),
        ("dd read bs=1M, cold (FUSE)", ("fuse_dd", "dd_read"), "nullfs dd read", nd_r),
        ("torch.save + fsync (FUSE)", ("fuse_torch", "torch_save"), "nullfs dd write", nd_w),
        ("torch.load, cold, verified (FUSE)", ("fuse_torch", "torch_load"), "nullfs dd read", nd_r),
    ]
    lines = []
    for label, where, cname, cval in rows:
        ours, theirs = _get(tec, *where), _get(peer, where[1])
        lines.append(
            f"| {label} | {_fmt(_get(ours, 'mbps'))} | {_fmt(_get(ours, 'cpu_s_per_gib'), 2)} "
            f"| {cname} | {_fmt(cval)} | {_ratio(_get(ours, 'mbps'), cval)} "
            f"| {_fmt(_get(theirs, 'mbps'))} | {_fmt(_get(theirs, 'cpu_s_per_gib'), 2)} "
            f"| {_ratio(_get(ours, 'mbps'), _get(theirs, 'mbps'))} |"
        )
    return lines


def _stream_rows(results: dict[str, Any]) -> list[str]:
    ceil = results.get("ceilings") or {}
    stream = (results.get("tectonic") or {}).get("client_stream") or {}
    # The higher of buffered and O_DIRECT: a buffered figure can be bound by this VM's CPU
    # rather than the disk (bench.ceilings.disk_read_direct).
    disk_w, disk_r = (
        max((v for v in (_get(ceil, name, "mbps") for name in names) if v), default=None)
        for names in (
            ("disk_write_fsync", "disk_write_direct_fsync"),
            ("disk_read_cold", "disk_read_direct"),
        )
    )
    lines = []
    for label, key, cpu_key, cname, cval in (
        (
            "client library write, 1 stream",
            "write_gbps",
            "cpu_s_per_gib_write",
            "disk write (fsync; buffered or O_DIRECT)",
            disk_w,
        ),
        (
            "client library read, 1 stream",
            "read_gbps",
            "cpu_s_per_gib_read",
            "disk read (cold; buffered or O_DIRECT)",
            disk_r,
        ),
    ):
        mbps = _mbps(stream.get(key))
        lines.append(
            f"| {label} | {_fmt(mbps)} | {_fmt(stream.get(cpu_key), 2)} | {cname} | "
            f"{_fmt(cval)} | {_ratio(mbps, cval)} | - | - | - |"
        )
    return lines


def _mount_burst_rows(results: dict[str, Any]) -> list[str]:
    null = results.get("nullfs") or {}
    mb = (results.get("tectonic") or {}).get("mount_burst") or {}
    pl = (results.get("peer") or {}).get("loadtest") or {}
    nd_w, nd_r = _get(null, "dd_write", "mbps"), _get(null, "dd_read", "mbps")
    lines = []
    for label, key, cpu_key, cval in (
        ("loadtest --through-mount write", "write_gbps", "cpu_s_per_gib_write", nd_w),
        ("loadtest --through-mount read", "read_gbps", "cpu_s_per_gib_read", nd_r),
    ):
        ours, theirs = _mbps(mb.get(key)), _mbps(pl.get(key))
        lines.append(
            f"| {label} ({_burst_label(mb) if mb.get('ranks') else '-'}) | {_fmt(ours)} "
            f"| {_fmt(mb.get(cpu_key), 2)} | nullfs dd | {_fmt(cval)} | {_ratio(ours, cval)} "
            f"| {_fmt(theirs)} | {_fmt(pl.get(cpu_key), 2)} | {_ratio(ours, theirs)} |"
        )
    return lines


def _peer_note(results: dict[str, Any]) -> list[str]:
    """The mount burst's GPU pause beside GlusterFS's, and how the peer ran (or why not)."""
    peer = results.get("peer") or {}
    mb = (results.get("tectonic") or {}).get("mount_burst") or {}
    pl = peer.get("loadtest") or {}
    lines = []
    if mb.get("pause_s") is not None or pl.get("pause_s") is not None:
        lines += [
            (
                f"GPU pause of the {mb.get('ranks') or pl.get('ranks')}-rank burst through the "
                "mount: tectonic-py "
                f"{_fmt(mb.get('pause_s'), 2)} s, GlusterFS {_fmt(pl.get('pause_s'), 2)} s."
            ),
            "",
        ]
    if not peer.get("available"):
        reason = peer.get("reason") or peer.get("error") or "skipped"
        lines += [f"**GlusterFS could not run here:** {reason}", ""]
    else:
        lines += [
            (
                f"Peer: {peer.get('version')}, {peer.get('volume')}, {peer.get('bricks')} bricks on "
                "this host under a tmp directory, FUSE mount (`mount -t glusterfs`), set up and torn "
                "down by `bench/gluster.py`."
            ),
            "",
        ]
    return lines


def _onedir(results: dict[str, Any]) -> list[str]:
    """bench_burst's table: the burst into one directory through each mount, side by side."""
    r = results.get("onedir")
    lines = [
        "## The checkpoint burst into one directory, beside GlusterFS, JuiceFS and local disk",
        "",
        (
            "The figure the project is judged by: every rank opens, writes, fsyncs and closes "
            "its shard in ONE step directory through the mount, all at one barrier; the pause "
            "is from the barrier to the last close. Beside it: 1,024 empty creates in one "
            "directory by one process, and `git clone`, `tar -x`, `rm -r` of small files. "
            "JuiceFS keeps one copy of each byte (SQLite metadata, a local directory as its "
            "bucket): a lean design, not a durability peer. Ratios are of times: below 1 ours "
            "is faster."
        ),
        "",
    ]
    if not isinstance(r, dict) or "targets" not in r:
        return lines + _not_run(r, "onedir") + _reproduce("onedir", ONEDIR_COMMAND)
    from bench.bench_burst import notes, table_rows

    try:
        header, rows = table_rows(r)
        extra = notes(r)
    except (KeyError, TypeError) as e:
        return lines + [f"**Unreadable results:** `{e!r}`", ""]
    lines += [
        "| " + " | ".join(header) + " |",
        "|---|" + "---:|" * (len(header) - 1),
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
        *(f"- {line}" for line in extra),
        "",
    ]
    return lines + _reproduce("onedir", ONEDIR_COMMAND)


ONEDIR_COMMAND = "python -m bench.bench_burst --install --ranks 1024 --json burst.json"


def _creates(results: dict[str, Any]) -> list[str]:
    """Creates in one directory: bench_dirops on our mount beside local disk and nullfs,
    bench_burst's empty creates beside the peers, the target met or missed."""
    d = _get(results, "tectonic", "dirops")
    lines = [
        "## Creates in one directory",
        "",
        (
            "One process, N empty files (`open(O_CREAT|O_WRONLY|O_TRUNC)` + `close`) in one "
            "directory through our mount, and the namespace operations around them; beside "
            "the same on local disk (best of 3) and nullfs (a pyfuse3 mount that answers at "
            "once: the floor of a Python FUSE mount). ms per operation."
        ),
        "",
    ]
    if isinstance(d, dict) and "ops" in d:
        lines += [
            (
                f"| op ({_fmt(d.get('files'))} files) | ours ms | local disk ms | ours / local "
                "| nullfs ms | ours / nullfs |"
            ),
            "|---|---:|---:|---:|---:|---:|",
        ]
        for op, o in d["ops"].items():
            lines.append(
                f"| {op} | {_fmt(o.get('mount_ms'), 3)} | {_fmt(o.get('local_ms'), 3)} "
                f"| {_fmt(o.get('ratio'), 1)} | {_fmt(o.get('nullfs_ms'), 3)} "
                f"| {_fmt(o.get('over_nullfs'), 1)} |"
            )
        t = d.get("create_target") or {}
        met = "met" if t.get("met") else "**missed**"
        lines += [
            "",
            (
                f"Target: creates in one directory <= {_fmt(t.get('max_ratio'), 0)}x local disk: "
                f"{_fmt(t.get('ratio'), 1)}x, {met}."
            ),
            "",
        ]
    else:
        lines += _not_run(d, "dirops")
    onedir = results.get("onedir") or {}
    targets = onedir.get("targets") if isinstance(onedir, dict) else None
    if isinstance(targets, dict):
        measured = {
            name: _get(t, "creates", "ms_per_file")
            for name, t in targets.items()
            if isinstance(t, dict) and t.get("available")
        }
        ours = measured.get("ours")
        lines += [
            "bench_burst's 1,024 empty creates in one directory, one process, per target:",
            "",
            "| target | ms per create | ours / target |",
            "|---|---:|---:|",
            *(f"| {name} | {_fmt(ms, 3)} | {_ratio(ours, ms)} |" for name, ms in measured.items()),
            "",
        ]
    lines.append(
        "The bursts' creates per second (every rank creating at once) are in the metadata "
        "section below."
    )
    lines.append("")
    return lines + _reproduce(
        "dirops,onedir", "python -m bench.bench_dirops --files 1024", ONEDIR_COMMAND
    )


def _restore(results: dict[str, Any]) -> list[str]:
    """The restore of a kept burst with m chunk stores killed, beside the healthy one."""
    r = _get(results, "tectonic", "restore")
    lines = ["## Restore with m chunk stores lost", ""]
    if not isinstance(r, dict) or "healthy" not in r:
        return lines + _not_run(r, "restore") + _reproduce("restore", *RESTORE_COMMANDS)
    healthy, degraded = r.get("healthy") or {}, r.get("degraded") or {}
    killed = r.get("killed") or []
    lines += [
        (
            f"A burst of {r.get('ranks')} x {size_label(int(r.get('shard_size') or 0))} kept on "
            f"the cluster ({r.get('ec')} on 9 chunk stores: every block has a chunk on each), "
            "restored through the client library with every byte verified: first with every "
            f"store up, then with {len(killed)} killed ({', '.join(killed)}), so every block "
            "is read from the k chunks left and decoded."
        ),
        "",
        "| restore | read GB/s | seconds | CPU-s/GiB | errors | bytes verified |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, x in (("all stores up", healthy), (f"{len(killed)} stores killed", degraded)):
        lines.append(
            f"| {label} | {_fmt(x.get('read_gbps'), 3)} | {_fmt(x.get('restore_s'), 2)} "
            f"| {_fmt(x.get('cpu_s_per_gib_read'), 2)} | {_fmt(x.get('errors'))} "
            f"| {_fmt(x.get('bytes_verified'))} |"
        )
    lines += [
        "",
        (
            f"Degraded over healthy read GB/s: "
            f"{_ratio(degraded.get('read_gbps'), healthy.get('read_gbps'))}."
        ),
        "",
    ]
    return lines + _reproduce("restore", *RESTORE_COMMANDS)


# the second, once with every store up and once after killing m of them
RESTORE_COMMANDS = (
    "tectonic loadtest CLUSTER --ranks 64 --shard-size 16MiB --dir /restore --keep --no-restore",
    "tectonic loadtest CLUSTER --ranks 64 --dir /restore --verify-only",
)


def _packs(results: dict[str, Any]) -> list[str]:
    """What a small file costs now that files share blocks: chunk puts and CPU per file."""
    tec = results.get("tectonic") or {}
    cluster = tec.get("cluster") or {}
    lines = [
        "## Small files share blocks: chunk puts and CPU per file",
        "",
        (
            "Chunk puts the burst's clients sent per file, beside what a file in a block of its "
            "own would take (computed: k+m chunks per block of k x chunk size); CPU ms per file "
            "is all processes' CPU during the burst less the same bytes written as one stream "
            "in the same run (gross: without the subtraction)."
        ),
        "",
        (
            "| ranks x shard | chunk puts / file | one block per file | ratio "
            "| CPU ms/file net / gross | pause / stream |"
        ),
        "|---|---:|---:|---:|---|---:|",
    ]
    bursts = [b for b in _bursts(results) if b.get("ranks")]
    for b in bursts:
        alone = _unpacked_puts(cluster, int(b.get("shard_size") or 0))
        puts = b.get("chunk_puts_per_file")
        lines.append(
            f"| {_burst_label(b)} | {_fmt(puts, 2)} | {_fmt(alone)} | {_ratio(puts, alone)} "
            f"| {_fmt(b.get('cpu_ms_per_file'), 1)} / {_fmt(b.get('cpu_ms_per_file_gross'), 1)} "
            f"| {_fmt(b.get('pause_over_stream'), 2)} |"
        )
    if not bursts:
        lines.append("| not measured (bursts skipped or failed) ||||||")
    lines.append("")
    return lines + _reproduce(
        "bursts", "tectonic loadtest CLUSTER --ranks 1024 --shard-size 1MiB --baseline-stream"
    )


def _unpacked_puts(cluster: dict[str, Any], shard: int) -> int | None:
    """Chunk puts of a ``shard``-byte file written alone: k+m per block of k chunks."""
    try:
        from tectonic_py.core.ec_policy import ECPolicy

        policy = ECPolicy.parse(str(cluster.get("ec")))
        block = policy.k * int(cluster.get("chunk_size") or 0)
    except (ValueError, TypeError, ImportError):
        return None
    if not block or not shard:
        return None
    return (policy.k + policy.m) * -(-shard // block)


def _inplace(results: dict[str, Any]) -> list[str]:
    """Small in-place writes: the raw bytes one 4 KiB overwrite adds on the stores."""
    r = _get(results, "tectonic", "inplace")
    lines = ["## Small in-place writes", ""]
    if not isinstance(r, dict) or "writes" not in r:
        return lines + _not_run(r, "inplace") + _reproduce("inplace", INPLACE_COMMAND)
    per = r.get("raw_added_per_write")
    lines += [
        (
            f"{r.get('writes')} x (`open(O_RDWR)`, one 4 KiB `pwrite` at a random offset, "
            f"`close`) on a {_mib(r.get('file_bytes'))} file through the mount, as h5py in "
            'append mode or `np.memmap(mode="r+")` do; raw bytes are the chunk files the '
            "writes added on the stores' disks, before any GC."
        ),
        "",
        "| raw bytes per write | x the 4 KiB written | ms per write | CPU-s, all processes |",
        "|---:|---:|---:|---:|",
        (
            f"| {_fmt(per)} | {_ratio(per, 4096)} | {_fmt(r.get('ms_per_write'), 1)} "
            f"| {_fmt(r.get('cpu_s'), 2)} |"
        ),
        "",
    ]
    return lines + _reproduce("inplace", INPLACE_COMMAND)


INPLACE_COMMAND = "python -m bench.bench_inplace --size 48 --writes 20"


def _appends(results: dict[str, Any]) -> list[str]:
    """Small fsync'd appends: one-row SQLite commits through the mount beside local disk."""
    r = _get(results, "tectonic", "appends")
    lines = ["## Small fsync'd appends: SQLite commits", ""]
    if not isinstance(r, dict) or "modes" not in r:
        return lines + _not_run(r, "appends") + _reproduce("appends", APPENDS_COMMAND)
    lines += [
        (
            f"{r.get('commits')} one-row (100-byte) commits, synchronous=FULL, on the mount and "
            "on local disk in the same run; raw bytes are the chunk files the commits added "
            "on the stores' disks, before any GC."
        ),
        "",
        (
            "| journal mode | mount commits/s | local disk commits/s | mount / disk "
            "| raw bytes per commit | CPU ms per commit |"
        ),
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode, m in (r.get("modes") or {}).items():
        lines.append(
            f"| {mode} | {_fmt(m.get('mount_commits_per_s'), 1)} "
            f"| {_fmt(m.get('disk_commits_per_s'), 1)} | {_fmt(m.get('ratio_to_disk'), 3)} "
            f"| {_fmt(m.get('raw_added_per_commit'))} | {_fmt(m.get('cpu_ms_per_commit'), 1)} |"
        )
    lines.append("")
    return lines + _reproduce("appends", APPENDS_COMMAND)


APPENDS_COMMAND = "python -m bench.bench_small_appends --commits 200"


def _metrics(results: dict[str, Any]) -> list[str]:
    """The cost of the metrics, on and off, when bench_metrics is in the checkout."""
    r = _get(results, "others", "bench_metrics")
    lines = ["## Metrics on and off", ""]
    if not isinstance(r, dict):
        lines += ["Not measured in this run (others was skipped).", ""]
    elif r.get("status", "ok") != "ok":
        lines += [f"Not measured: `{str(r.get('error', ''))[:400]}`", ""]
    else:
        lines += ["| figure | value |", "|---|---:|"]
        lines += [
            f"| {k} | {_fmt(v, 3) if isinstance(v, float) else v} |" for k, v in _flatten(r)[:30]
        ]
        lines.append("")
    return lines + _reproduce("others", "python -m bench.bench_metrics --json")


def _save(results: dict[str, Any]) -> list[str]:
    """torch.save / torch.load of 1 GiB beside JuiceFS, GlusterFS and disk, with the CPU of
    every process (issue 36's figures; the byte budget is docs/byte-budget.md)."""
    from bench.bench_save import format_table

    r = _get(results, "others", "bench_save")
    lines = ["## torch.save and torch.load beside JuiceFS, GlusterFS and local disk", ""]
    if not isinstance(r, dict):
        lines += ["Not measured in this run (others was skipped).", ""]
    elif r.get("status", "ok") != "ok" or "tectonic" not in r:
        lines += [f"Not measured: `{str(r.get('error', ''))[:400]}`", ""]
    else:
        lines += [format_table(r), ""]
    return lines + _reproduce("others", "python -m bench.bench_save --repeat 2 --json")


def _sharing(results: dict[str, Any]) -> list[str]:
    """Two jobs of weights 1:3 on one cluster: an optional part, left out when not run."""
    from bench.bench_sharing import report_section

    r = results.get("sharing")
    if not isinstance(r, dict):
        return []
    return report_section(r, _fmt) + _reproduce("sharing", "python -m bench.bench_sharing")


def _targets(results: dict[str, Any]) -> list[str]:
    """The project's targets, each printed as met or missed with its figures."""
    tec = results.get("tectonic") or {}
    peer = results.get("peer") or {}
    ts = _get(tec, "fuse_torch", "torch_save", "mbps")
    tl = _get(tec, "fuse_torch", "torch_load", "mbps")
    gs, gl = _get(peer, "torch_save", "mbps"), _get(peer, "torch_load", "mbps")
    bursts = _bursts(results)
    base = next((b for b in bursts if b.get("ranks") == 64 and b.get("shard_size") == MiB), None)
    big = next((b for b in bursts if b.get("ranks") == 4096 and b.get("shard_size") == MiB), None)
    lines = ["## Targets", "", "| target | measured | met |", "|---|---|---|"]

    def target(name: str, measured: str, ok: bool | None) -> None:
        met = "-" if ok is None else ("yes" if ok else "**no**")
        lines.append(f"| {name} | {measured} | {met} |")

    if base and big:
        r = big.get("write_gbps", 0) / base["write_gbps"] if base.get("write_gbps") else None
        target(
            "burst: write GB/s at 4,096 ranks >= 0.8 x at 64 ranks (same 1 MiB shards)",
            f"{_fmt(big.get('write_gbps'), 3)} / {_fmt(base.get('write_gbps'), 3)} = {_fmt(r, 2)}",
            None if r is None else r >= 0.8,
        )
    else:
        target("burst: 4,096 vs 64 ranks >= 0.8", "not measured", None)
    _per_file_targets(bursts, target)
    total_errors = sum(int(b.get("errors") or 0) for b in bursts)
    target(
        "burst: zero errors, every byte verified",
        f"{total_errors} errors; "
        + ", ".join(
            f"{_burst_label(b)}: {_fmt(b.get('bytes_verified'))} of {_fmt(b.get('bytes_written'))} B"
            for b in bursts
        ),
        total_errors == 0
        and all(b.get("bytes_verified") == b.get("shard_bytes_per_step") for b in bursts)
        if bursts
        else None,
    )
    target(
        "FUSE torch.save >= 2x GlusterFS",
        f"{_fmt(ts)} vs {_fmt(gs)} MB/s = {_ratio(ts, gs)}",
        None if not (ts and gs) else ts >= 2 * gs,
    )
    target(
        "FUSE torch.load >= 2x GlusterFS",
        f"{_fmt(tl)} vs {_fmt(gl)} MB/s = {_ratio(tl, gl)}",
        None if not (tl and gl) else tl >= 2 * gl,
    )
    lines.append("")
    return lines + _reproduce("fuse,bursts,peer")


def _burst_table(results: dict[str, Any]) -> list[str]:
    lines = [
        "## Checkpoint burst: `tectonic loadtest` through the client library",
        "",
        (
            "Every rank saves one shard at the same moment (a barrier), then every rank reads its "
            "shard back and checks it by crc32c. Write GB/s = bytes / GPU pause (burst start to the "
            "last close). CPU-s/GiB includes the workers, the metadata servers and the chunk stores. "
            "CPU ms/file: all processes' CPU during the burst, less the same bytes written as one "
            "stream in the same run (`--baseline-stream`), over the files (gross: without the "
            "subtraction); pause / stream: the GPU pause over that stream's time; batch mean / max: "
            "mutations per metadata shard transaction during the burst, and the largest batch."
        ),
        "",
        (
            "| ranks x shard | procs | write GB/s | read GB/s | GPU pause s | rank done p50/p90/p99/max s "
            "| creates/s | errors | bytes verified | CPU-s/GiB w / r | CPU ms/file net / gross "
            "| pause / stream | batch mean / max | peak RSS worker / daemon |"
        ),
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---|---|---:|---|---|",
    ]
    bursts = _bursts(results)
    for b in bursts:
        if b.get("status") == "failed" and "ranks" not in b:
            lines.append(f"| failed: {b.get('error', '')[:200]} ||||||||||||||")
            continue
        batches = b.get("metadata_batches") or {}
        quantiles = "/".join(
            _fmt(b.get(f"rank_write_{q}_s"), 2) for q in ("p50", "p90", "p99", "max")
        )
        lines.append(
            f"| {_burst_label(b)} | {b.get('processes')} | {_fmt(b.get('write_gbps'), 3)} "
            f"| {_fmt(b.get('read_gbps'), 3)} | {_fmt(b.get('pause_s'), 2)} | {quantiles}"
            f" | {_fmt(_creates_until_last_open(b))} | {b.get('errors')} "
            f"| {_fmt(b.get('bytes_verified'))} | {_fmt(b.get('cpu_s_per_gib_write'), 1)} / "
            f"{_fmt(b.get('cpu_s_per_gib_read'), 1)} | {_fmt(b.get('cpu_ms_per_file'), 1)} / "
            f"{_fmt(b.get('cpu_ms_per_file_gross'), 1)} | {_fmt(b.get('pause_over_stream'), 2)} "
            f"| {_fmt(batches.get('mean_batch'), 1)} / {_fmt(batches.get('largest_batch'))} "
            f"| {_mib(b.get('worker_max_rss'))} / {_mib(b.get('watched_max_rss'))} |"
        )
    lines.append("")
    for b in bursts:
        if b.get("error_samples"):
            lines += [f"Errors of the {_burst_label(b)} burst (first of {b.get('errors')}):", ""]
            lines += [f"- `{str(e)[:300]}`" for e in b["error_samples"][:5]]
            lines.append("")
    return lines + _reproduce(
        "bursts", "tectonic loadtest CLUSTER --ranks 1024 --shard-size 1MiB --baseline-stream"
    )


def _per_file_targets(bursts: list[dict[str, Any]], target: Any) -> None:
    """The small-file targets: the CPU a file costs and the pause beside one stream (1,024 x
    1 MiB), creates into one directory (4,096 ranks), and 16,384 ranks without an error."""

    def find(ranks: int, shard: int | None = None) -> dict[str, Any] | None:
        return next(
            (
                b
                for b in bursts
                if b.get("ranks") == ranks and (shard is None or b.get("shard_size") == shard)
            ),
            None,
        )

    mid = find(1024, MiB)
    ms = (mid or {}).get("cpu_ms_per_file")
    target(
        "burst 1,024 x 1 MiB: CPU per file (all processes, less one stream's) <= 4 ms",
        "not measured" if ms is None else f"{_fmt(ms, 1)} ms",
        None if ms is None else ms <= 4,
    )
    ratio = (mid or {}).get("pause_over_stream")
    stream = (mid or {}).get("baseline_stream") or {}
    target(
        "burst 1,024 x 1 MiB: GPU pause <= 2 x one 1 GiB stream, same run",
        "not measured"
        if ratio is None
        else f"{_fmt(mid.get('pause_s'), 2)} s / {_fmt(stream.get('seconds'), 2)} s = "
        f"{_fmt(ratio, 2)}",
        None if ratio is None else ratio <= 2,
    )
    creates = [_creates_until_last_open(b) for b in bursts if b.get("ranks") == 4096]
    best = max((c for c in creates if isinstance(c, (int, float))), default=None)
    target(
        "burst 4,096 ranks into one directory: creates >= 3,000/s",
        "not measured" if best is None else f"{_fmt(best)} /s",
        None if best is None else best >= 3000,
    )
    huge = find(16384)
    target(
        "burst 16,384 x 64 KiB: 0 errors (pause reported)",
        "not measured (`--big-bursts`)"
        if huge is None
        else f"{huge.get('errors')} errors, pause {_fmt(huge.get('pause_s'), 2)} s",
        None if huge is None else huge.get("errors") == 0,
    )


def _metadata(results: dict[str, Any]) -> list[str]:
    """Creates per second from bench_metadata and from each burst, beside raw SQLite commits."""
    lines = [
        "## Metadata creates per second",
        "",
        "| source | creates/s | ceiling: raw SQLite commits/s (batch 1) | ratio |",
        "|---|---:|---:|---:|",
    ]
    md = _get(results, "others", "bench_metadata") or {}
    raw = next(
        (
            r.get("commits_per_s")
            for r in md.get("raw_sqlite") or []
            if isinstance(r, dict) and r.get("batch") == 1
        ),
        None,
    )
    for run_ in md.get("runs") or []:
        if isinstance(run_, dict):
            for key, where in (("one_dir_per_s", "one directory"), ("spread_per_s", "spread")):
                lines.append(
                    f"| bench_metadata, {run_.get('servers')} server(s), {where} "
                    f"| {_fmt(run_.get(key))} | {_fmt(raw)} | {_ratio(run_.get(key), raw)} |"
                )
    for b in _bursts(results):
        rate = _creates_until_last_open(b)
        lines.append(
            f"| loadtest burst {_burst_label(b)} (all ranks create at once) "
            f"| {_fmt(rate)} | {_fmt(raw)} | {_ratio(rate, raw)} |"
        )
    lines.append("")
    return lines + _reproduce("bursts,others", "python -m bench.bench_metadata --json")


def _ceilings(results: dict[str, Any]) -> list[str]:
    ceil = results.get("ceilings") or {}
    null = results.get("nullfs") or {}
    lines = [
        "## Ceilings measured in this run",
        "",
        "| ceiling | MB/s | CPU-s/GiB |",
        "|---|---:|---:|",
    ]
    for name, r in ceil.items():
        if isinstance(r, dict) and "mbps" in r:
            lines.append(f"| {name} | {_fmt(r['mbps'])} | {_fmt(r.get('cpu_s_per_gib'), 2)} |")
        elif isinstance(r, dict) and "pack_us" in r:
            lines.append(
                f"| msgpack of a 1 MiB payload: pack / unpack µs | {r['pack_us']} / "
                f"{r['unpack_us']} | |"
            )
    for key in ("dd_write", "dd_read"):
        r = null.get(key)
        if isinstance(r, dict):
            lines.append(
                f"| nullfs (pyfuse3 + trio, discards data) {key} | {_fmt(r.get('mbps'))} | "
                f"{_fmt(null.get('cpu_s_per_gib'), 2)} |"
            )
    if ceil.get("status") == "failed" or null.get("status") == "failed":
        lines += ["", f"Ceilings failed: {ceil.get('error') or ''} {null.get('error') or ''}"]
    lines.append("")
    return lines + _reproduce(
        "ceilings,nullfs",
        "python -m bench.ceilings --json",
        "python -m bench.nullfs --measure --json",
    )


def _other_scripts(results: dict[str, Any]) -> list[str]:
    """Each separate bench script's figures, flattened, or why it did not run."""
    lines = ["## The per-component bench scripts", ""]
    for name, r in (results.get("others") or {}).items():
        status = r.get("status", "ok") if isinstance(r, dict) else "?"
        lines += [f"### {name}: {status}", ""]
        if isinstance(r, dict) and r.get("command"):
            lines += [f"Reproduce: `{r['command']}`.", ""]
        if status != "ok":
            lines.append(f"`{str(r.get('error', ''))[:400]}`")
        else:
            flat = _flatten(r)
            lines += ["| figure | value |", "|---|---:|"]
            for k, v in flat[:40]:
                lines.append(f"| {k} | {_fmt(v, 3) if isinstance(v, float) else v} |")
            if len(flat) > 40:
                lines.append(f"| ... {len(flat) - 40} more in results.json | |")
        lines.append("")
    return lines


def _footer(results: dict[str, Any], notes: str) -> list[str]:
    """The parts that failed, the caller's notes, and where the raw figures are."""
    ceil = results.get("ceilings") or {}
    null = results.get("nullfs") or {}
    tec = results.get("tectonic") or {}
    failures = [
        (k, v.get("error"))
        for k, v in (
            ("ceilings", ceil),
            ("nullfs", null),
            ("tectonic", tec),
            ("onedir", results.get("onedir")),
        )
        if isinstance(v, dict) and v.get("status") == "failed"
    ] + [
        (k, v.get("error"))
        for k, v in tec.items()
        if isinstance(v, dict) and v.get("status") == "failed"
    ]
    lines = []
    if failures:
        lines += ["## Parts that failed in this run", ""]
        lines += [f"- {k}: `{str(e)[:500]}`" for k, e in failures]
        lines.append("")
    if notes.strip():
        lines += ["## Notes", "", notes.strip(), ""]
    lines += [
        (
            "Raw figures: `bench/results.json`; per-burst plots and full results (timelines, "
            "per-rank times) go to `bench/results/`, which each run rewrites and git ignores."
        ),
        "",
    ]
    return lines


# --- the plot --------------------------------------------------------------------------------

_FUSE_LABELS = ["dd write", "dd read", "torch.save", "torch.load"]
_FUSE_KEYS = [
    ("fuse_dd", "dd_write"),
    ("fuse_dd", "dd_read"),
    ("fuse_torch", "torch_save"),
    ("fuse_torch", "torch_load"),
]


def write_plot(results: dict[str, Any], path: Path) -> None:
    """Four panels: FUSE MB/s and CPU beside the peer, burst GB/s, and per-rank completion."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    _plot_fuse_mbps(axes[0][0], results)
    _plot_fuse_cpu(axes[0][1], results)
    bursts = [b for b in _bursts(results) if b.get("ranks")]
    _plot_bursts(axes[1][0], bursts)
    _plot_completion(axes[1][1], bursts)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _plot_fuse_mbps(ax: Any, results: dict[str, Any]) -> None:
    tec = results.get("tectonic") or {}
    peer = results.get("peer") or {}
    null = results.get("nullfs") or {}
    ours = [_get(tec, *where, "mbps") for where in _FUSE_KEYS]
    theirs = [_get(peer, where[1], "mbps") for where in _FUSE_KEYS]
    # torch.save / torch.load are compared with the null mount's dd write / read
    ceiling = [_get(null, key, "mbps") for key in ("dd_write", "dd_read", "dd_write", "dd_read")]
    xs = list(range(len(_FUSE_LABELS)))
    for off, vals, name in (
        (-0.27, ours, "tectonic-py (FUSE)"),
        (0.0, theirs, "GlusterFS 4+2"),
        (0.27, ceiling, "nullfs ceiling"),
    ):
        ax.bar([x + off for x in xs], [v or 0 for v in vals], width=0.27, label=name)
    ax.set_xticks(xs, _FUSE_LABELS)
    ax.set_ylabel("MB/s")
    ax.set_title("through a FUSE mount, same machine, same run")
    ax.legend(fontsize="small")


def _plot_fuse_cpu(ax: Any, results: dict[str, Any]) -> None:
    tec = results.get("tectonic") or {}
    peer = results.get("peer") or {}
    ours = [_get(tec, *where, "cpu_s_per_gib") for where in _FUSE_KEYS]
    theirs = [_get(peer, where[1], "cpu_s_per_gib") for where in _FUSE_KEYS]
    xs = list(range(len(_FUSE_LABELS)))
    for off, vals, name in ((-0.2, ours, "tectonic-py"), (0.2, theirs, "GlusterFS 4+2")):
        ax.bar([x + off for x in xs], [v or 0 for v in vals], width=0.4, label=name)
    ax.set_xticks(xs, _FUSE_LABELS)
    ax.set_ylabel("CPU-seconds per GiB (all processes)")
    ax.set_title("CPU cost")
    ax.legend(fontsize="small")


def _plot_bursts(ax: Any, bursts: list[dict[str, Any]]) -> None:
    names = [_burst_label(b) for b in bursts]
    bx = list(range(len(bursts)))
    ax.bar([x - 0.2 for x in bx], [b.get("write_gbps") or 0 for b in bursts], 0.4, label="write")
    ax.bar([x + 0.2 for x in bx], [b.get("read_gbps") or 0 for b in bursts], 0.4, label="read")
    ax.set_xticks(bx, names, fontsize="small")
    ax.set_ylabel("aggregate GB/s")
    ax.set_title("checkpoint burst (client library)")
    ax.legend(fontsize="small")


def _plot_completion(ax: Any, bursts: list[dict[str, Any]]) -> None:
    for b in bursts:
        times = _get(b, "rank_times", "write") or []
        if times:
            ax.plot(times, [(i + 1) / len(times) for i in range(len(times))], label=_burst_label(b))
    ax.set_xlabel("seconds after burst start")
    ax.set_ylabel("fraction of ranks closed")
    ax.set_title("per-rank completion CDF (the GPU pause is where each line reaches 1)")
    ax.legend(fontsize="small")
