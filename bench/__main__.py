"""`make bench` = `python -m bench [options]`: run the sections, print one table, write every
number (with the environment, the load average and the CPU other processes used during each
phase, so noisy runs are visible) to bench/results/bench-<date>-<time>.json.

    .venv/bin/python -m bench                    # full: 16 prompts, 128 new tokens (times: bench/README.md)
    .venv/bin/python -m bench --quick            # smoke run: 4 prompts, 48 new tokens, smaller shapes
    .venv/bin/python -m bench --only length      # one section (and the sections it needs)
    .venv/bin/python -m bench --research         # also the research experiments (format v1, entropy)

It prints figures, it is not a test: a missed target says NO in the `met` column and nothing fails.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback

import torch

from bench import common
from bench.common import ROOT, Rows, environment, finish_run, format_table, loadavg, log, start_run
from bench.sections import ALIASES, DEFAULT, REQUIRES, RESEARCH, Context, load

ALL = DEFAULT + RESEARCH


def section_names(text: str) -> set[str]:
    names = {ALIASES.get(s.strip(), s.strip()) for s in text.split(",") if s.strip()}
    unknown = names - set(ALL)
    if unknown:
        raise SystemExit(f"unknown section(s) {', '.join(sorted(unknown))}; sections: {', '.join(ALL)}")
    return names


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="specreplay benchmark: prints one table and writes every number to "
        "bench/results/bench-<date>-<time>.json",
    )
    parser.add_argument("--quick", action="store_true", help="a smaller run (its time: bench/README.md)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts from the set (default 16; quick 4)")
    parser.add_argument(
        "--score-prompts",
        type=int,
        default=None,
        help="prompts of the fp32, score and fp8 sections (the first of the set; default min(8, --prompts))",
    )
    parser.add_argument("--prompt-set", default="default", help="bundled set name or JSONL path (default: default)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default 128; quick 48")
    parser.add_argument("--batch-size", type=int, default=8, help="extract/bare generate batch size")
    parser.add_argument("--reps", type=int, default=None, help="bare/extract alternations (default 2)")
    parser.add_argument("--block-size", type=int, default=16, help="drafter block size (default 16)")
    parser.add_argument("--fit-steps", type=int, default=None, help="drafter fit steps (default 400; quick 100)")
    parser.add_argument("--fit-anchors", type=int, default=16, help="anchors per fit step")
    parser.add_argument("--fit-lr", type=float, default=3e-3)
    parser.add_argument(
        "--ddtree-budgets",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=None,
        help="DDTree budgets of the chain+DDTree score runs (default: score's default)",
    )
    parser.add_argument(
        "--skip", default="", help=f"comma-separated sections to skip: {','.join(DEFAULT)} (big = memory)"
    )
    parser.add_argument("--only", default="", help="comma-separated sections to run (plus those they need)")
    parser.add_argument(
        "--research",
        action="store_true",
        help=f"also run the research experiments ({', '.join(RESEARCH)}: format v1, entropy bounds)",
    )
    parser.add_argument(
        "--memory-parts",
        type=lambda s: [x for x in s.split(",") if x],
        default=None,
        help="children of the memory section to run, comma-separated: extract, score (needs extract), "
        "forward-before, forward-after (default: all; a bf16 forward at 27B widths takes ~30 min on 2 cores)",
    )
    parser.add_argument("--profile", action="store_true", help="profile the offline score even when targets are met")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"), help="results directory")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (shards, drafter, results)")
    args = parser.parse_args(argv)
    args.prompts = args.prompts or (4 if args.quick else 16)
    args.score_prompts = min(args.score_prompts or 8, args.prompts)
    args.max_new_tokens = args.max_new_tokens or (48 if args.quick else 128)
    args.reps = args.reps or 2
    args.fit_steps = args.fit_steps or (100 if args.quick else 400)
    args.skip = section_names(args.skip)
    args.only = section_names(args.only)
    return args


def plan(args) -> list[str]:
    """Sections to run, in order: --only's (with what they need) or the default ones (plus
    research with --research), less --skip's and whatever needs a skipped one."""
    if args.only:
        wanted, todo = set(), list(args.only)
        while todo:
            name = todo.pop()
            if name not in wanted:
                wanted.add(name)
                todo.extend(REQUIRES.get(name, ()))
    else:
        wanted = set(DEFAULT) | (set(RESEARCH) if args.research else set())
    chosen = []
    for name in ALL:
        if name in wanted and name not in args.skip and all(r in chosen for r in REQUIRES.get(name, ())):
            chosen.append(name)
    return chosen


def main(argv=None) -> int:
    args = parse_args(argv)
    # `timeout` and schedulers stop with SIGTERM: exit through the finally below, so the figures
    # measured so far are written and printed and the work dir is removed.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sections = plan(args)
    common.OTHERS = common.OthersCpu().start()
    out_dir, stamp, work = start_run(args.out)
    results: dict = {
        "args": {k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(args).items()},
        "env": environment(),
        "loadavg_start": loadavg(),
        "sections": sections,
    }
    ctx = Context(args=args, work=work)
    rows = []
    log(
        f"bench: {'quick' if args.quick else 'full'} run, sections {', '.join(sections)}; {args.prompts} prompts, "
        f"{args.max_new_tokens} new tokens, {torch.get_num_threads()} torch threads, load average "
        f"{results['loadavg_start']}, work dir {work}"
    )
    failed = []
    try:
        for name in sections:
            if any(r in failed for r in REQUIRES.get(name, ())):
                log(f"{name}: skipped, it needs {', '.join(REQUIRES[name])}, which failed")
                continue
            try:
                figures, section_rows = load(name).run(ctx)
            except Exception as error:  # a broken section must not hide the others' figures
                failed.append(name)
                log(f"{name}: FAILED:\n{traceback.format_exc()}")
                figures, section_rows = {"error": traceback.format_exc()}, Rows()
                section_rows.add(f"section {name}", f"FAILED: {type(error).__name__}: {error}"[:200], met=False)
            ctx.figures[name] = figures
            rows += section_rows
    finally:
        results["figures"] = ctx.figures
        results["others_cpu_whole_run"] = common.OTHERS.stop()
        path = finish_run(results, out_dir, f"bench-{stamp}", work, args.keep)
        print()
        print(format_table(rows))
    profile = ctx.figures.get("score", {}).get("profile_offline_chain")
    if profile:
        print("\noffline score profile (chain only, 2 samples, torch.profiler, aten ops by own CPU time):")
        print("\n".join(profile))
    print(
        f"\nother processes used {results['others_cpu_whole_run']} cores on average during this run "
        f"({os.cpu_count()} CPUs); load average {results['loadavg_start']} -> {results['loadavg_end']}; "
        f"total {results['wall_s']:.0f} s; written {path}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
