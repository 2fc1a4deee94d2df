"""``jaxgrad demo``: the package's main job in a few minutes (see ``docs/demo.md``).

1. audit the hand-written backward passes (:mod:`~jaxgrad.demo.audit_stage`),
2. fit a KAN to ``exp(sin(pi x) + y^2)`` with grid refinement (:mod:`~jaxgrad.demo.kan_stage`),
3. train the denoiser on synthetic particles (:mod:`~jaxgrad.demo.denoiser_stage`),

then write a report folder (:mod:`~jaxgrad.demo.report`, :mod:`~jaxgrad.demo.html`, :mod:`~jaxgrad.demo.plots`:
``index.html``, ``metrics.json``, ``verdicts.txt``, PNGs) and print a one-screen summary
(:mod:`~jaxgrad.demo.console`). Sizes: :mod:`~jaxgrad.demo.plan`; the report folder's rules:
:mod:`~jaxgrad.demo.outdir`.

    from jaxgrad.demo import run_demo
    status = run_demo("jaxgrad-demo", quick=True)
"""

from jaxgrad.demo.run import DEFAULT_OUT, run_demo

__all__ = ["DEFAULT_OUT", "run_demo"]
