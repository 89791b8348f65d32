"""``python -m gpuscope.loadtest.compare``: Locust against several server configurations, side by side.

The configurations are gpuscope serve's (the sets of :mod:`gpuscope.loadtest.configs`,
started here) and endpoints it does not start (``--target NAME=URL[#MODEL]``:
vLLM or any server with OpenAI-style ``/v1/models`` and streaming
``/v1/completions``), together or alone. For every repetition, and within it
every configuration (interleaved, so slow drift of the machine spreads over all
configurations instead of biasing the last one), it starts ``gpuscope serve`` on
a free local port (a target is used as it runs), runs Locust headless with the
same users, lengths and duration, stops the server, and keeps gpuscope's exact
figures of the window after warm-up. Repetition r sends the requests of seed
``--load.seed`` + r − 1: every configuration of a repetition gets the same
requests, and a target, which keeps its prefix cache from one run to the next,
is not sent the previous repetition's prompts again. It writes:

* ``compare-NAME.md`` — tables of medians with [min–max] over repetitions, with plots;
* ``compare-NAME.csv`` — one row per run and tenant scope, in base units;
* ``compare-NAME-SET.png`` — one figure per configuration set;
* per run, under ``--output.runs-dir``: Locust's HTML report, both processes'
  logs, and with ``--output.keep-samples`` the exact per-request samples.

A line per run shows progress, with a countdown while Locust runs.
"""

from __future__ import annotations

import datetime as dt
import os
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

from gpuscope.loadtest import configs as config_sets
from gpuscope.loadtest.configs import Config
from gpuscope.loadtest.distributions import parse_distribution
from gpuscope.loadtest.options import APIS, DEFAULT_OUTPUT_TOKENS, DEFAULT_PROMPT_TOKENS, DEFAULT_SEED
from gpuscope.loadtest.plots import plot_set
from gpuscope.loadtest.recorder import load_samples
from gpuscope.loadtest.report import ALL, RunResult, markdown, write_csv
from gpuscope.loadtest.runtools import (
    LOCUSTFILE,
    describe_machine,
    duration_arg,
    locust_available,
    locust_ignored_ctrl_c,
    locust_prefix,
)
from gpuscope.loadtest.serverproc import ServerError, ServerProcess
from gpuscope.loadtest.stats import summarise, tenants_of
from gpuscope.loadtest.targets import (
    API_KEY_ENV,
    Target,
    TargetError,
    list_models,
    parse_target,
    resolve_model,
)
from gpuscope.ops import procs
from gpuscope.util.settings import SettingsParser, parser_for, setting

PROG = "gpuscope compare"
#: ``--sets`` value for no configuration sets (only ``--target`` endpoints).
NO_SETS = "none"


def _int_list(raw: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in raw.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"{raw!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 2:
        raise ValueError(f"{raw!r}: batch sizes must be at least 2 (1 is batching off, always included)")
    return values


def _api(raw: str) -> str:
    """``--load.api``: one of APIS, or empty for each configuration's own."""
    if raw not in ("", *APIS):
        raise ValueError(f"invalid choice: {raw!r} (choose from {', '.join(map(repr, APIS))}, or '')")
    return raw


def _optional_path(raw: str) -> Path | None:
    return Path(raw) if raw else None  # empty: the default


@dataclass(frozen=True)
class CompareFlags:
    """The flags of ``gpuscope compare``, as given; :func:`parse_settings` turns them into a Settings."""

    sets: str = setting(
        "--sets", "", f"gpuscope serve configuration sets to start and run, comma-separated "
        f"({', '.join(config_sets.SETS)}), or {NO_SETS}; default: all of them without --target, none with it")
    targets: tuple[str, ...] = setting(
        "--target", (), "an endpoint to load as it runs (repeatable; the environment variable takes several "
        "separated by spaces); MODEL defaults to the first one its GET /v1/models lists",
        metavar="NAME=URL[#MODEL]", repeated=True)
    repeats: int = setting("--repeats", 3, "repetitions of every configuration")
    duration_s: float = setting("--run.duration", 30.0, "measured time of each run (30s, 2m)",
                                parse=duration_arg)
    warmup_s: float = setting("--run.warmup", 5.0, "time before measuring, left out of figures",
                              parse=duration_arg)
    users: int = setting("--run.users", 8, "concurrent streaming users")
    spawn_rate: float = setting("--run.spawn-rate", 100.0, "users started per second")
    processes: int = setting("--run.processes", 1, "Locust processes (--processes); 1 on small machines")
    seed: int = setting("--load.seed", DEFAULT_SEED, "seed of every run's requests")
    prompt_tokens: str = setting("--load.prompt-tokens", DEFAULT_PROMPT_TOKENS, "prompt length distribution")
    output_tokens: str = setting("--load.output-tokens", DEFAULT_OUTPUT_TOKENS, "max_tokens distribution")
    api: str = setting(
        "--load.api", "", "the API every configuration is driven through, completions or chat; default: the "
        "one a target's URL names (…/v1/chat/completions), else completions", parse=_api)
    ignore_eos: bool = setting("--load.ignore-eos", True,
                               "send ignore_eos: true, so vLLM and gpuscope serve generate max_tokens tokens")
    batch_sizes: tuple[int, ...] = setting("--batch.sizes", (4, 8, 16), "batch sizes of the batching set",
                                           parse=_int_list)
    server_args: str = setting("--server.args", "", "extra gpuscope serve flags for every configuration")
    out_dir: Path = setting("--output.dir", Path("benchmarks/results"), "where the table, CSV and plots go",
                            parse=Path)
    name: str = setting("--output.name", "local", "report name: compare-NAME.md, .csv, -SET.png")
    runs_dir: Path | None = setting("--output.runs-dir", None, "per-run HTML reports, samples and logs "
                                    "(default: OUTPUT.DIR/compare-NAME-runs)", parse=_optional_path)
    label: str = setting("--output.label", "", "machine description for the report header")
    keep_samples: bool = setting("--output.keep-samples", False,
                                 "keep each run's exact samples.json (several MB per run at GPU rates)")


def build_parser() -> SettingsParser[CompareFlags]:
    return parser_for(CompareFlags, prog=PROG, description="Compare gpuscope serve configurations and "
                      "OpenAI-compatible endpoints under the same Locust load.")


@dataclass(frozen=True)
class Settings:
    configs: list[Config]
    repeats: int
    duration_s: float
    warmup_s: float
    users: int
    spawn_rate: float
    processes: int
    seed: int
    prompt_tokens: str
    output_tokens: str
    server_args: list[str]
    out_dir: Path
    name: str
    runs_dir: Path
    label: str
    keep_samples: bool
    ignore_eos: bool
    #: --load.api: "" = each configuration's own (a target's URL may name one), else completions.
    api: str

    def api_of(self, config: Config) -> str:
        return self.api or config.api or "completions"

    def seed_of(self, rep: int) -> int:
        """Seed of repetition ``rep`` (from 1): the same for every configuration within it."""
        return self.seed + rep - 1

    @property
    def started_configs(self) -> list[Config]:
        return [c for c in self.configs if not c.is_target]

    @property
    def targets(self) -> list[Config]:
        return [c for c in self.configs if c.is_target]


def _targets(specs: Sequence[str]) -> list[Target]:
    """``--target`` values → Targets, each name once."""
    targets = [parse_target(spec) for spec in specs]
    names = [t.name for t in targets]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"target name {name!r} is given twice")
    return targets


def _sets(raw: str, have_targets: bool) -> list[str]:
    names = [s.strip() for s in raw.split(",") if s.strip()]
    if not names:
        return [] if have_targets else list(config_sets.SETS)
    if NO_SETS in names:
        if len(names) > 1:
            raise ValueError(f"--sets {raw!r}: {NO_SETS!r} cannot be combined with sets")
        return []
    return names


def parse_settings(argv: Sequence[str]) -> Settings:
    """Flags → Settings; every problem is one line from the parser and exit status 2.

    Targets' models are not resolved here (that needs the network): see :func:`resolve_targets`.
    """
    parser = build_parser()
    flags = parser.parse_settings(argv)
    try:
        targets = _targets(flags.targets)
        configs = config_sets.build(_sets(flags.sets, bool(targets)), flags.batch_sizes)
        configs += config_sets.for_targets([(t.name, t.url, t.model, t.api) for t in targets])
        for distribution in (flags.prompt_tokens, flags.output_tokens):
            parse_distribution(distribution)
        server_args = shlex.split(flags.server_args)
    except ValueError as exc:
        parser.error(str(exc))
    for flag, value, low in (("--repeats", flags.repeats, 1), ("--run.users", flags.users, 1),
                             ("--run.processes", flags.processes, 1)):
        if value < low:
            parser.error(f"{flag} must be at least {low}")
    if flags.duration_s <= 0:
        parser.error("--run.duration must be positive")
    if not configs:
        parser.error(f"nothing to compare: --sets {NO_SETS} and no --target")
    if not locust_available():
        parser.error("locust is not installed (pip install 'gpuscope[loadtest]')")
    return Settings(
        configs=configs, repeats=flags.repeats, duration_s=flags.duration_s, warmup_s=flags.warmup_s,
        users=flags.users, spawn_rate=flags.spawn_rate, processes=flags.processes, seed=flags.seed,
        prompt_tokens=flags.prompt_tokens, output_tokens=flags.output_tokens, server_args=server_args,
        out_dir=flags.out_dir, name=flags.name,
        runs_dir=flags.runs_dir or flags.out_dir / f"compare-{flags.name}-runs", label=flags.label,
        keep_samples=flags.keep_samples, ignore_eos=flags.ignore_eos, api=flags.api)


def resolve_targets(settings: Settings) -> Settings:
    """Ask every target for ``/v1/models`` (its model, or that it serves the one named); TargetError names
    the target that failed."""
    configs = []
    for config in settings.configs:
        if config.is_target:
            try:
                target = resolve_model(Target(config.label, config.url, config.model))
            except TargetError as exc:
                raise TargetError(f"target {config.label!r}: {exc}") from None
            config = replace(config, model=target.model)
        configs.append(config)
    return replace(settings, configs=configs)


def locust_command(settings: Settings, host: str, run_dir: Path, model: str = "", rep: int = 1,
                   api: str = "completions") -> list[str]:
    command = [
        *locust_prefix(), "-f", str(LOCUSTFILE), "--headless", "--only-summary",
        "--host", host, "-u", str(settings.users), "-r", str(settings.spawn_rate),
        "-t", f"{settings.warmup_s + settings.duration_s:g}s",
        "--seed", str(settings.seed_of(rep)), "--prompt-tokens", settings.prompt_tokens,
        "--output-tokens", settings.output_tokens,
        "--ignore-eos", "true" if settings.ignore_eos else "false", "--api", api,
        "--html", str(run_dir / "locust.html"), "--samples-file", str(run_dir / "samples.json"),
    ]
    if model:
        command += ["--model", model]
    if settings.processes > 1:
        command += ["--processes", str(settings.processes)]
    return command


def run_one(settings: Settings, config: Config, rep: int, progress: TextIO) -> RunResult:
    """One Locust run against one configuration (started for it, and stopped, unless it is a target);
    the exact figures of the measured window."""
    run_dir = settings.runs_dir / f"{config.key}-r{rep}"
    run_dir.mkdir(parents=True, exist_ok=True)
    samples_path = run_dir / "samples.json"
    samples_path.unlink(missing_ok=True)
    if config.is_target:
        process = _run_locust(settings, config, rep, config.url, config.model, run_dir, progress)
        model = config.model
    else:
        server_args = [*settings.server_args, *config.server_args]
        with ServerProcess(server_args, log_path=run_dir / "serve.log") as server:
            try:
                model = list_models(server.url)[0]
            except TargetError as exc:
                raise RuntimeError(f"gpuscope serve: {exc}") from None
            process = _run_locust(settings, config, rep, server.url, model, run_dir, progress)
    if not samples_path.exists():
        raise RuntimeError(f"Locust wrote no samples (exit {process.poll()}); "
                           f"see {run_dir / 'locust.log'}")
    data = load_samples(samples_path)
    if not settings.keep_samples:
        samples_path.unlink()
    started, stopped = data["started"], data["stopped"]
    window = (started + settings.warmup_s, max(stopped, started + settings.warmup_s + 1e-3))
    requests = data["requests"]
    summaries = {ALL: summarise(requests, *window)}
    tenants = tenants_of(requests)
    if len(tenants) > 1:  # one tenant's figures would repeat the "all" row
        for tenant in tenants:
            summaries[tenant] = summarise(requests, *window, tenant=tenant)
    notes = []
    if data["dropped"]:
        notes.append(f"{data['dropped']} requests beyond the recorder's cap")
    if summaries[ALL].requests == 0:
        notes.append("no request finished in the window: requests outlast it, lengthen --run.duration")
    note = "; ".join(notes)
    return RunResult(config, rep, summaries, html=str(run_dir / "locust.html"), note=note, model=model)


def _run_locust(settings: Settings, config: Config, rep: int, host: str, model: str, run_dir: Path,
                progress: TextIO) -> procs.Child:
    """Locust headless against ``host`` for warm-up + duration; returns the finished process.

    Stopped early (an overrun, or Ctrl-C here) with SIGINT, as Ctrl-C does, so it still writes its
    reports: with gpuscope's load shape Locust would die on SIGTERM without them. In its own session,
    so a Ctrl-C at the terminal reaches this command only, which then stops Locust once."""
    (run_dir / "locust.log").unlink(missing_ok=True)  # a run's log holds that run only
    env = {**os.environ, "GPUSCOPE_LOAD_TENANTS": config.load_tenants, "PYTHONUNBUFFERED": "1"}
    command = locust_command(settings, host, run_dir, model, rep, settings.api_of(config))
    locust = procs.Child(command, name="Locust", env=env,
                         log_path=run_dir / "locust.log", stop_signal=signal.SIGINT, grace_s=30.0,
                         new_session=True, die_with_parent=True, signal_again=locust_ignored_ctrl_c)
    with locust:
        _wait_with_countdown(locust, settings.warmup_s + settings.duration_s, progress)
    return locust


def _wait_with_countdown(locust: procs.Child, total_s: float, progress: TextIO) -> None:
    """Wait for Locust, showing seconds left; stop it if it overruns its own run time by far."""
    started = time.monotonic()
    deadline = started + total_s + 60.0
    interactive = progress.isatty()
    last_shown = -1
    while locust.wait(0.2) is None:
        elapsed = time.monotonic() - started
        if time.monotonic() > deadline:
            locust.stop()
            raise RuntimeError(f"Locust ran {elapsed:.0f}s, past its {total_s:.0f}s run time; stopped")
        shown = int(elapsed) // (1 if interactive else 10)
        if shown != last_shown:
            last_shown = shown
            text = f"    {min(elapsed, total_s):4.0f}/{total_s:.0f} s"
            progress.write(("\r" + text) if interactive else (text + "\n"))
            progress.flush()
    if interactive:
        progress.write("\r" + " " * 20 + "\r")


def header(settings: Settings, started: dt.datetime, argv: Sequence[str] | None = None) -> dict[str, str]:
    from importlib.metadata import version

    seeds = (f"seed {settings.seed}" if settings.repeats == 1 else
             f"seed {settings.seed}–{settings.seed_of(settings.repeats)} (one per repetition)")
    head = {
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "machine": describe_machine(settings.label),
        "load": (f"{settings.users} streaming users (closed loop), {seeds}, prompts "
                 f"`{settings.prompt_tokens}` characters, max_tokens `{settings.output_tokens}`, "
                 f"ignore_eos {'on' if settings.ignore_eos else 'off'}, "
                 f"{settings.api or 'each target its URL’s (else completions)'} API, Locust "
                 f"{version('locust')} × {settings.processes} process(es)"),
        "runs": (f"{settings.repeats} repetitions × {len(settings.configs)} configurations, interleaved; "
                 f"{settings.warmup_s:g} s warm-up + {settings.duration_s:g} s measured each"
                 + ("; a fresh server per run of a set" if settings.started_configs else "")
                 + ("; targets loaded as they run, never restarted" if settings.targets else "")),
    }
    if settings.started_configs:
        head["server"] = f"`gpuscope serve {' '.join(settings.server_args)}` + the configuration's flags"
    if settings.targets:
        head["targets"] = ", ".join(f"{c.label} = {c.url} (model `{c.model}`)" for c in settings.targets)
    args = sys.argv[1:] if argv is None else argv
    head["command"] = "`" + " ".join([PROG, *map(shlex.quote, args)]) + "`"
    return head


def _one_line(result: RunResult) -> str:
    s = result.summaries[ALL]
    ttft = "-" if s.ttft_p99_s is None else f"{s.ttft_p99_s * 1000:.1f}"
    itl = "-" if s.itl_p99_s is None else f"{s.itl_p99_s * 1000:.2f}"
    return (f"{s.rps:7.2f} req/s {s.tps:8.0f} tok/s  TTFT p99 {ttft} ms  ITL p99 {itl} ms  "
            f"errors {s.error_rate:.1%}")


def main(argv: Sequence[str] | None = None, progress: TextIO = sys.stdout) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    settings = parse_settings(argv)
    try:
        settings = resolve_targets(settings)
    except TargetError as exc:
        sys.stderr.write(f"{PROG}: error: {exc}\n")
        return 2
    for config in settings.targets:
        progress.write(f"target {config.label}: {config.url}, model {config.model!r}"
                       + (f" (Authorization from {API_KEY_ENV})" if os.environ.get(API_KEY_ENV) else "")
                       + "\n")
    started = dt.datetime.now(dt.timezone.utc)
    plan = [(rep, config) for rep in range(1, settings.repeats + 1) for config in settings.configs]
    per_run = settings.warmup_s + settings.duration_s + 5
    progress.write(f"{len(plan)} runs of {settings.warmup_s + settings.duration_s:g} s "
                   f"(about {len(plan) * per_run / 60:.1f} min with server starts)\n")
    results: list[RunResult] = []
    for index, (rep, config) in enumerate(plan, 1):
        progress.write(f"[{index}/{len(plan)}] {config.set}/{config.label} rep {rep}/{settings.repeats}\n")
        progress.flush()
        try:
            result = run_one(settings, config, rep, progress)
        except (ServerError, RuntimeError, ValueError) as exc:
            sys.stderr.write(f"{PROG}: {config.set}/{config.label} rep {rep}: {exc}\n")
            return 1
        results.append(result)
        progress.write(f"    {_one_line(result)}\n")
    write_outputs(settings, results, header(settings, started, argv), progress)
    return 0


def write_outputs(settings: Settings, results: Sequence[RunResult], head: dict[str, str],
                  progress: TextIO) -> list[Path]:
    out = settings.out_dir
    out.mkdir(parents=True, exist_ok=True)
    stem = f"compare-{settings.name}"
    plots: dict[str, str] = {}
    written: list[Path] = []
    for set_name in dict.fromkeys(r.config.set for r in results):
        path = plot_set(results, set_name, out / f"{stem}-{set_name}.png",
                        f"{set_name} — {head.get('machine', '')}")
        plots[set_name] = path.name
        written.append(path)
    csv_path, md_path = out / f"{stem}.csv", out / f"{stem}.md"
    write_csv(results, csv_path)
    md_path.write_text(markdown(results, head, plots))
    written += [csv_path, md_path]
    progress.write("wrote " + ", ".join(str(p) for p in written)
                   + f"; per-run reports in {settings.runs_dir}\n")
    return written


if __name__ == "__main__":
    raise SystemExit(main())
