"""The GPU machine as ``benchmarks/gpu_run.py`` uses it: unpack, run commands, serve, collect.

``unpack()`` makes the machine ready once per machine and commit: the SGLang bundle in
/tmp/site, the committed tree of ``.devsrc.tar`` in /tmp/src (or the tree this file came with
when there is none), the project installed into /tmp/site so that SGLang finds its plugin, and
the commit known (the archive's own record of it, else ``REDKNOT_COMMIT``, else git). Commands
then run in that tree with their logs in ``$OUT`` (default ``./out``), servers start and stop
on given ports, and ``collect`` lists what a job wrote with the headline figures of each JSON.
Only the standard library is used: this runs before anything is installed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # the tree this file came with
SITE, SRC, OLD_SRC = Path("/tmp/site"), Path("/tmp/src"), Path("/tmp/src_old")
BUNDLE = ".device/sglang-site.tar.xz"
OUT = Path(os.environ.get("OUT") or "out").resolve()


# ---- unpack -------------------------------------------------------------------------------


def archive_commit(tar: Path) -> str | None:
    """The commit ``git archive COMMIT`` recorded in the archive's global pax header."""
    with tarfile.open(tar) as t:
        commit = t.pax_headers.get("comment", "")
    return commit[:7] if re.fullmatch(r"[0-9a-f]{40}", commit) else None


def tree_commit(tree: Path) -> str:
    """The commit a tree unpacked from an archive records, else ``REDKNOT_COMMIT``, else the
    tree's git, else unknown."""
    record = tree / ".redknot-commit"
    if record.is_file():
        return record.read_text().strip()
    given = os.environ.get("REDKNOT_COMMIT")
    if given and given != "unknown":
        return given
    git = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short=7", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    return git.stdout.strip() if git.returncode == 0 else "unknown"


def unpack_tree(tar: Path, dest: Path) -> Path:
    """A pristine copy of a ``git archive`` in ``dest``, with the commit it came from; kept as
    it is when it was unpacked from the same archive (a second runner on another GPU of the
    machine must not remove the tree the first one's server runs from)."""
    digest = hashlib.sha256(tar.read_bytes()).hexdigest()
    stamp = dest / ".redknot-archive"
    if stamp.is_file() and stamp.read_text().strip() == digest:
        return dest
    subprocess.run(["rm", "-rf", str(dest)], check=True)
    dest.mkdir(parents=True)
    subprocess.run(["tar", "-C", str(dest), "-xf", str(tar)], check=True)
    (dest / ".redknot-commit").write_text((archive_commit(tar) or "unknown") + "\n")
    if (HERE / ".device").exists() and not (dest / ".device").exists():
        (dest / ".device").symlink_to(HERE / ".device")
    stamp.write_text(digest + "\n")
    return dest


def install(tree: Path) -> None:
    """The project of ``tree`` into the site folder (its plugin entry point included)."""
    quiet = ["-q", "--upgrade", "--no-deps", "--no-build-isolation", "--no-index"]
    cmd = [sys.executable, "-m", "pip", "install", *quiet, "--target", str(SITE), str(tree)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=tree)
    (SITE / ".redknot-installed").write_text(f"{tree} {tree_commit(tree)}\n")


def unpack() -> tuple[Path, dict]:
    """The tree to run and the environment of every command run in it."""
    if not (SITE / ".unpacked").exists():
        if not (HERE / BUNDLE).is_file():
            sys.exit(f"gpu_run: no {BUNDLE} here: build it (../shared/device/README.md), carry it")
        SITE.mkdir(parents=True, exist_ok=True)
        subprocess.run(["tar", "-C", str(SITE), "-xJf", str(HERE / BUNDLE)], check=True)
        (SITE / ".unpacked").touch()
    tree = unpack_tree(HERE / ".devsrc.tar", SRC) if (HERE / ".devsrc.tar").is_file() else HERE
    marker = SITE / ".redknot-installed"
    if not marker.is_file() or marker.read_text().split() != [str(tree), tree_commit(tree)]:
        install(tree)
    env = dict(
        os.environ,
        PYTHONPATH=f"{SITE}:{tree}",
        PYTHONUNBUFFERED="1",
        REDKNOT_COMMIT=tree_commit(tree),
        OUT=str(OUT),
    )
    return tree, env


# ---- run and collect ----------------------------------------------------------------------


def run(cmd: list[str], tree: Path, env: dict, log: str, timeout: float | None = None) -> int:
    """One command in ``tree``, its output in ``$OUT/log`` and its tail here."""
    print(f"+ {shlex.join(cmd)}   (log: {log})", flush=True)
    start = time.time()
    with open(OUT / log, "w") as f:
        try:
            rc = subprocess.run(
                cmd,
                cwd=tree,
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                check=False,
            ).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    lines = (OUT / log).read_text(errors="replace").splitlines()
    print("\n".join(line[:300] for line in lines[-25:]))
    print(f"= rc {rc} after {time.time() - start:.0f} s", flush=True)
    return rc


def headline(path: Path) -> str:
    """What a result JSON says, in a line or a few."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return f"    (not JSON: {e})"
    if not isinstance(data, dict):
        return ""
    if isinstance(data.get("variants"), dict):  # benchmarks/ttft.py and its kind
        return "\n".join(
            f"    {name} {key}: ttft {p.get('ttft_s')} s (samples {p.get('ttft_samples_s')})"
            for name, v in data["variants"].items()
            for key, p in (v.get("points") or {}).items()
        )
    if isinstance(data.get("compared"), dict):  # benchmarks/ab_join.py
        return "\n".join(
            f"    {name} {key}: old {c['old_ttft_s']} s, new {c['new_ttft_s']} s"
            for name, points in data["compared"].items()
            for key, c in points.items()
        )
    keys = [k for k in ("device", "commit", "summary") if k in data]
    return "    " + json.dumps({k: data[k] for k in keys})[:800]


def collect(since: float) -> None:
    print(f"\nwritten to {OUT}:")
    for path in sorted(OUT.iterdir()):
        if path.is_file() and path.stat().st_mtime >= since:
            print(f"  {path.name} ({path.stat().st_size} bytes)")
            if path.suffix == ".json":
                print(headline(path))


def script(tree: Path, name: str) -> Path:
    for folder in ("benchmarks", "scripts"):
        if (tree / folder / f"{name}.py").is_file():
            return tree / folder / f"{name}.py"
    sys.exit(f"gpu_run: no benchmarks/{name}.py or scripts/{name}.py")


def plain(name: str) -> str:
    """A file name the device returns (letters, digits, '.', '-', '_')."""
    return re.sub(r"[^A-Za-z0-9.\-]", "_", name)


# ---- servers ------------------------------------------------------------------------------


PINNED = (  # runs argv[2:] under this Python on the cores argv[1] lists (exec: same process)
    "import os, sys; os.sched_setaffinity(0, [int(c) for c in sys.argv[1].split(',')]); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])"
)


def start_server(flags: list[str], port: int, tree: Path, env: dict, log: str, cpus=None):
    """``sglang.launch_server`` with ``flags``; ``cpus``: the CPU cores it and its processes
    (they inherit the affinity) may run on, None: every core."""
    args = ["-m", "sglang.launch_server", *flags, "--port", str(port)]
    cmd = [sys.executable, *args]
    if cpus:
        cmd = [sys.executable, "-c", PINNED, ",".join(map(str, sorted(cpus))), *args]
    print(f"+ {shlex.join(cmd)}   (log: {log})", flush=True)
    with open(OUT / log, "w") as f:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, cwd=tree, env=env, stdout=f, stderr=subprocess.STDOUT)


def wait_healthy(proc, port: int, log: str, timeout: float) -> bool:
    start = time.time()
    while time.time() - start < timeout:
        if proc.poll() is not None:
            print(f"the server on port {port} exited during startup; its log ends:")
            print("\n".join((OUT / log).read_text(errors="replace").splitlines()[-30:]))
            return False
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
            print(f"server on port {port} up after {time.time() - start:.0f} s", flush=True)
            return True
        except OSError:
            time.sleep(1)
    print(f"the server on port {port} did not answer in {timeout:.0f} s")
    return False


def stop_server(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def readme_blocks(text: str, marker: str) -> list[tuple[str, str]]:
    """``(language, code)`` of every fenced block right after a ``marker`` line."""
    pattern = re.escape(marker) + r"\n```(\w+)\n(.*?)\n```"
    return [(m.group(1), m.group(2)) for m in re.finditer(pattern, text, re.DOTALL)]


def serve_command(block: str, model: str) -> list[str]:
    """The README's serving block as argv, its model path replaced by ``model``."""
    lines = [line for line in block.splitlines() if not line.lstrip().startswith("#")]
    argv = shlex.split(" ".join(line.rstrip("\\ ") for line in lines))
    if argv[:3] != ["python", "-m", "sglang.launch_server"] or "--model-path" not in argv:
        sys.exit(f"gpu_run: the README's serving example is not a launch_server command: {argv}")
    argv[argv.index("--model-path") + 1] = model
    return argv[3:]
