"""Say why a kernel failed: test known mistake signatures against its output.

When a case fails, :func:`diagnose` tries, in order:

1. **Non-finite values**: NaN/Inf exactly on rows with no key to attend to (a
   fully-masked-row convention mismatch); or exactly on the rows where ``exp()``
   overflows (largest logit above ``ln(max)`` of the dtype) or underflows on every key
   (``0/0``: all logits below ``ln`` of the smallest subnormal, or far below a maximum
   taken over a tile of queries instead of the row), or where ``Q K^T`` itself exceeds
   float16's range (logits computed in float16); or elsewhere (rows counted).
2. **Mistake signatures** (:data:`SIGNATURES`): each builds, from the case's rounded
   inputs, the output a specific mistake would produce (scale ``1/d``, a scale off by a
   fitted factor, causal diagonal shifted by one, the other layout, keys and values
   swapped, a dropped tail key block, keys past a fixed buffer ignored, zero padding
   left unmasked, an online softmax that never rescales its accumulator, a
   denominator epsilon, Nystromformer's pseudo-inverse started from the other
   ``pinv_init``, strided views read as if contiguous (:mod:`conformance.noncontiguous`)...).
3. **Where the error lives**: only in the last partial query block, or only on some
   batch entries / heads (named), every other one within tolerance and ten times
   closer than the worst (so that rounding noise crossing the line on a few slices
   is not mistaken for a confined mistake).
4. **Precision**: for a float32/float64 kernel, an error the size of a plain
   float16/bfloat16 implementation's; for a float16/bfloat16 kernel, an error well past
   a plain fp32-accumulating implementation's in its dtype (the ``precision`` column)
   that matches one accumulating ``P V`` and the row sum in the dtype a few keys at a
   time, or (the recurrent family) one holding its state in the dtype or in bfloat16,
   rounded at every step: "accumulates in low precision". An error that grows with
   ``N`` faster than the plain one's (the kernel is re-run on the same case at ``N/4``)
   is said too, as a measurement: growth alone names no cause (a decay lost every 1024
   steps grows as well). For the
   recurrent family in float16/bfloat16 this comes before (3): a state held in the
   dtype errs most on the heads of longest memory, which (3) would report alone.

The rule: a diagnosis names a mistake only when the mistake reproduces what the kernel
did. For a signature (2) that is: the mistake changes the output on this case (its
output is off the golden by more than the tolerance), and the kernel's output is within
the case tolerance of the mistake's, or the mistake explains all but 1/50 of the
kernel's error (``max|got - mistake| <= max|got - golden| / 50``); a mistake whose
output is off by more than the RMS bound only, within the max bound, must explain all but
1/50 of it in both norms (a plain-precision difference such as logits rounded in the
dtype fails the RMS bound alone), or, for a signature whose mistakes change the function
and never only its rounding (``Signature.functional``: the log gates'), be within both
bounds of the kernel's output and leave at most half its RMS error; of several, the
closest is named, and with it every other that reproduces the output within tolerance
(they cannot be told apart on this case). For non-finite values (1), the rows the fault predicts must be
exactly the kernel's non-finite rows (up to rows within rounding of a threshold, and
``0/0`` rows a kernel that guards its division returns finite).
Localisations (3) are measurements, stated only when true. A mistake that explains
less is never named: the failure is then reported as unexplained, with its size and
place.

Extension point: append a :class:`Signature` to :data:`SIGNATURES` (or call
:func:`register_signature`). Its ``candidates(prep)`` yields ``(message, output)``
pairs, ``output`` in the canonical ``(B, H, Nq, dv)`` layout as float64; the gradient
checks and the GQA/window/chunk/varlen features add theirs the same way (a window off by
one, a chunk size off by one or chunks on the wrong positions, a wrong query-head ->
kv-head mapping, a varlen boundary leak).

Modules: :mod:`~conformance.diagnose.base` (:class:`Signature`, the registry, the host
softmax, the rule by which a mistake reproduces an output, the factor fit),
:mod:`~conformance.diagnose.classic` (the mistakes of any softmax kernel),
:mod:`~conformance.diagnose.modern` (GQA, windows, chunks, soft-cap, ALiBi, varlen, the
recurrent family, Nystromformer's pseudo-inverse), :mod:`~conformance.diagnose.conventions`
(third-party code computing another function on purpose) and
:mod:`~conformance.diagnose.driver` (:func:`diagnose` itself).
"""

from __future__ import annotations

from .base import SIGNATURES, Signature, register_signature, softmax_host
from .classic import CLASSIC, online_no_rescale
from .conventions import CONVENTIONS
from .driver import diagnose
from .modern import MODERN

__all__ = ["Signature", "SIGNATURES", "register_signature", "diagnose", "softmax_host",
           "online_no_rescale"]

# in this order: of mistakes that reproduce the output equally well, the first is named first
for _sig in (*CLASSIC, *MODERN, *CONVENTIONS):
    register_signature(_sig)
