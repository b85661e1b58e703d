"""Hypothesis: random namespace operations against the service and an in-memory model give the
same answers (success or the same error) and the same observable tree."""

from __future__ import annotations

import secrets
import tempfile
from pathlib import Path

import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from metadata_fixtures import open_meta_cluster

from tectonic_py.core.errors import TectonicError
from tectonic_py.core.ids import ROOT_ID

NAMES = ["a", "b", "c", "d"]
OPS = ["mkdir", "mkdir", "create", "create", "unlink", "rmdir", "rename", "rename", "rename"]

Path_ = tuple[str, ...]


class Model:
    """The namespace as a dict path -> kind; the root is ()."""

    def __init__(self) -> None:
        self.kinds: dict[Path_, str] = {(): "dir"}

    def dirs(self) -> list[Path_]:
        return sorted(p for p, k in self.kinds.items() if k == "dir")

    def children(self, p: Path_) -> list[Path_]:
        return [q for q in self.kinds if len(q) == len(p) + 1 and q[: len(p)] == p]

    def apply(self, op: str, a: Path_, b: Path_ | None) -> str | None:
        """The expected error code, or None after applying the change."""
        if op in ("mkdir", "create"):
            if a in self.kinds:
                return "eexist"
            self.kinds[a] = "dir" if op == "mkdir" else "file"
            return None
        if op == "unlink":
            if a not in self.kinds:
                return "enoent"
            if self.kinds[a] == "dir":
                return "eisdir"
            del self.kinds[a]
            return None
        if op == "rmdir":
            if a not in self.kinds:
                return "enoent"
            if self.kinds[a] != "dir":
                return "enotdir"
            if self.children(a):
                return "enotempty"
            del self.kinds[a]
            return None
        assert op == "rename" and b is not None
        if a not in self.kinds:
            return "enoent"
        src_kind = self.kinds[a]
        if a[:-1] != b[:-1] and src_kind == "dir" and b[: len(a)] == a:
            return "invalid"
        if a == b:
            return None
        if b in self.kinds:
            if self.kinds[b] == "dir" and src_kind != "dir":
                return "eisdir"
            if self.kinds[b] != "dir" and src_kind == "dir":
                return "enotdir"
            if self.kinds[b] == "dir" and self.children(b):
                return "enotempty"
            del self.kinds[b]
        moved = {p: k for p, k in self.kinds.items() if p[: len(a)] == a}
        for p in moved:
            del self.kinds[p]
        for p, k in moved.items():
            self.kinds[b + p[len(a) :]] = k
        return None


async def observe(client, dir_id: int, prefix: Path_, out: dict[Path_, str]) -> None:
    after = ""
    for _ in range(100):
        page, cursor = await client.readdir(dir_id, after=after, limit=3)
        for e in page:
            out[prefix + (e.name,)] = e.kind
            if e.kind == "dir":
                await observe(client, e.id, prefix + (e.name,), out)
        if cursor is None:
            return
        after = cursor


async def resolve_id(client, path: Path_) -> int:
    attrs = await client.resolve("/" + "/".join(path))
    return attrs.id


async def run_example(data: st.DataObject, root: Path) -> None:
    secret_file = root / "secret"
    secret_file.write_bytes(secrets.token_hex(32).encode())
    secret_file.chmod(0o600)
    async with open_meta_cluster(root, secret_file, servers=2, shards=4) as mc:
        c = mc.client
        model = Model()
        for step in range(data.draw(st.integers(1, 25), label="steps")):
            op = data.draw(st.sampled_from(OPS), label=f"op{step}")
            parent = data.draw(st.sampled_from(model.dirs()))
            a = parent + (data.draw(st.sampled_from(NAMES)),)
            b = None
            if op == "rename":
                b = data.draw(st.sampled_from(model.dirs())) + (data.draw(st.sampled_from(NAMES)),)
            expected = model.apply(op, a, b)
            got = None
            try:
                pid = await resolve_id(c, a[:-1])
                if op == "mkdir":
                    await c.mkdir(pid, a[-1])
                elif op == "create":
                    f, token = await c.create(pid, a[-1])
                    await c.seal(f.id, token, 0)
                elif op == "unlink":
                    await c.unlink(pid, a[-1])
                elif op == "rmdir":
                    await c.rmdir(pid, a[-1])
                else:
                    assert b is not None
                    await c.rename(pid, a[-1], await resolve_id(c, b[:-1]), b[-1])
            except TectonicError as e:
                got = e.code
            assert got == expected, f"step {step}: {op} {a} {b}: service {got}, model {expected}"
            tree: dict[Path_, str] = {}
            await observe(c, ROOT_ID, (), tree)
            assert tree == {p: k for p, k in model.kinds.items() if p}


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(data=st.data())
def test_namespace_matches_model(data):
    with tempfile.TemporaryDirectory() as tmp:
        trio.run(run_example, data, Path(tmp))
