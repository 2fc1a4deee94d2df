"""jaxgrad's benchmark suites, beside the library: what each family's kernels cost against their peers.

    python -m jaxgrad.bench SUITE [--sizes small|full] [--precision default|highest] [--out runs/bench] ...

* :mod:`jaxgrad.bench.harness`: timing, compiled memory, roofline floors, result tables and files; every suite that
  times its variants in one process goes through :func:`jaxgrad.bench.harness.run_variants`;
* :mod:`jaxgrad.bench.fresh_process`: the suites that run each variant in a child process of its own (the LoRA block
  and the LoRA model), so that each one's peak device memory is its own;
* one module per suite.

Nothing in the model families (``jaxgrad.kan``, ``jaxgrad.cnn``, ``jaxgrad.lora``) imports this package.
"""
