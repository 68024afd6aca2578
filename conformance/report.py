"""Verdicts: one :class:`CaseResult` per case, dtype and output; a :class:`Report` of them.

``Report.table()`` is for people, ``Report.to_json(path)`` for machines. A report
passes when no case failed or errored and at least one case passed; cases the
kernel cannot take are listed as ``n/a`` with the reason, never counted as passed.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field

__all__ = ["CaseResult", "Report", "VERDICTS", "Progress"]

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

    @property
    def ok(self) -> bool:
        return self.verdict in ("pass", "n/a")

    def to_dict(self):
        d = asdict(self)
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

    @property
    def counts(self) -> dict:
        out = dict.fromkeys(VERDICTS, 0)
        for r in self.results:
            out[r.verdict] += 1
        return out

    @property
    def passed(self) -> bool:
        c = self.counts
        return c["fail"] == 0 and c["error"] == 0 and c["pass"] > 0

    @property
    def failures(self) -> list:
        return [r for r in self.results if r.verdict in ("fail", "error")]

    def worst(self):
        """The ran result with the largest error/tolerance ratio (None if none ran)."""
        ran = [r for r in self.results if r.verdict != "n/a"]
        return max(ran, key=lambda r: (r.verdict != "pass", _key(r.ratio)), default=None)

    def summary(self) -> str:
        c = self.counts
        head = "PASS" if self.passed else "FAIL"
        return (f"{head}: {c['pass']} passed, {c['fail']} failed, {c['error']} errors, "
                f"{c['n/a']} not applicable")

    def table(self, *, show_na=False, width=48) -> str:
        """A fixed-width table, failures first, with the diagnosis under each."""
        lines = [
            f"kernel {self.kernel}  variant {self.variant}  backend {self.backend}  "
            f"layout {self.layout}  suite {self.suite}  seed {self.seed}",
            "semantics: " + ", ".join(f"{k}={v}" for k, v in self.semantics.items())
            + "   features: " + (", ".join(self.features) or "none")
            + ("" if self.signature_known else "  (signature not introspectable)"),
        ]
        hdr = f"{'case':<{width}} {'dtype':<8} {'out':<4} {'max err':>9} {'tol':>9} " \
              f"{'rms err':>9} {'tol rms':>9} {'ratio':>7} {'prec':>7}  verdict"
        lines += [hdr, "-" * len(hdr)]
        order = {"fail": 0, "error": 1, "pass": 2, "n/a": 3}
        rows = sorted(self.results, key=lambda r: order[r.verdict])
        for r in rows:
            if r.verdict == "n/a" and not show_na:
                continue
            cid = r.case if len(r.case) <= width else r.case[: width - 1] + "~"
            lines.append(
                f"{cid:<{width}} {r.dtype:<8} {r.output:<4} {_e(r.max_err)} {_e(r.tol_max)} "
                f"{_e(r.rms_err)} {_e(r.tol_rms)} {_r(r.ratio)} {_r(r.precision)}  {r.verdict}"
            )
            if r.diagnosis and r.verdict != "pass":
                lines.append(f"    -> {r.diagnosis}")
                if r.worst:
                    lines.append(f"       worst at (batch, head, query) = {tuple(r.worst)}")
        lines.append(self.summary())
        return "\n".join(lines)

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("kernel", "variant", "backend", "layout", "suite",
                                           "seed", "semantics", "features", "signature_known")}
        d["dtypes"] = list(self.dtypes)
        d["passed"] = self.passed
        d["counts"] = self.counts
        d["results"] = [r.to_dict() for r in self.results]
        return d

    def to_json(self, path=None) -> str:
        """The report as JSON; written to ``path`` when given. Returns the text."""
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        return text


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

