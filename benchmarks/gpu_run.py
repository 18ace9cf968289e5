"""One runner for every GPU job of redknot: unpack, start servers, run, collect.

Run it on the GPU machine from the carried working tree (``.device/``, and ``.devsrc.tar`` made
here by ``git archive HEAD -- . ':!benchmarks/results' | gzip > .devsrc.tar`` to measure
exactly a commit's code); docs/benchmarks.md
has the whole procedure and the command of every result::

    python3 benchmarks/gpu_run.py check                      # GPU tests + engine equivalence
    python3 benchmarks/gpu_run.py tests -k "restore or promoted"
    python3 benchmarks/gpu_run.py bench ttft --points 32768x8 --variants flashinfer,cacheblend
    python3 benchmarks/gpu_run.py bench --timeline ttft --points 32768x8 --variants cacheblend
    python3 benchmarks/gpu_run.py ab --old .devsrc_old.tar bench ttft --points 32768x8 --reps 4
    python3 benchmarks/gpu_run.py serve --model /tmp/smol-hf  # the README's first example
    python3 benchmarks/gpu_run.py fidelity --specs "cacheblend:cacheblend;epic64:epic:--redknot-epic-k 64"
    python3 benchmarks/gpu_run.py replay --policies cacheblend,epic --rates 1,2

Every job first makes sure of the machine (``benchmarks/gpu_machine.py``: the SGLang bundle, the
committed tree, the project installed, the commit known), then runs its commands there with
their logs in ``$OUT`` (default ``./out``; the device machine's folder comes back), and ends by
listing what it wrote, with the headline figures of each JSON. Standard library only.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_machine as gm

README_SERVE, README_API = "<!-- example:serve -->", "<!-- example:api -->"
DEFAULT_SPECS = "redknot:redknot"
SMOLLM2_MAP = "configs/heads/smollm2-135m-instruct.json"


GPU_TESTS = "-m gpu -q -p no:cacheprovider"
E2E_VARIANTS = (
    "--variants flashinfer,redknot,redknot-triton,cacheblend --head-map synthetic:0.125 "
    "--disable-prefill-cuda-graph"
)


def py(*parts) -> list[str]:
    """A command of this Python."""
    return [sys.executable, *map(str, parts)]


# ---- jobs ---------------------------------------------------------------------------------


def tests_command(tree: Path, paths: list[str], k: str | None) -> list[str]:
    """pytest over ``paths`` (default every test) for the GPU-marked tests. The carried
    archive leaves ``benchmarks/results`` out, and ``tests/docs`` (no GPU test) reads it while
    collecting: it is then left out too."""
    cmd = py("-m", "pytest", *(paths or ["tests"]), *shlex.split(GPU_TESTS))
    if not (tree / "benchmarks/results").is_dir():
        cmd.append("--ignore=tests/docs")
    return cmd + (["-k", k] if k else [])


def job_tests(a, tree, env) -> int:
    cmd = tests_command(tree, a.paths, a.k)
    return gm.run(cmd, tree, env, "gpu_tests.log", a.timeout)


def job_check(a, tree, env) -> int:
    """The GPU-marked tests, engine greedy equivalence and the prefill CUDA graph check (over
    600 s together on one machine: ``--parts`` splits them over calls)."""
    rc = 0
    if "tests" in a.parts:
        rc |= job_tests(argparse.Namespace(paths=None, k=None, timeout=None), tree, env)
    for part, name, extra in (("e2e", "e2e_equivalence", E2E_VARIANTS),
                              ("graph", "prefill_graph_check", "")):  # fmt: skip
        if part in a.parts:
            cmd = py(gm.script(tree, name), *extra.split(), "--out", gm.OUT / f"{name}.json")
            rc |= gm.run(cmd, tree, env, f"{name}.log")
    return rc


def bench_once(a, tree, env, suffix: str = "", runner_tree: Path | None = None) -> int:
    """``a.name`` with ``a.args`` (``--out`` into $OUT unless given), run in ``tree`` with the
    script of ``runner_tree`` (default ``tree``); profiles it wrote are summarised."""
    tools = runner_tree or tree
    path = gm.script(tools, a.name)
    args = list(a.args)
    if "--out" not in args and "--out" in path.read_text():
        args += ["--out", str(gm.OUT / f"{a.name}{suffix}.json")]
    env = dict(env)
    if a.timeline:  # scripts/diag_site's layer timeline in every process of the run
        timeline = gm.OUT / f"timeline{suffix}.jsonl"
        timeline.unlink(missing_ok=True)
        env.update(
            REDKNOT_LAYER_TIMELINE=str(timeline),
            REDKNOT_TIMELINE_MIN_ROWS="30000",
            PYTHONPATH=f"{tools}/scripts/diag_site:{env['PYTHONPATH']}",
        )
    rc = gm.run(py(path, *args), tree, env, f"{a.name}{suffix}.log", a.timeout)
    if a.timeline:
        summarise = tools / "scripts/diag_site/layer_timeline_summary.py"
        summary = py(summarise, timeline, "--out", gm.OUT / f"layer_timeline{suffix}.json")
        rc |= gm.run(summary, tree, env, f"layer_timeline{suffix}.log")
    if "--profile-dir" in args:  # one summary of every trace (the device returns 8 files)
        traces = sorted(Path(args[args.index("--profile-dir") + 1]).glob("*/*.trace.json.gz"))
        if traces:
            out = gm.OUT / f"profile_{a.name}{suffix}.json"
            cmd = py(tools / "benchmarks/profile_summary.py", *traces, "--top", "25", "--out", out)
            rc |= gm.run(cmd, tree, env, f"profile_summary{suffix}.log")
    return rc


def job_bench(a, tree, env) -> int:
    return bench_once(a, tree, env)


# FlashInfer compiles its kernels on a machine's first engine (about 90 s seen at the 8B shape);
# the first half of an A/B on a fresh machine gets this much more time, so that its time limit
# measures the bench and not the compilation (two such halves ran out of it)
COLD_COMPILE_S = 180


def flashinfer_cold() -> bool:
    """Whether no FlashInfer kernel has been compiled on this machine yet (its JIT cache,
    ``$FLASHINFER_WORKSPACE_BASE`` or the home folder, ``.cache/flashinfer``, holds none)."""
    base = Path(os.environ.get("FLASHINFER_WORKSPACE_BASE") or Path.home()) / ".cache/flashinfer"
    return not (base.is_dir() and any(base.rglob("*.so")))


def job_ab(a, tree, env) -> int:
    """The bench at the head, then at ``--old`` (its package, the head's script), joined."""
    if a.inner.job != "bench":
        sys.exit("gpu_run ab: the job to compare is a bench job")
    old = gm.unpack_tree(Path(a.old).resolve(), gm.OLD_SRC)
    old_env = dict(env, PYTHONPATH=f"{gm.SITE}:{old}", REDKNOT_COMMIT=gm.tree_commit(old))
    sides = [("_head", tree, env), ("_old", old, old_env)]
    rc = 0
    first = argparse.Namespace(**vars(a.inner))
    if first.timeout and flashinfer_cold():  # the first half compiles FlashInfer's kernels
        first.timeout += COLD_COMPILE_S
        print(f"a fresh machine: the first half gets {COLD_COMPILE_S} s more for FlashInfer's "
              "kernels to compile")  # fmt: skip
    for i, (suffix, side, side_env) in enumerate(sides[::-1] if a.old_first else sides):
        gm.install(side)
        rc |= bench_once(a.inner if i else first, side, side_env, suffix, runner_tree=tree)
    gm.install(tree)
    head, before = (gm.OUT / f"{a.inner.name}{s}.json" for s in ("_head", "_old"))
    if head.is_file() and before.is_file() and '"variants"' in head.read_text():
        join = py(tree / "benchmarks/ab_join.py", "--old", before, "--new", head, "--note", a.note)
        join += ["--out", str(gm.OUT / "ab.json")]
        rc |= gm.run(join, tree, env, "ab_join.log")
    return rc


def job_serve(a, tree, env) -> int:
    """The README's first serving example (model replaced), then its request examples."""
    text = (tree / "README.md").read_text()
    blocks = gm.readme_blocks(text, README_SERVE)
    if not blocks:
        sys.exit(f"gpu_run serve: README.md has no {README_SERVE} block")
    flags = gm.serve_command(blocks[0][1], a.model) + shlex.split(a.extra)
    proc = gm.start_server(flags, 30000, tree, env, "serve.log")
    rc = 1
    try:
        if gm.wait_healthy(proc, 30000, "serve.log", a.startup_s):
            rc = 0
            with open(gm.OUT / "serve_examples.txt", "w") as f:
                for i, (lang, code) in enumerate(gm.readme_blocks(text, README_API)):
                    cmd = ["bash", "-c", code] if lang == "bash" else py("-c", code)
                    f.write(f"=== example {i} ({lang})\n{code}\n--- output\n")
                    f.flush()
                    done = subprocess.run(
                        cmd,
                        cwd=tree,
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=300,
                        check=False,
                    )
                    f.write(done.stdout + done.stderr + f"--- rc {done.returncode}\n")
                    rc |= done.returncode
            print((gm.OUT / "serve_examples.txt").read_text()[-6000:])
    finally:
        gm.stop_server(proc)
    log = (gm.OUT / "serve.log").read_text(errors="replace").splitlines()
    print("\n".join(line[:300] for line in log if "redknot" in line.lower())[-4000:])
    return rc


# the servers of a fidelity run: small, one after the other (each sizes its KV cache from the
# memory free when it starts)
FIDELITY_SERVER = (
    "--context-length 8192 --mem-fraction-static 0.3 --disable-prefill-cuda-graph "
    "--cuda-graph-max-bs-decode 4 --random-seed 0"
)
EVAL_SERVER = (
    "-m redknot.eval fidelity --backend server --cases benchmarks/cases/rag_v1.jsonl "
    "--server http://127.0.0.1:30000 --reference-server http://127.0.0.1:30001"
)


def fidelity_flags(policy: str, flags: str, head_map: str) -> list[str]:
    """The recovery flags of a fidelity run's server of ``policy`` (``flags``: the spec's own).
    A fidelity run measures the policy's answers on every case: the reuse gate and samkv's size
    floor would compute SmolLM2's short prompts in full (and the evaluation then sees no hit),
    so both are off unless the spec sets them."""
    out = ["--redknot-policy", policy, "--redknot-segment-fraction", "0.3"]
    if policy == "redknot":  # measured knowingly: a map below its floor is served
        out += ["--redknot-head-map", head_map, "--redknot-accept-lossy-map"]
    if "--redknot-reuse-gate" not in flags:
        out += ["--redknot-reuse-gate", "always"]
    if policy == "samkv" and "--redknot-samkv-min-tokens" not in flags:
        out += ["--redknot-samkv-min-tokens", "0"]
    return out


def job_fidelity(a, tree, env) -> int:
    """Redknot servers, one per spec and one after the other, each scored against one dense
    server of the same model by ``python -m redknot.eval fidelity --backend server``."""
    started = time.time()
    common = ["--model-path", a.model, *shlex.split(FIDELITY_SERVER)]
    dense_flags = common + ["--attention-backend", "flashinfer"]
    dense = gm.start_server(dense_flags, 30001, tree, env, "server_dense.log")
    rc = 0
    try:
        if not gm.wait_healthy(dense, 30001, "server_dense.log", a.startup_s):
            return 1
        for spec in a.specs.split(";"):
            name, policy, flags = (spec.split(":", 2) + [""])[:3]
            if a.deadline_s and time.time() - started >= a.deadline_s:
                print(f"deadline: {name} not started")
                rc = 1
                continue
            recovery = fidelity_flags(policy, flags, a.head_map)
            if policy == "default":  # what the server serves unasked (docs/calibration.md)
                rc |= served_default_check(a, name, flags, common, tree, env)
                continue
            flags = common + ["--attention-backend", "redknot", *recovery, *shlex.split(flags)]
            server = gm.start_server(flags, 30000, tree, env, f"server_{name}.log")
            try:
                if not gm.wait_healthy(server, 30000, f"server_{name}.log", a.startup_s):
                    rc = 1
                    continue
                out = str(gm.OUT / f"fidelity_server_{name}.json")
                cmd = py(*shlex.split(EVAL_SERVER), "--policies", f"full,{policy}")
                cmd += ["--out", out, *shlex.split(a.eval_args)]
                rc |= gm.run(cmd, tree, env, f"fidelity_{name}.log")
            finally:
                gm.stop_server(server)
    finally:
        gm.stop_server(dense)
    return rc


def served_default_check(a, name: str, flags: str, common: list, tree, env) -> int:
    """Spec policy ``default``: a redknot server started with no recovery flag serves its
    calibrated default; its generations (scored as ``full``, no segments) against the dense
    server's, case by case (``fidelity_agreement.py``), plus the server's served-default lines."""
    flags = common + ["--attention-backend", "redknot", *shlex.split(flags)]
    server = gm.start_server(flags, 30000, tree, env, f"server_{name}.log")
    rc = 0
    try:
        if not gm.wait_healthy(server, 30000, f"server_{name}.log", a.startup_s):
            return 1
        runs = {}
        for side, port in (("dense", 30001), (name, 30000)):
            runs[side] = str(gm.OUT / f"fidelity_server_{side}_full.json")
            cmd = py(*shlex.split(EVAL_SERVER.replace(":30001", f":{port}")), "--policies", "full")
            cmd += ["--out", runs[side], *shlex.split(a.eval_args)]
            rc |= gm.run(cmd, tree, env, f"fidelity_{side}_full.log")
        out = str(gm.OUT / f"agreement_{name}.json")
        cmd = py("benchmarks/fidelity_agreement.py", runs[name], runs["dense"], "--pair",
                 "full=full", "--out", out)  # fmt: skip
        rc |= gm.run(cmd, tree, env, f"agreement_{name}.log")
    finally:
        gm.stop_server(server)
    return rc


# the servers of a replay: the 8B shape with dummy weights, token ids only, one server at a time
# (each sizes its KV cache and segment region from the memory free when it starts)
REPLAY_SERVER = (
    "--load-format dummy --skip-tokenizer-init --grammar-backend none --sampling-backend pytorch "
    "--context-length 40960 --mem-fraction-static 0.85 --disable-prefill-cuda-graph "
    "--cuda-graph-max-bs-decode 8 --random-seed 0"
)


def job_replay(a, tree, env) -> int:
    """``benchmarks/trace_replay.py`` against a flashinfer server (the baseline, no markup),
    then against a redknot server per policy (automatic chunks on; marked and unmarked
    passes), one server after the other on this GPU, into one ``$OUT/trace_replay.json``."""
    out = str(gm.OUT / "trace_replay.json")
    replay = ["--workloads", a.workloads, "--requests", str(a.requests), "--rates", a.rates]
    replay += ["--open-workloads", "rag"]
    replay += ["--out", out, "--merge", *shlex.split(a.replay_args)]
    common = ["--model-path", a.model, *shlex.split(REPLAY_SERVER)]
    common += ["--enable-metrics"] if a.phases else []
    systems = [("flashinfer", ["--attention-backend", "flashinfer"], ["--modes", "plain"])]
    for policy in a.policies.split(","):
        flags = ["--attention-backend", "redknot", "--redknot-policy", policy]
        flags += ["--redknot-auto-segments", "cdc", *shlex.split(a.redknot_flags)]
        modes = ["--modes", a.modes, "--capture-requests", str(a.capture_requests)]
        systems.append((f"redknot-{policy}", flags, modes))
    rc = 0
    cores = sorted(os.sched_getaffinity(0))
    half = len(cores) // 2
    lower, upper = cores[:half], cores[half:]
    if a.swap_cores:
        lower, upper = upper, lower
    profiles = Path("/tmp/replay_profiles")
    if a.profile_at is not None:
        subprocess.run(["rm", "-rf", str(profiles)], check=True)
        replay += ["--profile-dir", str(profiles), "--profile-at", str(a.profile_at)]
        replay += ["--profile-requests", str(a.profile_requests)]
    pinned: dict = {"cpus": None}
    base = None
    if a.paired is not None:  # the baseline, up beside every redknot server
        fractions = a.paired.split(",")
        flags = common + ["--mem-fraction-static", fractions[0], *systems[0][1]]
        common += ["--mem-fraction-static", fractions[-1]]
        base = gm.start_server(flags, a.port + 1, tree, env, "server_paired.log", upper)
        if not gm.wait_healthy(base, a.port + 1, "server_paired.log", a.startup_s):
            gm.stop_server(base)
            return 1
        replay += ["--paired-url", f"http://127.0.0.1:{a.port + 1}"]
        pinned["cpus"] = lower
        # a second flashinfer server where a redknot one would be: the A/A control of the
        # pairing itself (start order, memory fraction, cores), run only when named
        systems = [("flashinfer-aa", *systems[0][1:])] + systems[1:]
        if a.systems == "all":
            systems = systems[1:]
    try:
        for name, flags, modes in systems:
            if a.systems != "all" and name not in a.systems.split(","):
                continue
            log = f"server_{name}.log"
            server = gm.start_server(common + flags, a.port, tree, env, log, **pinned)
            try:
                if not gm.wait_healthy(server, a.port, log, a.startup_s):
                    rc = 1
                    continue
                cmd = py("benchmarks/trace_replay.py", "--url", f"http://127.0.0.1:{a.port}")
                cmd += ["--system", name, *modes, *replay]
                rc |= gm.run(cmd, tree, env, f"replay_{name}.log")
            finally:
                gm.stop_server(server)
    finally:
        if base is not None:
            gm.stop_server(base)
    for trace in sorted(profiles.glob("*/*.trace.json.gz")) if a.profile_at is not None else []:
        out = gm.OUT / f"profile_replay_{gm.plain(trace.parent.name)}_{gm.plain(trace.name)}.json"
        cmd = py("benchmarks/profile_summary.py", trace, "--top", "25", "--out", out)
        rc |= gm.run(cmd, tree, env, "profile_summary_replay.log")
    return rc


def job_unpack(a, tree, env) -> int:
    if a.shell:  # for scripts/device_prelude.sh: the environment, then the tree
        keys = ("PYTHONPATH", "PYTHONUNBUFFERED", "REDKNOT_COMMIT")
        print("; ".join(f"export {k}={shlex.quote(env[k])}" for k in keys) + f"; cd {tree}")
    else:
        print(f"tree {tree}, commit {env['REDKNOT_COMMIT']}, site {gm.SITE}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python3 benchmarks/gpu_run.py",
        description=__doc__.split("\n\n")[0],
        epilog="examples:\n" + __doc__.split("::\n\n")[1].split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="job", required=True)
    p = sub.add_parser("unpack", help="only make sure of the machine (every job does it first)")
    p.add_argument("--shell", action="store_true", help="print the shell lines to source")
    p.set_defaults(run=job_unpack)
    p = sub.add_parser("tests", help="the GPU-marked tests (pytest -m gpu)")
    p.add_argument("paths", nargs="*", help="test files or folders (default: tests)")
    p.add_argument("-k", default=None, help="pytest -k expression")
    p.add_argument("--timeout", type=float, default=None, help="seconds before it is stopped")
    p.set_defaults(run=job_tests)
    p = sub.add_parser("check", help="every GPU test, engine equivalence, prefill CUDA graph")
    p.add_argument("--parts", default="tests,e2e,graph", help="which of tests,e2e,graph")
    p.set_defaults(run=job_check)
    for name, fn, text in (
        ("bench", job_bench, "a benchmark or GPU check script with its args"),
        ("ab", job_ab, "a bench job at the head and at an older commit"),
    ):
        p = sub.add_parser(name, help=text)
        if name == "ab":
            p.add_argument("--old", required=True, help="git archive of the older commit")
            p.add_argument("--old-first", action="store_true", help="run the older one first")
            p.add_argument("--note", default="", help="what changed (kept in ab.json)")
            p.add_argument("inner", nargs=argparse.REMAINDER, help="bench NAME ARGS ...")
        else:
            add_bench_args(p)
        p.set_defaults(run=fn)
    p = sub.add_parser("serve", help="the README's first serving example and request examples")
    p.add_argument("--model", default="/tmp/smol-hf", help="replaces the example's model path")
    p.add_argument(
        "--extra",
        default="--disable-prefill-cuda-graph --cuda-graph-max-bs-decode 8",
        help="server flags added to the example's (quicker startup)",
    )
    p.add_argument("--startup-s", type=float, default=420)
    p.set_defaults(run=job_serve)
    p = sub.add_parser("fidelity", help="servers' fidelity with real weights against dense")
    p.add_argument("--specs", default=DEFAULT_SPECS, help="'name:policy[:server flags];...'")
    p.add_argument("--model", default="/tmp/smol-hf", help="a Hugging Face checkpoint")
    p.add_argument("--head-map", default=SMOLLM2_MAP, help="the map of policy redknot")
    p.add_argument("--eval-args", default="--limit 24", help="more redknot.eval fidelity flags")
    p.add_argument("--deadline-s", type=float, default=None, help="no spec starts after this")
    p.add_argument("--startup-s", type=float, default=600)
    p.set_defaults(run=job_fidelity)
    p = sub.add_parser("replay", help="trace_replay.py: flashinfer, then redknot servers")
    p.add_argument("--model", default=".device/models/llama-3.1-8b", help="dummy weights")
    p.add_argument("--systems", default="all", help="all, or names: flashinfer,redknot-POLICY")
    p.add_argument("--policies", default="cacheblend", help="one redknot server per policy")
    p.add_argument("--redknot-flags", default="--redknot-segment-fraction 0.5")
    p.add_argument("--workloads", default="rag,chat")
    p.add_argument("--modes", default="auto,marked", help="the redknot servers' passes")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--rates", default="2,4", help="open-loop arrival rates (req/s), RAG only")
    p.add_argument("--capture-requests", type=int, default=16)
    p.add_argument("--replay-args", default="", help="more trace_replay.py flags")
    p.add_argument("--startup-s", type=float, default=420)
    p.add_argument("--port", type=int, default=30000, help="another for a second GPU's runner")
    p.add_argument("--paired", default=None, metavar="BASE,SERVER",
                   help="a flashinfer server up beside each redknot server on the next port, on "
                   "half the CPU cores, sent every closed-loop request too (trace_replay.py "
                   "--paired-url); their --mem-fraction-static values: SGLang sizes a server's "
                   "KV from the memory free when it starts, so the redknot server, started "
                   "second, needs a larger one for the same KV (0.45,0.92 on an H200); --systems "
                   "flashinfer-aa adds a second flashinfer server in a redknot server's place "
                   "(the pairing's own A/A control)")  # fmt: skip
    p.add_argument("--profile-at", type=int, default=None, metavar="K",
                   help="closed-loop requests K .. K + --profile-requests - 1 of each pass under "
                   "SGLang's torch profiler on every server, each trace summarised "
                   "(profile_summary.py: $OUT/profile_replay_SERVER-MODE.json)")  # fmt: skip
    p.add_argument("--profile-requests", type=int, default=4)
    p.add_argument("--swap-cores", action="store_true",
                   help="with --paired: the redknot server on the upper half of the cores, "
                   "flashinfer on the lower")  # fmt: skip
    p.add_argument("--phases", action="store_true",
                   help="every server with --enable-metrics: the rows' per-phase times of each "
                   "request from SGLang's timestamps (trace_replay.py phases_ms)")  # fmt: skip
    p.set_defaults(run=job_replay)
    return ap


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--timeline",
        action="store_true",
        help="record scripts/diag_site's layer timeline and summarise it",
    )
    p.add_argument("--timeout", type=float, default=None, help="seconds before it is stopped")
    p.add_argument("name", help="benchmarks/NAME.py or scripts/NAME.py")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    a = build_parser().parse_args(argv)
    if a.job == "ab":
        inner = argparse.ArgumentParser(prog="gpu_run.py ab ... bench")
        add_bench_args(inner)
        if not a.inner or a.inner[0] != "bench":
            sys.exit("gpu_run ab: give the job to compare: ab --old TAR bench NAME ARGS ...")
        a.inner = inner.parse_args(a.inner[1:])
        a.inner.job = "bench"
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    gm.OUT.mkdir(parents=True, exist_ok=True)
    since = time.time()
    tree, env = gm.unpack()
    rc = a.run(a, tree, env)
    if a.job != "unpack":
        gm.collect(since)
    return rc


if __name__ == "__main__":
    sys.exit(main())
