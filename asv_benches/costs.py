"""The exponent of ``N`` in an analytic cost string such as ``"O(N (l + N/l) d)"``.

The registry (:mod:`attn_ref.registry`) states each variant's cost as text; the benchmark
suite (:mod:`asv_benches._common`) caps ``N`` by it and the scaling report
(:mod:`asv_benches.scaling`) holds fitted exponents against it. Both read it here.
"""

from __future__ import annotations

import re

__all__ = ["cost_exponent"]

_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d+)?)|([A-Za-z_][A-Za-z_0-9]*)|(.))")
_N_SYMBOLS = {"N", "Nq", "Nk", "N_q", "N_k", "n"}


class _CostParser:
    """Exponent of ``N`` in a cost such as ``"O(N (l + N/l) d)"``.

    Grammar: sums (``+``) take the largest exponent, products (juxtaposition, ``*``)
    add, quotients subtract, ``^`` multiplies; ``N``, ``Nq``, ``Nk`` count 1, other
    symbols (``d``, ``m``, ``w``...) are constants, ``log(...)`` counts 0 and
    ``sqrt(x)`` half of ``x``.
    """

    def __init__(self, text):
        self.toks = []
        for num, name, other in _TOKEN.findall(text):
            if num:
                self.toks.append(("num", float(num)))
            elif name:
                self.toks.append(("name", name))
            elif other.strip():
                self.toks.append(("op", other))
        self.i = 0
        self.mentions_n = False

    def peek(self):
        return self.toks[self.i] if self.i < len(self.toks) else (None, None)

    def take(self, kind=None, value=None):
        tok = self.peek()
        if tok[0] is None or (kind and tok[0] != kind) or (value and tok[1] != value):
            raise ValueError(f"unexpected {tok[1]!r}")
        self.i += 1
        return tok

    def expr(self):
        e = self.term()
        while self.peek() == ("op", "+"):
            self.take()
            e = max(e, self.term())
        return e

    def term(self):
        e = self.power()
        while True:
            kind, val = self.peek()
            if (kind, val) == ("op", "*"):
                self.take()
                e += self.power()
            elif (kind, val) == ("op", "/"):
                self.take()
                e -= self.power()
            elif kind in ("num", "name") or (kind, val) == ("op", "("):
                e += self.power()
            else:
                return e

    def power(self):
        base, number = self.atom()
        if self.peek() == ("op", "^"):
            self.take()
            _, exp_number = self.atom()
            if exp_number is None:
                raise ValueError("exponent must be a number")
            return base * exp_number
        return base

    def atom(self):
        kind, val = self.take()
        if kind == "num":
            return 0.0, val
        if kind == "name":
            if val in ("log", "sqrt") and (self.peek()[0] in ("num", "name")
                                           or self.peek() == ("op", "(")):
                inner, _ = self.atom()
                return (0.0 if val == "log" else inner / 2), None
            if val in _N_SYMBOLS:
                self.mentions_n = True
                return 1.0, None
            return 0.0, None
        if val == "(":
            e = self.expr()
            self.take("op", ")")
            return e, None
        raise ValueError(f"unexpected {val!r}")


def cost_exponent(cost: str) -> float | None:
    """The exponent of ``N`` in an analytic cost string, or None if it names no ``N``.

    >>> cost_exponent("O(N^2 d)"), cost_exponent("O(N (l + N/l) d)"), cost_exponent("O(N m d + m^3)")
    (2.0, 2.0, 1.0)
    >>> cost_exponent("O(N log N)"), cost_exponent("O(N sqrt(N) d)")
    (1.0, 1.5)
    >>> cost_exponent("O(nnz B^2 d)") is None
    True
    """
    text = cost.strip()
    m = re.fullmatch(r"O\s*\((.*)\)", text)
    if m:
        text = m.group(1)
    p = _CostParser(text.replace("²", "^2"))
    try:
        e = p.expr()
        if p.i != len(p.toks):
            raise ValueError("trailing text")
    except ValueError:
        return None
    return e if p.mentions_n else None


# --------------------------------------------------------------------------- fitting
