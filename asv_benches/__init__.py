"""asv benchmarks of attn-ref: every registered variant, and the native peers.

Run from the repository root (``asv.conf.json``): ``asv run``, ``asv continuous main
HEAD``, ``asv compare``, ``asv publish``. ``attn-ref scaling`` turns the results into
the fitted exponents of time and memory in ``N`` and a log-log plot.
"""
