"""``jaxgrad demo``: the three stages in order, the report, the console summary and the exit status."""

from __future__ import annotations

import pathlib
import sys
import time

from jaxgrad.demo import console as text
from jaxgrad.demo import outdir, report
from jaxgrad.demo.audit_stage import run_audit, selected_cases
from jaxgrad.demo.denoiser_stage import run_denoiser
from jaxgrad.demo.kan_stage import run_kan
from jaxgrad.demo.plan import plan_for

PROG = "jaxgrad demo"
DEFAULT_OUT = "jaxgrad-demo"
OutDirErrors = (outdir.OutDirError, OSError)  # OSError: e.g. no permission to create the folder


def run_demo(out: str | pathlib.Path = DEFAULT_OUT, *, quick: bool = False, overwrite: bool = False,
             stream=None) -> int:
    """Run the demo into report folder ``out``; returns the exit status: 0 when every audit verdict passes, 1 when
    one fails (or a training diverges), 2 for a report folder that may not be used (one line on stderr).

    ``stream``: where the console summary goes (default ``sys.stdout``).
    """
    t0, cpu0 = time.perf_counter(), time.process_time()
    out = pathlib.Path(out)
    try:
        outdir.prepare_out_dir(out, overwrite)
    except OutDirErrors as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    from jaxgrad.train import TrainingDiverged

    plan = plan_for(quick)
    con = text.Console(stream)
    device = report.device_info()
    con.say(text.intro(device, plan, out))
    seconds, cpu_seconds = {}, {}
    cpu_mark = time.process_time()

    def cpu_since_mark(stage: str) -> None:  # CPU time of this process (all threads): the load of others excluded
        nonlocal cpu_mark
        now = time.process_time()
        cpu_seconds[stage], cpu_mark = now - cpu_mark, now

    try:
        con.say(text.audit_header(len(selected_cases(plan))))
        audit = run_audit(plan, on_verdict=lambda v, i, n: con.say(text.audit_line(v)))
        con.say(text.audit_done(audit))
        seconds["audit"] = audit.seconds
        cpu_since_mark("audit")

        con.say(text.kan_header(plan))
        kan = run_kan(plan)
        con.say(text.kan_done(kan))
        seconds["kan"] = kan.seconds
        cpu_since_mark("kan")

        con.say(text.denoiser_header(plan))
        den = run_denoiser(plan, out / outdir.DENOISED_EXAMPLES_PNG)
        con.say(text.denoiser_done(den))
        seconds["denoiser"] = den.seconds
        cpu_since_mark("denoiser")
    except TrainingDiverged as err:
        print(f"{PROG}: error: a training diverged: {err}", file=sys.stderr)
        return 1
    t_report = time.perf_counter()
    report.write_figures(out, kan, den)
    seconds["report"] = time.perf_counter() - t_report
    cpu_since_mark("report")
    seconds["total"] = time.perf_counter() - t0
    cpu_seconds["total"] = time.process_time() - cpu0
    metrics = report.demo_metrics(plan.name, audit, kan, den, seconds, cpu_seconds)
    report.write_report(out, metrics, audit)
    con.say(text.closing(audit, seconds["total"], (out / outdir.INDEX).resolve()))
    return 0 if audit.passed else 1

