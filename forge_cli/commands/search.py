"""`forge search`: one op at one shape (forge.tuner.engine), or every entry of a manifest (forge.tuner.batch),
with a progress bar on stderr and the candidate table (or one JSON document) on stdout."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from forge.cache import WINNING, CacheError
from forge.errors import ExitCode, ForgeError, UsageError
from forge.tuner import batch, engine
from forge.tuner import manifest as manifest_mod
from forge.tuner.status import Status
from forge_cli.jsonout import emit
from forge_cli.options import (
    AttrOpt,
    BudgetOpt,
    CacheOpt,
    DeviceOpt,
    DtypeOpt,
    EffortOpt,
    JsonOpt,
    ManifestOpt,
    SeedOpt,
    ShapeOpt,
    StrategyOpt,
    TimeBudgetOpt,
    TimeoutOpt,
    WorkersOpt,
    check_settings,
    complete_op,
    parse_attrs,
    parse_shape_opt,
)
from forge_cli.render import age, err, fail, fmt_params, fmt_speedup, fmt_us, lock_wait, open_cache, out, status_cell

SETTINGS = ("dtype", "budget", "strategy", "seed", "timeout", "device", "workers", "time_budget", "effort")


# -- progress -------------------------------------------------------------------------------------------------
def _progress(disable: bool) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err, disable=disable)


class ProgressEvents:
    """Maps engine events to a Rich progress bar on stderr."""

    def __init__(self, progress: Progress | None):
        self.progress = progress
        self.task = None
        self.total = 0
        self.label = ""

    def reset(self, description: str) -> None:
        """A new search (the next manifest entry): a fresh bar under its label."""
        if self.progress is not None and self.task is not None:
            self.progress.remove_task(self.task)
        self.task, self.total, self.label = None, 0, description

    def __call__(self, kind: str, **data: Any) -> None:
        p = self.progress
        lock_wait(kind, data)
        if p is None:
            return
        if kind == "start":
            self.task = p.add_task(f"{self.label} starting {data['workers']} worker(s) ({data['backend']})".strip(),
                                   total=None)
        elif kind == "batch":
            self.total += 2 * data["size"]
            p.update(self.task, total=self.total, description=f"{self.label} validating + timing".strip())
        elif kind == "retime":  # successive halving: the kept candidates timed again, with more rounds
            self.total += data["size"]
            p.update(self.task, total=self.total, description=f"{self.label} re-timing the best {data['size']} "
                                                               f"({data['rounds']} rounds)".strip())
        elif kind in ("validated", "timed"):
            adv = 2 if kind == "validated" and data["result"].status != Status.OK else 1
            p.update(self.task, advance=adv)
        elif kind == "finalists":
            p.update(self.task, description=f"{self.label} re-timing {len(data['results'])} finalists vs eager".strip())


# -- human output ---------------------------------------------------------------------------------------------
def candidates_table(report: engine.SearchReport, top: int) -> Table:
    clock = "µs (device)" if report.backend == "cuda" else "µs (host, interpreter)"
    table = Table(title=f"{report.op} {report.spec.shape_str} {report.spec.dtype} — candidates")
    for col in ("#", "variant", "params"):
        table.add_column(col)
    for col in (f"p20 {clock}", "p50", "p80", "speedup"):
        table.add_column(col, justify="right")
    table.add_column("status")
    if report.baseline is not None:
        b = report.baseline
        table.add_row("", "eager", "(baseline)", fmt_us(b.p20), fmt_us(b.p50), fmt_us(b.p80), "1.00x", "ok")
    ok = [c for c in report.candidates if c["status"] == Status.OK]
    bad = [c for c in report.candidates if c["status"] != Status.OK]
    for i, c in enumerate(ok[:top], 1):
        q = c["final"] or c["screen"] or {}
        table.add_row(str(i), c["variant"], c.get("label") or fmt_params(c["params"]), fmt_us(q.get("p20")),
                      fmt_us(q.get("p50")), fmt_us(q.get("p80")), fmt_speedup(c["speedup"]),
                      "ok" + (" (final)" if c["final"] else ""))
    if len(ok) > top:
        table.add_row("", f"... {len(ok) - top} more ok", "", "", "", "", "", "")
    for c in bad:
        reason = (c.get("reason") or "").splitlines()[0][:90] if c.get("reason") else ""
        table.add_row("", c["variant"], c.get("label") or fmt_params(c["params"]), "", "", "", "",
                      status_cell(c["status"], reason))
    return table


def print_pareto(report: engine.SearchReport) -> None:
    p = report.pareto
    if not p:
        out.print("no speed/cost frontier: no candidate was timed in this search (a cache hit does no work)")
        return
    table = Table(title=f"speed against cost (lambda {p['lambda']:g}; forge/tuner/pareto.py)")
    for col in ("candidate", "speedup", "GPU s", "tokens", "score"):
        table.add_column(col, justify="left" if col == "candidate" else "right")
    for r in p["frontier"]:
        mark = " [bold](recommended)[/]" if r is p["recommended"] or r == p["recommended"] else ""
        table.add_row(f"{r['variant']}({fmt_params(r['params'])}){mark}", fmt_speedup(r["speedup"]),
                      f"{r['cost']['gpu_seconds']:.2f}", str(r["cost"]["tokens"]), f"{r['score']:.3f}")
    out.print(table)


def print_report(report: engine.SearchReport, top: int) -> None:
    if report.backend == "interpreter":
        out.print("[bold yellow]Triton interpreter on the CPU: timings are host-clock interpreter timings, "
                  "not GPU performance.[/]")
    if report.cache_hit:
        out.print(f"[bold]cache hit[/] — decision stored {age(report.stored['created_at'])} ago for "
                  f"{report.op} {report.spec.shape_str} {report.spec.dtype} (that search took "
                  f"{report.stored['search_seconds']:.1f} s); no work done.")
    if report.note:
        err.print(f"[bold yellow]note:[/] {escape(report.note)}")
    if report.cut_short:
        err.print(f"[bold yellow]cut short:[/] {escape(report.cut_short)}")
    out.print(candidates_table(report, top))
    sp = report.speedup
    if report.decision == "kernel":
        w = report.winner
        out.print(f"[bold green]decision: kernel[/] {w['variant']}({fmt_params(w['params'])}) "
                  f"p50 {fmt_us(w['quantiles']['p50'])} µs vs eager {fmt_us(report.baseline.p50)} µs "
                  f"({fmt_speedup(sp)})")
    elif report.decision == "torch":
        w = report.winner
        label = next((c.get("label") for c in report.candidates if c.get("variant") == "torch"), "torch's op")
        out.print(f"[bold green]decision: torch op[/] {escape(str(label))} p50 {fmt_us(w['quantiles']['p50'])} µs vs "
                  f"the code as written {fmt_us(report.baseline.p50)} µs ({fmt_speedup(sp)}); faster than every "
                  "forge kernel tried")
    elif report.decision == "eager":
        out.print("[bold yellow]decision: eager[/] — no candidate beat eager by the required margin "
                  "(p80(candidate) < p20(eager)/1.03); eager is cached as the decision.")
    elif report.cut_short:
        out.print("[bold yellow]decision: none[/] — the time budget ran out before a candidate was timed; "
                  "nothing was cached.")
    else:
        out.print("[bold red]decision: none[/] — every candidate failed; nothing was cached.")
    out.print(f"cache key: {report.key}  ({report.cache_path})")
    if not report.cache_hit:
        out.print(f"search wall time: {report.seconds:.1f} s")


JOB_STATUS = {"failed": "[red]failed[/]", "cached": "cached", "searched": "[green]searched[/]",
              "skipped": "[yellow]skipped[/]"}  # batch.JobResult


def job_status_cell(r: batch.JobResult) -> str:
    if r.status == "skipped":
        return f"[yellow]skipped: {escape(batch.SKIPPED_NOTE)}[/]"
    return JOB_STATUS[r.status] + (" [yellow](cut short)[/]" if r.note else "")


def fmt_share(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def print_manifest_run(path: Path, part: tuple[int, int] | None, m: manifest_mod.Manifest, jobs: list,
                       results: list[batch.JobResult], spread: bool, cache_path: Path, wall: float,
                       estimate: float | None = None) -> None:
    title = f"{path}" + (f" — shard {part[0]}/{part[1]}: {len(jobs)} of {len(m.jobs)} jobs" if part else "")
    shares = any(r.share is not None for r in results)
    table = Table(title=title)
    cols = ["entry", "op", "shape", "dtype", *(["share"] if shares else []), "status", "decision", "winner",
            "p50 µs", "eager µs", "speedup", "s"] + (["device"] if spread else [])
    for col in cols:
        table.add_column(col, justify="right" if col in ("share", "p50 µs", "eager µs", "speedup", "s") else "left")
    for r in results:
        table.add_row(str(r.entry), r.op, r.shape, r.dtype, *([fmt_share(r.share)] if shares else []),
                      job_status_cell(r), r.decision or "-", r.winner or "-",
                      fmt_us(r.p50_us), fmt_us(r.eager_p50_us), fmt_speedup(r.speedup), f"{r.seconds:.1f}",
                      *([escape(str(r.device)) if r.device is not None else "-"] if spread else []))
    out.print(table)
    budget = f"; time budget {m.time_budget:g} s" if m.time_budget is not None else ""
    out.print(f"cache: {cache_path}; wall time {wall:.1f} s{budget}")
    if estimate is not None:
        out.print(f"estimated end-to-end speedup (Amdahl over the shares): {estimate:.2f}x")
    skipped = [r for r in results if r.status == "skipped"]
    if skipped:
        err.print(f"[bold yellow]skipped:[/] {len(skipped)} job(s) not started or cut short before a decision: "
                  "the time budget was spent")
    for r in results:
        if r.status == "failed":
            err.print(f"[bold red]failed:[/] {escape(f'[[op]] #{r.entry} {r.op} {r.shape} {r.dtype}: {r.error}')}")
        elif r.note and r.status != "skipped":
            err.print(f"[yellow]note:[/] {escape(f'[[op]] #{r.entry} {r.op} {r.shape} {r.dtype}: {r.note}')}")


# -- the command ----------------------------------------------------------------------------------------------
OpArg = Annotated[str | None, typer.Argument(help="Op family, e.g. rmsnorm or softmax (or use --manifest).",
                                             autocompletion=complete_op)]
ShardOpt = Annotated[str | None, typer.Option("--shard", help="With --manifest: only shard I of N, "
                                                              "written I/N with 0 <= I < N.")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Search even if a decision is cached.")]
TopOpt = Annotated[int, typer.Option("--top", help="Rows of ok candidates to show.")]
DevicesOpt = Annotated[str | None, typer.Option("--devices", help="With --manifest: GPUs of this host to "
                                                "spread the entries over, e.g. 0,1 (one runner per GPU).")]
ExecutorOpt = Annotated[str, typer.Option("--executor", help="With --manifest: local, or ray (each entry a Ray "
                                                             "task; pip install 'forge-kernel[ray]').")]
AddressOpt = Annotated[str | None, typer.Option("--address", help="With --executor ray: the cluster address "
                                                                  "(default: start a local Ray).")]


RoundsOpt = Annotated[int | None, typer.Option("--rounds", help="--strategy llm: proposal rounds (default 5); the "
                                                                "budget is shared over them.")]
LlmCommandOpt = Annotated[str | None, typer.Option(
    "--llm-command", help="--strategy llm: a program speaking forge's JSON protocol on stdin/stdout (docs/search.md);"
                          " default: the Anthropic SDK.")]
ParetoOpt = Annotated[bool, typer.Option("--pareto", help="Also show the candidates' speed-against-cost frontier "
                                                          "(GPU seconds, LLM tokens) and the recommendation.")]
LambdaOpt = Annotated[float | None, typer.Option("--lambda", help="The speed/cost trade-off of the recommendation: 0 "
                                                                  "speed only, 0.1 (default), 1 equal, above 1 cost "
                                                                  "first.")]
LlmModelOpt = Annotated[str | None, typer.Option("--llm-model", help="--strategy llm with the Anthropic SDK: the model "
                                                                     "(default: FORGE_LLM_MODEL, else a current Claude "
                                                                     "model).")]


def search(
    op: OpArg = None,
    shape: ShapeOpt = None,
    manifest: ManifestOpt = None,
    shard: ShardOpt = None,
    dtype: DtypeOpt = None,
    budget: BudgetOpt = None,
    strategy: StrategyOpt = None,
    seed: SeedOpt = None,
    device: DeviceOpt = None,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
    cache: CacheOpt = None,
    timeout: TimeoutOpt = None,
    workers: WorkersOpt = None,
    attr: AttrOpt = None,
    top: TopOpt = 10,
    time_budget: TimeBudgetOpt = None,
    effort: EffortOpt = None,
    devices: DevicesOpt = None,
    executor: ExecutorOpt = "local",
    address: AddressOpt = None,
    rounds: RoundsOpt = None,
    llm_command: LlmCommandOpt = None,
    llm_model: LlmModelOpt = None,
    pareto: ParetoOpt = False,
    lam: LambdaOpt = None,
) -> None:
    """Search for the fastest correct kernel for OP at --shape (or for every entry of --manifest, largest
    share first), against eager PyTorch. Settings: command line > FORGE_* environment > manifest > built-in."""
    cli = {"dtype": dtype, "budget": budget, "strategy": strategy, "seed": seed, "timeout": timeout,
           "device": device, "workers": workers, "cache": cache, "time_budget": time_budget, "effort": effort}
    try:
        check_settings(cli, SETTINGS, name_flags=False)
        if rounds is not None and rounds < 1:
            raise UsageError("--rounds must be at least 1")
        if lam is not None and not lam >= 0:
            raise UsageError(f"--lambda {lam}: expected a number >= 0")
        if manifest is not None:
            if op is not None or shape is not None or attr:
                raise UsageError("--manifest replaces OP, --shape and --attr; give either a manifest or one op")
            if strategy == "llm" or rounds is not None or llm_command or llm_model:
                raise UsageError("--strategy llm (and --rounds, --llm-command, --llm-model) is for one op: "
                                 "forge search OP --shape ...")
            _search_manifest(manifest, shard, cli, force, json_out, devices, executor, address)
            return
        for flag, value in (("--shard", shard), ("--devices", devices), ("--address", address),
                            ("--executor", None if executor == "local" else executor)):
            if value is not None:
                raise UsageError(f"{flag} needs --manifest")
        if op is None or shape is None:
            raise UsageError("give OP and --shape (e.g. forge search rmsnorm --shape 2048x4096), or --manifest FILE")
        shape_t = parse_shape_opt(shape)
        r = {name: manifest_mod.resolve(name, cli, os.environ) for name in SETTINGS}
        deadline = time.monotonic() + r["time_budget"] if r["time_budget"] is not None else None
        llm_opts: dict = {}
        if r["strategy"] == "llm":
            from forge.tuner import llm

            n_rounds = rounds or 5
            llm_opts = {"llm": llm.make_client(command=llm_command, model=llm_model), "rounds": n_rounds,
                        "per_round": max(1, -(-(r["budget"] - 1) // n_rounds))}
        elif rounds is not None or llm_command or llm_model:
            raise UsageError("--rounds, --llm-command and --llm-model need --strategy llm")
        if lam is not None:
            llm_opts["pareto_lambda"] = lam
        options = engine.SearchOptions(budget=r["budget"], strategy=r["strategy"], seed=r["seed"], force=force,
                                       timeout=r["timeout"], workers=r["workers"], deadline=deadline, **llm_opts)
        attrs = parse_attrs(attr or [])
        db = open_cache(cache)
        with _progress(disable=json_out or not err.is_terminal) as progress:
            report = engine.search(op, shape_t, r["dtype"], device=r["device"], cache=db, attrs=attrs,
                                   options=options, events=ProgressEvents(progress))
    except ForgeError as exc:
        raise fail(exc, exc.exit_code) from None
    except CacheError as exc:
        raise fail(exc, ExitCode.CACHE) from None
    if json_out:
        emit(report.to_dict())
    else:
        print_report(report, top)
        if pareto:
            print_pareto(report)
    if report.decision == "none" and report.cut_short is None:  # cut short by --time-budget: no failure
        raise typer.Exit(ExitCode.ALL_FAILED)


def _search_manifest(path: Path, shard: str | None, cli: dict, force: bool, json_out: bool,
                     devices: str | None = None, executor: str = "local", address: str | None = None) -> None:
    if executor not in ("local", "ray"):
        raise UsageError(f"--executor {executor!r}: expected local or ray")
    if address is not None and executor != "ray":
        raise UsageError("--address needs --executor ray")
    if devices is not None and executor == "ray":
        raise UsageError("--devices is for the local executor; Ray places each job on a GPU itself")
    device_list = batch.parse_devices(devices) if devices is not None else None
    t_run = time.monotonic()  # the time budget counts from here: loading, pools and every search
    m = manifest_mod.load(path, cli=cli)
    jobs = m.jobs
    part = None
    if shard is not None:
        part = manifest_mod.parse_shard(shard)
        jobs = manifest_mod.shard(jobs, *part)
    jobs = batch.by_share(jobs)
    deadline = t_run + m.time_budget if m.time_budget is not None else None
    db = open_cache(m.cache)
    show_progress = not json_out and err.is_terminal and device_list is None and executor == "local"
    with _progress(disable=not show_progress) as progress:
        events = ProgressEvents(progress)

        done: dict[int, batch.JobResult] = {}

        def on_start(n: int, job) -> None:
            label = f"[{n + 1}/{len(jobs)}] {job.label}"
            if show_progress:
                events.reset(label)
            elif not json_out:
                err.print(label)

        def on_done(n: int, job, res: batch.JobResult) -> None:
            done[n] = res
            if json_out or res.status == "skipped":
                return
            est = batch.run_estimate(jobs, done)
            outcome = res.status if res.status == "failed" else (
                f"{res.decision} {fmt_speedup(res.speedup)}" if res.decision in WINNING else str(res.decision))
            line = f"[{n + 1}/{len(jobs)}] {job.label}: {outcome}" + (
                f" (share {fmt_share(job.share)})" if job.share is not None else "")
            if est is not None:
                line += f"; estimated end-to-end speedup {est:.2f}x"
            err.print(escape(line))

        results = batch.run(jobs, cache=db, device=m.device, workers=m.workers, force=force,
                            on_start=on_start, events=events, devices=device_list, executor=executor,
                            address=address, deadline=deadline, on_done=on_done)
        wall = time.monotonic() - t_run
    failed = [r for r in results if r.status == "failed"]
    estimate = batch.run_estimate(jobs, results)
    if json_out:
        covered = sum(j.share for j in jobs if j.share is not None) if estimate is not None else None
        emit({"manifest": str(path), "shard": list(part) if part else None, "cache": str(db.path),
              "executor": executor, "devices": device_list, "wall_s": wall, "time_budget_s": m.time_budget,
              "jobs": len(jobs), "total_jobs": len(m.jobs), "failed": len(failed),
              "skipped": sum(r.status == "skipped" for r in results), "covered_share": covered,
              "estimated_speedup": estimate, "entries": [r.to_dict() for r in results]})
    else:
        spread = device_list is not None or executor == "ray"
        print_manifest_run(path, part, m, jobs, results, spread, db.path, wall, estimate)
    if failed:
        raise typer.Exit(failed[0].exit_code or ExitCode.ALL_FAILED)


def register(app: typer.Typer, cache_app: typer.Typer) -> None:
    app.command("search")(search)
