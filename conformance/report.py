"""Verdicts: one :class:`CaseResult` per case, dtype and output; a :class:`Report` of them.

``Report.table()`` is for people, ``Report.to_json(path)`` for machines. A report
passes when no case failed or errored, at least one case passed and the run was not
interrupted; cases the kernel cannot take are listed as ``n/a`` with the reason, never
counted as passed: the table's footer counts them by reason
(:meth:`Report.na_reasons`) and ``table(show_na=True)`` lists each one. Case ids are
printed whole, so a row can be pasted into ``attn-ref verify --case ID`` or ``pytest -k``.

The JSON of two identical runs is byte-identical except for the ``"timings"``
section (seconds per row, in the order of ``"results"``), which
``to_json(timings=False)`` / ``to_dict(timings=False)`` leave out; nothing else in
a report depends on the clock.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field

__all__ = ["CaseResult", "Report", "VERDICTS", "Progress", "na_reason", "jsonable", "worst_axes"]

VERDICTS = ("pass", "fail", "error", "n/a")


@dataclass
class CaseResult:
    """The verdict on one case, one dtype and one output (``"out"``, later ``"dq"``...).

    ``worst`` is the index ``(batch, head, query)`` of the largest error in the
    canonical ``(B, H, N, d)`` layout. ``ratio`` is ``max(max_err/tol_max, rms_err/tol_rms)``.
    ``precision`` is ``max_err`` over the max error of a plain implementation in the same
    dtype (fp32-accumulating in float16/bfloat16): ~1 rounds like one, >> 1 does not.
    """

    case: str
    dtype: str
    output: str = "out"
    verdict: str = "pass"
    max_err: float = float("nan")
    rms_err: float = float("nan")
    tol_max: float = float("nan")
    tol_rms: float = float("nan")
    ratio: float = float("nan")
    worst: tuple = ()
    diagnosis: str = ""
    baseline_max: float = float("nan")
    baseline_rms: float = float("nan")
    #: max_err over the max error of a plain (fp32-accumulating) implementation in the dtype
    precision: float = float("nan")
    shapes: dict = field(default_factory=dict)
    time_s: float = 0.0

    @classmethod
    def na(cls, *, reason, **kw):
        return cls(verdict="n/a", diagnosis=reason, **kw)

    @classmethod
    def error(cls, message, *, verdict="error", **kw):
        return cls(verdict=verdict, diagnosis=message, **kw)

    def unresolved(self, reason: str) -> None:
        """Make a pass n/a with ``reason`` where the bounds cannot tell the golden from
        zero (:func:`conformance.grads.prepare_grads`' ``"unresolved"``): a pass there says
        nothing. A fail, an error or an empty ``reason`` leave the row as it is."""
        if reason and self.verdict == "pass":
            self.verdict, self.diagnosis = "n/a", reason

    @property
    def ok(self) -> bool:
        return self.verdict in ("pass", "n/a")

    def to_dict(self, *, timings=True):
        """Plain JSON-able data; ``timings=False`` leaves out ``time_s``."""
        d = asdict(self)
        if not timings:
            del d["time_s"]
        d["worst"] = list(self.worst)
        d["shapes"] = {k: list(v) for k, v in self.shapes.items()}
        for k, v in d.items():
            if isinstance(v, float) and not math.isfinite(v):
                d[k] = None if math.isnan(v) else ("inf" if v > 0 else "-inf")
        return d


@dataclass
class Report:
    kernel: str = ""
    variant: str = ""
    backend: str = ""
    layout: str = "bhnd"
    dtypes: tuple = ()
    suite: str = "standard"
    seed: int = 0
    semantics: dict = field(default_factory=dict)
    features: list = field(default_factory=list)
    signature_known: bool = True
    results: list = field(default_factory=list)
    interrupted: str = ""  # why and where a KeyboardInterrupt stopped the run; "" if it ran to the end
    options: dict = field(default_factory=dict)  # variant options set by the caller

    @property
    def counts(self) -> dict:
        out = dict.fromkeys(VERDICTS, 0)
        for r in self.results:
            out[r.verdict] += 1
        return out

    @property
    def passed(self) -> bool:
        c = self.counts
        return c["fail"] == 0 and c["error"] == 0 and c["pass"] > 0 and not self.interrupted

    @property
    def failures(self) -> list:
        return [r for r in self.results if r.verdict in ("fail", "error")]

    def na_reasons(self) -> list:
        """``[(reason, count), ...]`` of the n/a results, most frequent first.

        The reason of a result is its message up to the first ``": "`` (the details
        after it - sizes, the exception text - vary from case to case).
        """
        counts: dict = {}
        for r in self.results:
            if r.verdict == "n/a":
                why = na_reason(r.diagnosis)
                counts[why] = counts.get(why, 0) + 1
        return sorted(counts.items(), key=lambda item: (-item[1], item[0]))

    def worst(self):
        """The ran result with the largest error/tolerance ratio (None if none ran)."""
        ran = [r for r in self.results if r.verdict != "n/a"]
        return max(ran, key=lambda r: (r.verdict != "pass", _key(r.ratio)), default=None)

    def summary(self) -> str:
        c = self.counts
        head = "PASS" if self.passed else "INTERRUPTED" if self.interrupted else "FAIL"
        tail = f" ({self.interrupted}; the run is incomplete)" if self.interrupted else ""
        return (f"{head}: {c['pass']} passed, {c['fail']} failed, {c['error']} errors, "
                f"{c['n/a']} not applicable{tail}")

    def table(self, *, show_na=False, width=None) -> str:
        """A fixed-width table, failures first, with the diagnosis under each.

        Case ids are never cut (the case column is as wide as the longest id shown, at
        least ``width``); n/a rows are listed only with ``show_na``, and counted by
        reason in the footer either way.
        """
        lines = [
            f"kernel {self.kernel}  variant {self.variant}  backend {self.backend}  "
            f"layout {self.layout}  suite {self.suite}  seed {self.seed}",
            "semantics: " + ", ".join(f"{k}={v}" for k, v in self.semantics.items())
            + "   features: " + (", ".join(self.features) or "none")
            + ("" if self.signature_known else "  (signature not introspectable)"),
        ]
        if self.options:
            lines.append("options: " + ", ".join(f"{k}={_show(v)}" for k, v in self.options.items()))
        shown = [r for r in self.results if show_na or r.verdict != "n/a"]
        width = max([len(r.case) for r in shown] + [width or 24, 4])
        hdr = f"{'case':<{width}} {'dtype':<8} {'out':<4} {'max err':>9} {'tol':>9} " \
              f"{'rms err':>9} {'tol rms':>9} {'ratio':>7} {'prec':>7}  verdict"
        lines += [hdr, "-" * len(hdr)]
        order = {"fail": 0, "error": 1, "pass": 2, "n/a": 3}
        rows = sorted(shown, key=lambda r: order[r.verdict])
        for r in rows:
            lines.append(
                f"{r.case:<{width}} {r.dtype:<8} {r.output:<4} {_e(r.max_err)} {_e(r.tol_max)} "
                f"{_e(r.rms_err)} {_e(r.tol_rms)} {_r(r.ratio)} {_r(r.precision)}  {r.verdict}"
            )
            if r.diagnosis and r.verdict != "pass":
                lines.append(f"    -> {r.diagnosis}")
                if r.worst:
                    lines.append(f"       worst at {worst_axes(r.output)} = {tuple(r.worst)}")
        lines.append(self.summary())
        reasons = self.na_reasons()
        if reasons:
            lines.append("not applicable, by reason" + ("" if show_na else
                         " (table(show_na=True) / --show-na lists them)") + ":")
            lines += [f"  {n:>4}  {why}" for why, n in reasons]
        return "\n".join(lines)

    def to_dict(self, *, timings=True) -> dict:
        """Plain JSON-able data. Seconds live only in the ``"timings"`` section (one entry
        per row of ``"results"``, same order), which ``timings=False`` leaves out."""
        d = {k: getattr(self, k) for k in ("kernel", "variant", "backend", "layout", "suite",
                                           "seed", "semantics", "features", "signature_known")}
        d["options"] = {k: jsonable(v) for k, v in self.options.items()}
        d["dtypes"] = list(self.dtypes)
        d["passed"] = self.passed
        d["interrupted"] = self.interrupted
        d["counts"] = self.counts
        d["results"] = [r.to_dict(timings=False) for r in self.results]
        if timings:
            d["timings"] = {"unit": "s", "results": [
                {"case": r.case, "dtype": r.dtype, "output": r.output, "time_s": r.time_s}
                for r in self.results]}
        return d

    def to_json(self, path=None, *, timings=True) -> str:
        """The report as JSON; written to ``path`` when given. Returns the text.

        With ``timings=False`` the text is byte-identical between identical runs."""
        text = json.dumps(self.to_dict(timings=timings), indent=1)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        return text


def worst_axes(output: str) -> str:
    """What the leading indices of a row's ``worst`` count: ``(batch, head, query)`` for
    the output, ``dq`` and the lse, ``(batch, head, key)`` for ``dk`` and ``dv``; the
    other gradients and the final state are indexed as their input is."""
    if output in ("dk", "dv"):
        return "(batch, head, key)"
    if output in ("out", "dq", "lse", "dlse", "dbias", ""):
        return "(batch, head, query)"
    return f"index of {output}"


def na_reason(message: str) -> str:
    """The reason of an n/a message: the text before the first ``": "``."""
    return message.split(": ", 1)[0].strip() or "(no reason given)"


def _show(x):
    """An option value as a person reads it: a function by its name."""
    if callable(x):
        name = getattr(x, "__qualname__", None) or type(x).__qualname__
        return f"{getattr(x, '__module__', None) or ''}.{name}".lstrip(".")
    return repr(x) if isinstance(x, str) else str(x)


def jsonable(x):
    """An option value for JSON, the same text on every run (no addresses)."""
    if isinstance(x, (bool, int, float, str)) or x is None:
        return x
    if isinstance(x, (list, tuple)):
        return [jsonable(y) for y in x]
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    return _show(x)


def _key(x):
    return -1.0 if x is None or (isinstance(x, float) and math.isnan(x)) else x


def _e(x):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return f"{'-':>9}"
    return f"{x:9.2e}"


def _r(x):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return f"{'-':>7}"
    if math.isinf(x):
        return f"{'inf':>7}"
    return f"{x:7.2f}"


class Progress:
    """``case i of n`` on a terminal once a run passes ~2 s; silent when piped or in CI."""

    def __init__(self, enabled=None, stream=None):
        self.stream = stream or sys.stderr
        if enabled is None:
            enabled = self.stream.isatty() and not os.environ.get("CI")
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self.shown = False

    def update(self, i, n, label):
        if self.enabled and time.perf_counter() - self.t0 > 2.0:
            self.stream.write(f"\r\x1b[K[{i}/{n}] {label}"[:200])
            self.stream.flush()
            self.shown = True

    def done(self):
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()

