"""conformance: the numerical oracle that attention kernels are checked against.

``verify(kernel, "softmax", backend="torch", dtypes=("float16",))`` runs a kernel over
a suite of cases and returns a :class:`Report`; ``cases(variant, suite)`` gives the
cases themselves; ``prepare(case, ...)`` the rounded inputs, golden output and
tolerance of one case. See ``docs/conformance.md``.

Module map (each module's docstring lists its extension points):

* :mod:`conformance.catalogue` - cases as data, suites, kernel features;
* :mod:`conformance.tolerance` - golden/baseline/floor tolerance model;
* :mod:`conformance.oracle` - ``verify``, kernel capability detection, semantics;
* :mod:`conformance.diagnose` - known mistake signatures tested on a failure;
* :mod:`conformance.extras` - extra outputs of a kernel (the log-sum-exp), judged and
  diagnosed on their own rows;
* :mod:`conformance.long` - goldens of the ``long`` suite on Dask;
* :mod:`conformance.report` - ``CaseResult``, ``Report`` (table, JSON);
* :mod:`conformance.vectors` - exported test vectors for other languages;
* :mod:`conformance.mutants` - deliberately broken kernels (the oracle's own test);
* :mod:`conformance.backends` - array libraries and host transfers;
* :mod:`conformance.cli` - ``attn-ref`` subcommands;
* :mod:`conformance.pytest_plugin` - ``pytest --attn-kernel ...``.

Importing this package is cheap: the names below load their module on first use,
so the pytest plugin (which loads in every pytest run) costs nothing until asked.
"""

from __future__ import annotations

import importlib

__all__ = ["verify", "session", "Session", "cases", "prepare", "Prepared", "Report", "CaseResult",
           "Case", "Tolerance", "export_vectors", "load_vectors"]

_LAZY = {
    "verify": "oracle",
    "prepare": "judging",
    "cases": "catalogue",
    "Case": "catalogue",
    "Report": "report",
    "CaseResult": "report",
    "Tolerance": "tolerance",
    "Prepared": "judging",
    "Session": "oracle",
    "session": "oracle",
    "export_vectors": "vectors",
    "load_vectors": "vectors",
}


def __getattr__(name):
    if name in _LAZY:
        mod = importlib.import_module(f".{_LAZY[name]}", __name__)
        return getattr(mod, name)
    raise AttributeError(f"module 'conformance' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
