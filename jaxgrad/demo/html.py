"""``index.html``: the report on one page (relative links only, no scripts, no external files; the folder can be
moved, zipped or served as it is)."""

from __future__ import annotations

from html import escape

from jaxgrad.demo import outdir

STYLE = """
body { font: 15px/1.5 system-ui, sans-serif; max-width: 60em; margin: 2em auto; padding: 0 1em; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.8em 0; } td, th { padding: 0.25em 0.8em; border-bottom: 1px solid #eee;
text-align: left; } th { background: #f6f6f6; } td.num { text-align: right; font-family: monospace; }
.pass { color: #1a7f37; font-weight: bold; } .fail { color: #cf222e; font-weight: bold; }
.meta { color: #666; } img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; } code { background: #f4f4f4; }
"""
FIGURES = {outdir.KAN_LOSS_PNG: "the KAN's training curve", outdir.KAN_ACTIVATIONS_PNG: "the KAN's learned edge "
           "functions", outdir.DENOISER_LOSS_PNG: "the denoiser's training curve",
           outdir.DENOISED_EXAMPLES_PNG: "held-out particles: noisy, denoised, clean"}


def _verdict(ok: bool) -> str:
    return '<span class="pass">PASS</span>' if ok else '<span class="fail">FAIL</span>'


def _table(header: list[str], rows: list[list[str]], numeric: set[int] = frozenset()) -> str:
    """Cells are HTML already (escape text before)."""
    head = "".join(f"<th>{h}</th>" for h in header)
    body = "".join("<tr>" + "".join(f'<td class="num">{c}</td>' if i in numeric else f"<td>{c}</td>"
                                    for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _figure(name: str, caption: str, shown: list[str]) -> str:
    shown.append(name)
    return f'<figure><a href="{name}"><img src="{name}" alt="{escape(caption)}"></a><figcaption>{caption}' \
           f"</figcaption></figure>"


def _audit_section(m: dict) -> str:
    a = m["audit"]
    rows = [[escape(op["name"]), escape(", ".join(str(tuple(s)) if isinstance(s, list) else str(s)
                                                  for s in op["sizes"])),
             "vacuous" if op["worst_fraction_of_bound"] is None else f"{op['worst_fraction_of_bound']:.3f}",
             _verdict(op["passed"]), f"{op['seconds']:.1f}"]
            for op in a["ops"]]
    summary = (f"all {a['n_ops']} pass" if a["passed"] else f"{a['n_failed']} of {a['n_ops']} FAIL")
    return f"""<h2>1. Are the hand-written gradients right? {_verdict(a['passed'])} ({summary})</h2>
<p>jaxgrad writes the backward pass (the <em>VJP</em>: how the gradient flows back through an op) of each op by
hand, for speed. The audit recomputes every gradient with JAX's automatic differentiation of a plain, slow
reference in float64 (as good as exact here) and compares them entry by entry. Some error is unavoidable: float32
rounds every sum. The verifier models how much rounding each entry can show (its <em>bound</em>); an op passes when
no entry exceeds it. <b>worst</b> is the largest error as a fraction of its bound: below 1 passes.
<code>[xla]</code> is the op's custom VJP in plain JAX/XLA, <code>[pallas]</code> its Pallas kernel (on a CPU it
runs in interpret mode).</p>
{_table(["op", "sizes checked", "worst (of bound)", "verdict", "seconds"], rows, {2, 4})}
<p>Full tables, per gradient leaf, with the finite-difference, adjoint and structural checks:
<a href="{outdir.VERDICTS}">{outdir.VERDICTS}</a>. The demo checks each op at its smallest size;
<code>jaxgrad audit</code> checks every registered size and how the error grows with size.</p>"""


def _kan_section(m: dict, shown: list[str], pngs: list[str]) -> str:
    k = m["kan"]
    rows = [[str(g["grid"]), f"{g['train_rmse']:.2e}", f"{g['test_rmse']:.2e}", str(g["steps"])]
            for g in k["per_grid"]]
    grids = " &rarr; ".join(str(g) for g in k["grids"])
    figs = ""
    if outdir.KAN_LOSS_PNG in pngs:
        figs += _figure(outdir.KAN_LOSS_PNG, "Training error per optimiser step (log scale). Dashed lines: a new "
                        "phase (optimiser or grid) starts; red dots: the test RMSE reached on each grid.", shown)
    if outdir.KAN_ACTIVATIONS_PNG in pngs:
        figs += _figure(outdir.KAN_ACTIVATIONS_PNG, "The learned function on every edge (solid; dashed: its spline "
                        "part). For this target the first layer should look like sin(pi x) and y^2, the second "
                        "like exp (up to sign and scale): the network recovers the formula's pieces.", shown)
    return f"""<h2>2. A KAN learns a formula: test RMSE {k['rmse_before_refinement']:.1e} &rarr;
{k['rmse_after_refinement']:.1e}</h2>
<p>A Kolmogorov-Arnold network (KAN) puts a small learnable curve (a spline) on every edge instead of a weight.
Here a [{', '.join(map(str, k['widths']))}] KAN learns <code>f(x, y) = {escape(k['target'])}</code> from
{k['n_train']} samples, through jaxgrad's hand-written KAN gradient. <em>Grid refinement</em> (grids {grids}) gives
the splines more knots and keeps training: each refinement starts from the function already learned, and the error
on {k['n_test']} unseen test points drops ({k['refinement_gain']:.0f}x here).</p>
{_table(["grid (knots)", "train RMSE", "test RMSE", "steps so far"], rows, {1, 2, 3})}
{figs}"""


def _denoiser_section(m: dict, shown: list[str], pngs: list[str]) -> str:
    d = m["denoiser"]
    rows = [["noisy input", f"{d['psnr_noisy_db']:.1f}", f"{d['mse_noisy_vs_clean']:.4f}"],
            ["untrained network", "", f"{d['mse_vs_clean_initial']:.4f}"],
            ["denoised (trained)", f"{d['psnr_denoised_db']:.1f}", f"{d['mse_vs_clean_final']:.4f}"]]
    figs = ""
    if outdir.DENOISER_LOSS_PNG in pngs:
        figs += _figure(outdir.DENOISER_LOSS_PNG, "Training loss per step. It stays high by design: the target is "
                        "itself noisy, so the loss cannot fall below the target's noise; what matters is the "
                        "comparison with the clean particles above.", shown)
    if outdir.DENOISED_EXAMPLES_PNG in pngs:
        figs += _figure(outdir.DENOISED_EXAMPLES_PNG, "Held-out particles: the noisy input, the network's output and "
                        "the clean projection (never shown to the network).", shown)
    return f"""<h2>3. A denoiser learns from noisy pairs only: PSNR {d['psnr_noisy_db']:.1f} dB &rarr;
{d['psnr_denoised_db']:.1f} dB</h2>
<p>Cryo-electron microscopy images single molecules ("particles") at a very low signal-to-noise ratio. Here
{d['particles']} synthetic particles ({d['size']} x {d['size']} pixels, SNR {d['snr']:g}: the noise has
{1 / d['snr']:.0f}x the signal's power) each come twice, with independent noise. A small convolutional network
(through jaxgrad's hand-written conv2d gradient) learns to predict one noisy copy from the other
(<em>Noise2Noise</em>): the noise cannot be predicted, so it learns the clean signal without ever seeing it. Below,
{d['n_eval']} held-out particles compared with their clean version (PSNR: higher is better; MSE: lower is
better), after {d['steps']} steps.</p>
{_table(["image", "PSNR vs clean (dB)", "MSE vs clean"], rows, {1, 2})}
{figs}"""


def index_html(m: dict, pngs: list[str]) -> str:
    """The page for metrics ``m`` (see :func:`jaxgrad.demo.report.demo_metrics`); every file in ``pngs`` is shown."""
    shown: list[str] = []
    dev, sec = m["device"], m["seconds"]
    kan, den = _kan_section(m, shown, pngs), _denoiser_section(m, shown, pngs)
    extra = "".join(_figure(p, escape(p), shown) for p in pngs if p not in shown)
    files = [(outdir.INDEX, "this page"), (outdir.METRICS, "every number on this page, as JSON"),
             (outdir.VERDICTS, "the audit's full tables")] + [(p, FIGURES.get(p, "figure")) for p in pngs]
    file_list = "".join(f'<li><a href="{f}">{f}</a>: {what}</li>' for f, what in files)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>jaxgrad demo report</title><style>{STYLE}</style></head>
<body>
<h1>jaxgrad demo report</h1>
<p class="meta">{escape(m['created'])} &middot; device: {escape(dev['platform'].upper())} ({escape(dev['kind'])})
&middot; {m['plan']} sizes &middot; {sec['total']:.0f} s in all &middot; jaxgrad {escape(m['versions']['jaxgrad'])},
JAX {escape(m['versions']['jax'])}</p>
<p>jaxgrad is a JAX package whose backward passes are written by hand and verified. This report shows the three
things it does, each in a minute or two: it <b>checks</b> its own gradients, then uses them to <b>train</b> two
small models.</p>
{_audit_section(m)}
{kan}
{den}
{f"<h2>More figures</h2>{extra}" if extra else ""}
<h2>Files in this folder</h2><ul>{file_list}</ul>
<h2>Next</h2>
<p><code>jaxgrad audit</code> (every op at every size), <code>jaxgrad train kan configs/kan.toml --out runs/kan</code>
and <code>jaxgrad train cnn configs/cnn.toml --out runs/cnn</code> (the full, checkpointed trainings; see
<code>docs/train.md</code>), <code>docs/demo.md</code> (this demo).</p>
</body></html>
"""
