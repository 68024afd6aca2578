"""Exported test vectors, for kernels tested outside Python (C++, CUDA, Rust, ...).

``export_vectors(DIR, "softmax", dtypes=("float16",))`` writes one ``.npz`` per case and
dtype plus ``DIR/manifest.json``. Each ``.npz`` (plain NumPy arrays, loadable without
pickle: ``np.load(path, allow_pickle=False)``, or cnpy / xtensor-io in C++) holds

* ``q``, ``k``, ``v`` - inputs in the kernel dtype and the manifest's layout
  (float16/float32/float64 natively; **bfloat16 as uint16 bit patterns**, the upper
  half of the float32 bits), C-contiguous as every stored array (no ``.npy`` header says
  ``fortran_order``). ``k`` and ``v`` may have batch 1 or one head where ``q`` has
  more, broadcast to ``q``'s (the ``broadcast:*`` cases, without ``options.gqa``), or
  with ``options.gqa`` fewer heads, each shared by ``H / H_kv`` query heads;
* ``mask`` (bool, True = may attend) and ``bias`` (kernel dtype) when the case has them,
  head-major ``(B|1, H|1, Nq|1, Nk)``: each leading dim and ``Nq`` may be 1 and
  broadcast to ``(B, H, Nq, Nk)`` (a padding mask is ``(B, 1, 1, Nk)``; ``(Nq|1, Nk)``
  for layout ``nd``); the entry's ``shapes`` gives each file's exact shape. The
  variant's extra parameters are under their own names;
* ``golden`` - float64, the expected output in the same layout (rows excluded by
  ``fully_masked="excluded"`` are NaN);
* ``compare`` - bool, which golden elements are compared;
* ``tol_rows`` - float64, the golden's shape with a last axis of 1: the largest error each
  output row may have on its own (absent where the baseline was unavailable; files
  written before it existed judge the case's bounds alone); ``tol_rows_dq``,
  ``tol_rows_dk``, ``tol_rows_dv`` likewise for those gradients (a query's ``dq``, a key's
  ``dk``; every dtype's cases, but float16 ones exported for a kernel declaring
  ``backward="fp32-accumulate"``: ``conformance.grads.ROW_DTYPES``,
  ``FUSED_ROW_DTYPES``), laid out as ``golden_dq``...;
* for the recurrent variants (``retention``, ``gla``, ``ssd``, ``deltanet``,
  ``gated_deltanet``): ``initial_state`` (kernel dtype, ``(N, H, d_k, d_v)``) when the
  case has one, ``golden_final_state`` - float64 ``(N, H, d_k, d_v)`` (``(d_k, d_v)``
  for layout ``nd``; N the batch, or the number of packed sequences of
  ``options.cu_seqlens``), the reference's final state, and ``tol_final_state`` - its
  per-element bound, same shape (:func:`check_final_state`).

Manifest schema, version 1
--------------------------
``manifest.json`` is one JSON object. A reader accepts the ``version`` it knows and
refuses any other; a later version changes the number only when a field below changes
meaning or goes away (new fields may appear in any version, and readers ignore fields
they do not know). Top level:

``format`` (str)
    Always ``"attn-ref-vectors"``.
``version`` (int)
    ``1``.
``variant`` (str)
    The :mod:`attn_ref.registry` name the golden was computed with.
``variant_options`` (object)
    The options of the variant's function the goldens were computed with: the
    registered defaults and those set with ``options=`` (``--option``, see
    :func:`conformance.judging.with_options`); a callable option is recorded by name.
``layout`` (str)
    ``"bhnd"``, ``"bnhd"`` or ``"nd"``: the layout of ``q``, ``k``, ``v``, ``golden``,
    ``compare``, ``tol_rows``, ``do`` and the ``golden_d*`` gradients of ``q``, ``k``, ``v``.
``semantics`` (object)
    The declared conventions (``fully_masked``, ``causal``; see
    :data:`conformance.judging.SEMANTICS`).
``suite`` (str), ``seed`` (int)
    Where the cases came from; the same pair exports the same inputs again.
``tolerance_model`` (object)
    Per dtype, the :class:`conformance.tolerance.Tolerance` factors the bounds were
    derived with (informative; the bounds themselves are per case).
``cases`` (list)
    One entry per exported case and dtype (below).
``skipped`` (list)
    ``{"id", "dtype", "reason"}`` of every case of the suite not exported: the
    reference cannot take it, its inputs are strided, layout ``nd`` cannot hold it
    (batch or heads above 1), or no value of its output can be judged by one golden.

Each entry of ``cases``:

``file`` (str)
    The ``.npz`` holding the case's arrays: a plain relative path inside the
    directory (no ``..``, not absolute, no symlink that leads out).
``id`` (str), ``dtype`` (str)
    The case id (as in ``--case`` and reports) and the kernel dtype: ``"float16"``,
    ``"bfloat16"``, ``"float32"`` or ``"float64"``.
``arrays`` (list of str)
    Exactly the names of the arrays in ``file``.
``storage`` (object)
    Array name -> NumPy dtype name of what is stored (``"uint16"`` for bfloat16 bit
    patterns, ``"bool"``, ``"float64"`` for goldens).
``shapes`` (object)
    Array name -> shape (list of int).
``causal``
    ``null``, ``"top-left"`` or ``"bottom-right"``.
``scale`` (float), ``default_scale`` (bool)
    The scale the golden was computed with (always given): the case's own, else the
    variant's default - ``1/sqrt(d)`` for the logits ``q . k``, but 1 for ``linear``,
    which multiplies its query features phi(q) by it; whether it is the variant's
    default (a kernel that takes no scale argument should then be called without one).
``params`` (object)
    The variant's plain parameters and options (arrays are in ``file`` under their
    own names). Where a parameter is a ``seed`` that NumPy's generator turns into a
    structure, the file also holds that structure (:func:`seeded_structures`): ``layout``
    for ``bigbird``, ``init_rows`` for ``clustered`` and ``clustered_topk``.
``options`` (object)
    The case's feature options: ``gqa``, ``window`` ``[left, right]`` with -1
    unbounded, ``chunk`` (Llama 4's chunk size), ``softcap``, ``dropout_p``,
    ``seqlens_q``/``seqlens_k``; the arrays ``alibi_slopes`` ``(H,)`` and
    ``dropout_mask`` ``(B, H, Nq, Nk)`` are in the file.
``outputs`` (list of str)
    The expected outputs in the file: ``"golden"``, plus ``"golden_dq"``,
    ``"golden_dk"``, ``"golden_dv"`` (``"golden_dbias"``; ``"golden_dg"``,
    ``"golden_dbeta"``, ``"golden_dinitial_state"`` for the recurrent family) with
    ``grads=True``, plus
    ``"golden_lse"`` (float64 ``(B, H, Nq)``, ``(Nq,)`` for ``nd``; ``-inf`` on rows
    that see no key) for the cases of ``suite="long"``, whose golden is computed once
    on Dask with its log-sum-exp (:mod:`conformance.long`), plus
    ``"golden_final_state"`` for the recurrent variants: a kernel called with
    ``output_final_state=True`` returns its final state ``S_T`` (fla's layout, ``S[i, j]``
    pairing key dim ``i`` with value dim ``j``), in float32 or the input's float64, and
    passes when ``|S_T - golden_final_state| <= tol_final_state`` at every element (a
    bound per element: :func:`conformance.extras.final_state_tolerance`, the oracle's own).
``tol_max_abs``, ``tol_rms`` (float)
    The bounds a kernel's max-abs and RMS errors over compared elements of the
    output must stay under; ``baseline_max_abs`` / ``baseline_rms`` (float or
    ``null``) are the plain implementation's errors they were derived from. The file's
    array ``tol_rows`` (float64, the output's shape with a last axis of 1; absent where
    the baseline was unavailable) bounds each output row's largest error on its own
    (:meth:`conformance.tolerance.Tolerance.row_bounds`): a row far smaller than the
    case's largest may not hide an error below the case's bound.
``output_tolerances`` (object)
    For each gradient output: its ``tol_max_abs``, ``tol_rms``,
    ``baseline_max_abs``, ``baseline_rms``, and ``unresolved`` (str, only where the
    golden gradient is within those bounds of zero, so that zeros would pass too:
    :func:`check_results` makes a pass of it an ``n/a`` row with that reason, as
    :func:`conformance.verify` does; a fail stays a fail).
``grads_not_judged`` (object, with ``grads=True``)
    Gradient row name (``"dq"``...; ``"grads"`` when the case has none) -> why its
    golden is not exported (ill-conditioned in the dtype, every value moved by a near
    tie): :func:`check_results` makes each an ``n/a`` row with that reason.
``golden_precision`` (str)
    ``"float64"``, or ``"longdouble"`` for float64 kernels.

A kernel passes a case when both errors are within bounds, no row's largest error is
above its ``tol_rows`` entry and it produced no NaN/Inf where the golden is finite, in
the case's dtype. With ``grads=True`` (CLI ``--grads``) each file also holds ``do``
(the output cotangent, kernel dtype) and ``golden_dq``/``golden_dk``/``golden_dv``
(``golden_dbias`` when the case has a bias; float64, ``dq`` rows excluded by
``fully_masked="excluded"`` are NaN), and for the recurrent family ``golden_dg``,
``golden_dbeta``, ``golden_dinitial_state`` as the case has them, plus
``dfinal_state`` (float32 for float16/bfloat16 cases, float64 for float64), the final
state's cotangent, which every golden gradient includes (:mod:`conformance.grads`).

:func:`load_vectors` checks all of this before handing an array out: the format and
version, every entry's required fields, every ``file`` inside the directory, and each
file's arrays against ``arrays``, ``storage`` and ``shapes``; a violation is a
``ValueError`` naming the file and what was expected.

Results files (:func:`check_results`)
-------------------------------------
A kernel tested outside Python may write its outputs back and let the oracle judge them
as it judges a kernel it calls: ``RESULTS/<file>``, an ``.npz`` named as the case's
vectors file, holding

* ``out`` - the output in the manifest's layout, stored as the kernel produced it:
  float16, float32, float64 natively, **bfloat16 as uint16 bit patterns** (as the
  inputs are; float16 may come as its uint16 bits too);
* ``out_dtype`` - a string (a 0-d ``str`` array, ``np.array("bfloat16")``): the dtype
  the kernel produced ``out`` in, which the stored array must hold (uint16 only for
  float16/bfloat16); added with this section, optional: a file without it (how a
  result widened to float32 or float64 was written before) is read as its array's
  dtype, and a uint16 array without it is refused (float16 or bfloat16 bits?);
* ``final_state`` (recurrent variants) - the kernel's final state, float32 or float64,
  ``(N, H, d_k, d_v)`` (``(d_k, d_v)`` for ``nd``). A file without it fails the case's
  ``final_state`` row, as :func:`conformance.verify` fails a kernel asked for its state
  that returns none; ``check_results(..., final_state=False)`` (CLI
  ``--no-final-state``) says the kernel returns no state, and the rows are ``n/a``;
* with vectors exported with ``grads=True``: each gradient the vectors hold a
  ``golden_d<name>`` of, under that row name (``dq``, ``dk``, ``dv``, ``dbias``, ``dg``,
  ``dbeta``, ``dinitial_state``), in its golden's layout and its input's dtype, stored
  and optionally tagged (``dq_dtype``...) as ``out`` is, an untagged ``uint16`` array
  read as the bits of its input's dtype (bfloat16 for a bfloat16 case). A file without one fails its
  row; ``check_results(..., grads=False)`` (CLI ``--no-grads``) makes the rows ``n/a``.

An output in another dtype than the case's fails, "out dtype float32, expected float16
(the inputs' dtype)", as the oracle fails a kernel it calls; so does an untagged wider
array whose values are not all numbers of the case's dtype (a half-precision kernel's
output widened is exact). The values are judged by the case's own golden and bounds,
and a failing output is diagnosed as :func:`conformance.verify` diagnoses it (a
truncating half-precision store: "the output is rounded toward zero (truncated)"),
where the case can be prepared again (its id in the catalogue, the variant's options
plain values); otherwise by the file's golden and bounds, undiagnosed. The final state
likewise: judged and diagnosed as verify judges it ("the state before the last token's
update", "the state transposed"), or by :func:`check_final_state` alone.

A results file that cannot be read (not a zip, truncated, a bare ``.npy``, no ``out``,
a tag that is not a dtype) is an ``error`` row of its case naming the file, and an
output or final state of the wrong shape a ``fail`` row naming both shapes: the other
cases are judged all the same.
"""

from __future__ import annotations

import json
import os
import zipfile
import zlib

import numpy as np

from .catalogue import cases as _cases
from .extras import EXTRAS, RECURRENT, final_state_golden, final_state_tolerance
from .features import NotApplicable
from .judging import parse_semantics, prepare, verdict_of, with_options, worst_of
from .layouts import from_layout, to_layout
from .report import jsonable
from .ties import SETTLED_SHARE, settled
from .tolerance import DEFAULTS, MANTISSA_BITS, bf16_round, measure, param_dtype, round_to

__all__ = ["export_vectors", "load_vectors", "check_final_state", "check_results", "read_result",
           "seeded_structures", "FORMAT", "VERSION", "READABLE_VERSIONS", "ENTRY_FIELDS"]

FORMAT, VERSION = "attn-ref-vectors", 1


def _store(x: np.ndarray, dtype: str) -> np.ndarray:
    if x.dtype == np.bool_:
        return np.ascontiguousarray(x)
    if dtype == "bfloat16":
        # astype keeps the memory order of a swapped-axes view: with d = 1 under bnhd
        # that is Fortran order, which a C reader ignoring fortran_order reads permuted
        return np.ascontiguousarray((bf16_round(x).view(np.uint32) >> 16).astype(np.uint16))
    return np.ascontiguousarray(x, dtype=np.dtype(dtype))


def _restore(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16" and x.dtype == np.uint16:
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x


def export_vectors(directory, variant="softmax", /, *, dtypes=("float32",), layout="bhnd",
                   suite="standard", seed=0, cases=None, grads=False, options=None,
                   **semantics) -> dict:
    """Write the cases of ``suite`` as ``.npz`` files plus ``manifest.json``; return the manifest.

    ``options`` sets options of the variant's function (``{"feature_map": "identity"}``);
    the goldens and tolerances follow and the manifest records them.
    """
    sem = parse_semantics(semantics)
    variant = with_options(variant, options)
    os.makedirs(directory, exist_ok=True)
    todo = list(cases) if cases is not None else [
        c for c in _cases(None, suite) if c.belongs_to(variant)]
    entries, skipped = [], []
    for dt in dtypes:
        for i, case in enumerate(todo):
            if layout == "nd" and (case.batch != (1, 1) or case.kv_batch is not None):
                kv = f", k/v {case.kv_batch[0]}x{case.kv_batch[1]}" if case.kv_batch else ""
                skipped.append({"id": case.id, "dtype": dt, "reason": (
                    f"layout nd holds one batch entry of one head; the case has "
                    f"B={case.batch[0]}, H={case.batch[1]}{kv} (export it as bhnd or bnhd)")})
                continue
            if "noncontiguous" in case.needs:
                # a file holds contiguous arrays: this case would be its plain twin
                skipped.append({"id": case.id, "dtype": dt, "reason": "strided inputs: the "
                                "vectors hold contiguous arrays (strides are checked by verify)"})
                continue
            try:
                prep = prepare(case, variant, dt, seed, **sem)
            except NotApplicable as exc:
                skipped.append({"id": case.id, "dtype": dt, "reason": str(exc)})
                continue
            fname = f"{i:03d}_{dt}.npz"
            arrays = {}
            for n, a in prep.arrays.items():
                arrays[n] = _store(to_layout(a, layout) if n in ("q", "k", "v")
                                   else (a[0, 0] if layout == "nd" else a), dt)
            for n, a in prep.params.items():
                if isinstance(a, np.ndarray):
                    arrays[n] = _store(a, param_dtype(n, dt))
            arrays.update(seeded_structures(prep))
            keep = np.ones(prep.golden.shape, bool) if prep.keep is None else np.array(prep.keep)
            # values a near tie's other admissible choice changes (by more than a
            # hundredth of the bound) are not compared: a consumer of one golden cannot
            # judge them (conformance.ties)
            keep = keep & settled(prep.golden.shape, prep.ties,
                                  SETTLED_SHARE * min(prep.tol_max, prep.tol_rms))
            if not keep.any():
                # a file comparing nothing would pass any kernel
                skipped.append({"id": case.id, "dtype": dt, "reason": (
                    "every output value is one that another admissible choice at a near "
                    "tie moves (conformance.ties): one golden cannot judge it; verify, "
                    "which judges each choice, can")})
                continue
            golden = np.where(keep, prep.golden, np.nan)
            arrays["golden"] = np.ascontiguousarray(to_layout(golden, layout))
            arrays["compare"] = np.ascontiguousarray(to_layout(keep, layout))
            if prep.tol_rows is not None:
                arrays["tol_rows"] = np.ascontiguousarray(to_layout(prep.tol_rows[..., None], layout))
            outputs, grad_tols, not_judged = ["golden"], {}, None
            if grads:
                outputs, grad_tols, not_judged = _add_grads(prep, arrays, layout, dt)
            if variant.name in RECURRENT:
                outputs = outputs + _add_final_state(prep, arrays, layout)
            if "lse" in prep.golden_extras:
                # a long case's row log-sum-exp came with its golden (one Dask run): kept
                lse = prep.golden_extras["lse"]
                arrays["golden_lse"] = np.ascontiguousarray(lse[0, 0] if layout == "nd" else lse)
                outputs = outputs + ["golden_lse"]
            np.savez(os.path.join(directory, fname), **arrays)
            entries.append({
                "file": fname,
                "id": case.id,
                "dtype": dt,
                "storage": {n: str(a.dtype) for n, a in arrays.items()},
                "shapes": {n: list(a.shape) for n, a in arrays.items()},
                # None for a case that is not causal, also where the reference is told
                # causal=False explicitly (strided, fixed: causal by default)
                "causal": prep.kwargs.get("causal") or None,
                "scale": _reference_scale(prep),
                "default_scale": prep.kwargs.get("scale") is None,
                "params": {n: p for n, p in prep.params.items() if not isinstance(p, np.ndarray)}
                | {n: p for n, p in prep.options.items()},
                # the case's other plain reference options: gqa, window, chunk, softcap,
                # dropout_p, seqlens_q/seqlens_k (see conformance.catalogue.FEATURES)
                "options": {n: list(x) if isinstance(x, tuple) else x
                            for n, x in prep.kwargs.items() if n not in ("causal", "scale")},
                "arrays": sorted(arrays),
                "outputs": outputs,
                "output_tolerances": grad_tols,
                **({} if not_judged is None else {"grads_not_judged": not_judged}),
                "tol_max_abs": prep.tol_max,
                "tol_rms": prep.tol_rms,
                "baseline_max_abs": prep.baseline.max_err if prep.baseline else None,
                "baseline_rms": prep.baseline.rms_err if prep.baseline else None,
                "golden_precision": prep.golden_dtype,
            })
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "variant": variant.name,
        "variant_options": {n: jsonable(x) for n, x in variant.options.items()},
        "layout": layout,
        "semantics": sem,
        "suite": suite,
        "seed": seed,
        "tolerance_model": {dt: DEFAULTS[dt].to_dict() for dt in dtypes},
        "cases": entries,
        "skipped": skipped,
    }
    with open(os.path.join(directory, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    return manifest


def _reference_scale(prep) -> float:
    """The scale the reference computed the golden with: the case's own, else the
    variant's default. ``prep.scale`` is softmax's ``1/sqrt(d)`` for every variant, but
    linear attention multiplies phi(q) by a scale of 1 by default (the normalised output
    does not depend on it; ``normalize=False``'s does)."""
    if prep.kwargs.get("scale") is None and prep.variant.family == "linear":
        from attn_ref.linear.options import check_scale

        return check_scale(None)
    return prep.scale


def seeded_structures(prep) -> dict:
    """The host-side structures a variant draws from its ``seed`` with NumPy's generator.

    BigBird's random blocks and the clustered variants' initial k-means centroids are a
    function of ``seed`` through ``numpy.random.default_rng(seed).permutation``, which a
    C++/CUDA test cannot reproduce; the vectors carry what was drawn instead:
    ``layout`` (bool ``(ceil(N / block_size),) * 2``, ``layout[a, b]``: query block ``a``
    attends key block ``b``) for ``bigbird``, ``init_rows`` (int64 ``(num_clusters,)``:
    the query rows that are the initial centroids, the same in every batch entry and
    head) for ``clustered`` and ``clustered_topk``.
    """
    name, p = prep.variant.name, {**prep.params, **prep.options}
    if name == "bigbird":
        from attn_ref.sparse import bigbird_layout

        nb = -(-prep.case.nk // p["block_size"])
        return {"layout": np.array(bigbird_layout(
            nb, window=p["window"], global_blocks=p["global_blocks"],
            random_blocks=p["random_blocks"], seed=p["seed"],
            last_global_blocks=p.get("last_global_blocks", 0)), dtype=bool).reshape(nb, nb)}
    if name in ("clustered", "clustered_topk"):
        from attn_ref.reduced import kmeans_initial_rows

        rows = kmeans_initial_rows(prep.case.nq, p["num_clusters"], p.get("seed", 0))
        return {"init_rows": np.asarray(rows, dtype=np.int64)}
    return {}


def _add_final_state(prep, arrays, layout):
    """``golden_final_state`` and its per-element bound ``tol_final_state`` (both float64,
    ``(N, H, d_k, d_v)``, ``(d_k, d_v)`` for ``nd``) into ``arrays``: the final state
    judged as :func:`conformance.extras.final_state_tolerance` judges it, for a kernel
    that returns its state in float32 (fla's convention) or its float64 input dtype."""
    golden = final_state_golden(prep)
    tol = final_state_tolerance(prep, golden)
    for name, x in (("golden_final_state", golden), ("tol_final_state", tol)):
        arrays[name] = np.ascontiguousarray(x[0, 0] if layout == "nd" else x, dtype=np.float64)
    return ["golden_final_state"]


def check_final_state(entry, arrays, state):
    """Judge a kernel's final state against an exported case: ``(passed, max_err, ratio)``.

    ``entry, arrays`` as :func:`load_vectors` yields them; ``state`` the kernel's final
    state, ``(N, H, d_k, d_v)`` (``(d_k, d_v)`` for layout ``nd``), N the batch or the
    number of packed sequences (``options.cu_seqlens``). It passes when every element is
    finite and within its own bound: ``|state - golden_final_state| <= tol_final_state``
    elementwise; ``ratio`` is the largest ``error / bound``. A state of another shape (a
    transposed ``d_v x d_k`` one) is a ``ValueError`` naming both shapes.
    """
    if "golden_final_state" not in arrays:
        raise ValueError(f"case {entry.get('id')!r} has no final-state golden (only the recurrent "
                         f"variants' vectors do; outputs: {entry.get('outputs')})")
    golden, tol = arrays["golden_final_state"], arrays["tol_final_state"]
    state = np.asarray(state, dtype=np.float64)
    if state.shape != golden.shape:
        raise ValueError(f"final state of case {entry.get('id')!r}: expected shape {golden.shape} "
                         f"(N, H, d_k, d_v), got {state.shape}")
    finite = np.isfinite(state)
    err = np.where(finite, np.abs(state - golden), np.inf)
    ratio = float(np.max(err / np.maximum(tol, np.finfo(float).tiny), initial=0.0))
    return bool(np.all(finite) and ratio <= 1.0), float(np.max(err, initial=0.0)), ratio


def _add_grads(prep, arrays, layout, dtype):
    """``do`` (kernel dtype) and ``golden_dq``... (float64) into ``arrays``; their bounds."""
    from .grads import JUDGED, grad_output, prepare_grads

    try:
        # the recurrent family returns its final state (golden_final_state): its cotangent
        # dfinal_state is part of the backward, as fla's kernels take dht
        g = prepare_grads(prep, final_state=prep.variant.name in RECURRENT)
    except NotApplicable as exc:
        return ["golden"], {}, {"grads": str(exc)}
    arrays["do"] = _store(to_layout(g["do"], layout), dtype)
    if "dfinal_state" in g:
        ds = g["dfinal_state"]
        arrays["dfinal_state"] = np.asarray(ds[0, 0] if layout == "nd" else ds,
                                            dtype=np.float64 if dtype == "float64" else np.float32)
    outputs, tols, not_judged = ["golden"], {}, {}
    # every gradient the reference returns: q, k, v, then the other inputs in the file
    # (bias, initial_state: head-major; the variant's parameters: as generated)
    for n in [n for n in ("q", "k", "v") if n in g] + sorted(
            n for n in g if n not in ("q", "k", "v", "do", "dfinal_state")
            and n in JUDGED and (n in prep.arrays or isinstance(prep.params.get(n), np.ndarray))):
        if n in g.get("ill", {}):
            # no bound derives from the plain implementation: not exported, and the
            # manifest says why (check_results makes it an n/a row, as verify does)
            not_judged[grad_output(n)] = g["ill"][n]
            continue
        gold, keep, tmax, trms, bm = g[n]
        name = "golden_" + grad_output(n)
        fixed = settled(gold.shape, g["ties"].get(n, []), SETTLED_SHARE * min(tmax, trms))
        keep = fixed if keep is None else keep & fixed
        if not keep.any():  # nothing a single golden can judge: not exported, as an ill one
            not_judged[grad_output(n)] = _TIES_ONLY
            continue
        gold = np.where(keep, gold, np.nan)
        head_major = n in prep.arrays and n not in ("q", "k", "v")

        def stored(x, head_major=head_major, n=n):
            return np.ascontiguousarray((x[0, 0] if layout == "nd" else x) if head_major else
                                        x if n not in ("q", "k", "v") else to_layout(x, layout))

        arrays[name] = stored(gold)
        if n in g.get("rows", {}):
            # each row's own bound (conformance.tolerance.Tolerance.row_bounds), laid out as the gradient
            arrays["tol_rows_" + grad_output(n)] = stored(g["rows"][n][..., None])
        outputs.append(name)
        tols[name] = {"tol_max_abs": tmax, "tol_rms": trms,
                      "baseline_max_abs": bm.max_err if bm else None,
                      "baseline_rms": bm.rms_err if bm else None}
        if n in g.get("unresolved", {}):
            # within the bounds of zero: a pass there reads n/a (CaseResult.unresolved)
            tols[name]["unresolved"] = g["unresolved"][n]
    return outputs, tols, not_judged


_TIES_ONLY = ("every value is one that another admissible choice at a near tie moves "
              "(conformance.ties): one golden cannot judge it; verify, which judges each "
              "choice, can")


# how each kernel dtype is stored (bfloat16 as its bit patterns; NumPy has no bfloat16)
_STORAGE = {"float16": "float16", "bfloat16": "uint16", "float32": "float32",
            "float64": "float64"}
#: Manifest versions this reader understands.
READABLE_VERSIONS = (1,)
#: Fields every case entry must have for :func:`load_vectors`.
ENTRY_FIELDS = ("file", "id", "dtype", "arrays", "storage", "shapes")


def load_vectors(directory):
    """``(entry, arrays)`` for each exported case; bfloat16 comes back as float32.

    The manifest is checked when this is called (format, version, fields, that every
    ``file`` lies inside ``directory``), each ``.npz`` when its case is reached (its
    arrays against the entry's ``arrays``, ``storage`` and ``shapes``). Raises
    ``ValueError`` naming the file and what was expected.
    """
    manifest, files = _read_manifest(directory)
    return _arrays(manifest["cases"], files)


def _read_manifest(directory):
    """``(manifest, files)``: the checked manifest of ``directory`` and the real path of
    each case's file (:func:`load_vectors`'s checks, raising as it does)."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a path, got {type(directory).__name__}")
    directory = os.fspath(directory)
    path = os.path.join(directory, "manifest.json")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{directory} does not hold attn-ref vectors: no manifest.json") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    _check_manifest(manifest, path)
    root = os.path.realpath(directory)
    files = [_inside(root, entry["file"], path, i) for i, entry in enumerate(manifest["cases"])]
    return manifest, files


def _arrays(entries, files):
    for entry, file in zip(entries, files):
        with np.load(file, allow_pickle=False) as z:
            arrays = {n: z[n] for n in z.files}
        _check_arrays(entry, arrays, file)
        yield entry, {n: _restore(a, entry["dtype"]) for n, a in arrays.items()}


def _check_manifest(manifest, path):
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is not an attn-ref vectors manifest (expected \"format\": "
                         f"{FORMAT!r})")
    version = manifest.get("version")
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        raise ValueError(f"{path} has manifest version {version!r}; this attn-ref reads version "
                         f"{', '.join(map(str, READABLE_VERSIONS))} (a newer attn-ref wrote it? "
                         "upgrade, or export the vectors again)")
    if not isinstance(manifest.get("cases"), list):
        raise ValueError(f"{path}: \"cases\" must be a list, got {type(manifest.get('cases')).__name__}")
    for i, entry in enumerate(manifest["cases"]):
        where = f"{path}: cases[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be an object, got {type(entry).__name__}")
        missing = [k for k in ENTRY_FIELDS if k not in entry]
        if missing:
            raise ValueError(f"{where} lacks {missing} (every case has {list(ENTRY_FIELDS)})")
        if entry["dtype"] not in _STORAGE:
            raise ValueError(f"{where}: dtype {entry['dtype']!r}, expected one of {sorted(_STORAGE)}")
        names = entry["arrays"]
        if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise ValueError(f"{where}: \"arrays\" must be a list of names, got {names!r}")
        for key in ("storage", "shapes"):
            if not isinstance(entry[key], dict) or sorted(entry[key]) != sorted(names):
                got = sorted(entry[key]) if isinstance(entry[key], dict) else entry[key]
                raise ValueError(f"{where}: \"{key}\" must name exactly the arrays {sorted(names)}, "
                                 f"got {got!r}")
        for n in ("q", "k", "v"):
            want = _STORAGE[entry["dtype"]]
            if n in names and entry["storage"][n] != want:
                raise ValueError(f"{where}: {n} of a {entry['dtype']} case must be stored as "
                                 f"{want}, the manifest says {entry['storage'][n]!r}")



def _inside(root, file, path, i):
    """The real path of a case file, which must lie inside the vectors directory."""
    where = f"{path}: cases[{i}] file {file!r}"
    if not isinstance(file, str) or not file:
        raise ValueError(f"{where}: expected a relative path to an .npz file")
    if os.path.isabs(file) or file.startswith(("/", "\\")) or os.path.splitdrive(file)[0]:
        raise ValueError(f"{where} is an absolute path; expected a path inside {root}")
    real = os.path.realpath(os.path.join(root, file))
    if os.path.commonpath([root, real]) != root:
        raise ValueError(f"{where} resolves to {real}, outside the vectors directory {root} "
                         "(.. or a symlink leading out)")
    if not os.path.isfile(real):
        raise ValueError(f"{where}: no such file in {root}")
    return real


def _check_arrays(entry, arrays, file):
    got, want = sorted(arrays), sorted(entry["arrays"])
    if got != want:
        raise ValueError(f"{file}: holds arrays {got}, the manifest lists {want} "
                         f"(missing {sorted(set(want) - set(got))}, "
                         f"unexpected {sorted(set(got) - set(want))})")
    for n, a in arrays.items():
        if str(a.dtype) != entry["storage"][n]:
            raise ValueError(f"{file}: array {n!r} is stored as {a.dtype}, the manifest says "
                             f"{entry['storage'][n]}")
        if list(a.shape) != list(entry["shapes"][n]):
            raise ValueError(f"{file}: array {n!r} has shape {tuple(a.shape)}, the manifest says "
                             f"{tuple(entry['shapes'][n])}")


# ------------------------------------------------------------------ results written back

_RESULT_STORAGE = {"float16": ("float16", "uint16"), "bfloat16": ("uint16",),
                   "float32": ("float32",), "float64": ("float64",)}


def read_result(file):
    """``(out, out_dtype, final_state)`` of one results file (module docstring): ``out``
    widened to float64 as stored, ``out_dtype`` the dtype the kernel produced it in (the
    tag, or for an untagged file the array's dtype), ``final_state`` or None.

    Raises ``ValueError`` naming the file for a file that cannot be read as an ``.npz``
    archive (not a zip, truncated, a bare ``.npy``), one without ``out``, a tag that is
    not a dtype, a stored array the tag does not allow, or an untagged uint16 array.
    """
    out, tag, _, state = _read_result(file)
    return out, tag, state


# what reading a damaged file raises: not a zip, truncated, a bad CRC or header, a
# pickled array (NumPy's messages do not name the file)
_UNREADABLE = (OSError, EOFError, ValueError, zipfile.BadZipFile, zlib.error)


def _unreadable(file, exc):
    return ValueError(f"{file}: cannot be read as an .npz archive of .npy arrays "
                      f"({type(exc).__name__}: {exc})")


def _read_result(file, held=None):
    """:func:`read_result`'s ``(out, out_dtype, tagged, final_state)``, ``tagged`` whether
    the file holds ``out_dtype``; ``held``: the file's arrays if already read
    (:func:`_result_arrays`)."""
    held = _result_arrays(file) if held is None else held
    if "out" not in held:
        raise ValueError(f"{file}: no array 'out' (holds {sorted(held)})")
    out, tag, tagged = _decode(file, "out", held)
    return out, tag, tagged, held.get("final_state")


def _result_arrays(file):
    """Every array of one results file, by name; ``ValueError`` naming the file if it is
    not an ``.npz`` archive of ``.npy`` arrays."""
    try:
        z = np.load(file, allow_pickle=False)
    except _UNREADABLE as exc:
        raise _unreadable(file, exc) from None
    if not hasattr(z, "files"):  # a bare .npy loads as the array itself
        raise ValueError(f"{file}: not an .npz archive but a single .npy array (saved under the "
                         ".npz name?); write a zip of .npy files, as numpy.savez does")
    try:
        with z:
            return {n: z[n] for n in z.files}
    except _UNREADABLE as exc:
        raise _unreadable(file, exc) from None


def _decode(file, name, held, bits=None):
    """``(values, dtype, tagged)`` of the result ``name`` (``out``, or a gradient ``dq``...)
    of a results file's arrays ``held``: widened to float64 as stored, with the dtype the
    kernel produced it in (its tag ``<name>_dtype``, else the stored dtype) and whether
    it was tagged. ``ValueError`` naming the file for a tag that is not a dtype, a stored
    array the tag does not allow, or an untagged uint16 array - unless ``bits`` says
    whose bits an untagged uint16 array holds (a gradient: its input's, as stored)."""
    arr = held[name]
    raw = held.get(f"{name}_dtype")
    tag = None if raw is None else str(raw)
    stored = str(arr.dtype)
    if tag is None and stored == "uint16" and bits in ("float16", "bfloat16"):
        tag = bits
    if tag is None:
        if stored not in ("float16", "float32", "float64"):
            raise ValueError(f"{file}: {name!r} is stored as {stored} without an '{name}_dtype' tag"
                             + (f" (float16 or bfloat16 bits? add {name}_dtype)" if stored == "uint16"
                                else "; expected float16, float32 or float64 (or uint16 bits "
                                     "tagged float16 or bfloat16)"))
        tag = stored
    elif tag not in _RESULT_STORAGE:
        raise ValueError(f"{file}: {name}_dtype {tag!r}, expected one of {sorted(_RESULT_STORAGE)}")
    elif stored not in _RESULT_STORAGE[tag]:
        raise ValueError(f"{file}: {name!r} is stored as {stored}, which cannot hold {name}_dtype "
                         f"{tag} (expected {' or '.join(_RESULT_STORAGE[tag])})")
    if stored == "uint16":
        arr = (arr.astype(np.uint32) << 16).view(np.float32) if tag == "bfloat16" else \
            arr.view(np.float16)
    return np.asarray(arr, dtype=np.float64), tag, raw is not None


def _stored_dtype_problem(entry, out, tag, tagged, name="out", want=None):
    """Why the stored result ``name`` is not in the dtype ``want`` (default the case's;
    the oracle's words), or ''."""
    want = want or entry["dtype"]
    if tag != want:
        if tagged or MANTISSA_BITS.get(tag, 99) < MANTISSA_BITS[want]:
            return f"{name} dtype {tag}, expected {want} (the inputs' dtype)"
        # an untagged wider array: a widened result of the case's dtype is exact
        finite = out[np.isfinite(out)]
        off = int(np.count_nonzero(round_to(finite, want) != finite))
        if off:
            return (f"{name} dtype {want} expected (the inputs' dtype): the untagged {tag} "
                    f"{name} holds {off} values that are not {want} numbers, so the kernel did "
                    f"not store it in {want}")
    return ""


def _prepared(manifest, entry, by_id):
    """The case prepared again as the oracle prepares it, or None where it cannot be (an
    id not in the catalogue, an option recorded by name, another golden)."""
    case = by_id.get(entry["id"])
    if case is None:
        return None
    try:
        variant = with_options(manifest["variant"], manifest.get("variant_options") or None)
        prep = prepare(case, variant, entry["dtype"], manifest.get("seed", 0),
                       **manifest.get("semantics", {}))
    except Exception:
        return None
    return prep


def check_results(vectors, results, *, final_state=True, grads=True):
    """Judge the outputs a kernel wrote back (``results``, module docstring) against the
    exported ``vectors``: a :class:`conformance.report.Report`, one ``out`` row per case
    (and ``final_state`` for the recurrent variants), with the verdicts and diagnoses
    :func:`conformance.verify` gives a kernel it calls.

    Every problem of one results file is a row of its case, naming the file, and the
    other cases are judged all the same: a case without a results file, or with one that
    cannot be read (:func:`read_result`), is an ``error`` row; an output or final state
    of the wrong shape a ``fail`` row naming both shapes.

    Where the vectors hold ``golden_final_state``, the kernel must write ``final_state``,
    as :func:`conformance.verify` asks a kernel for its state: a file without it fails
    that case's ``final_state`` row. ``final_state=False`` says the kernel returns no
    state (verify's ``supports={"final_state": False}``; CLI ``--no-final-state``): the
    rows are then ``n/a``, counted by reason under the table. A final state is judged as
    verify judges it, diagnosed where the case can be prepared again (as for ``out``),
    else by the file's golden and per-element bound (:func:`check_final_state`).

    Vectors exported with gradients (``grads=True``, ``--grads``) are judged likewise: one
    row per ``golden_d*`` of the case, the results file's ``dq``, ``dk``... against it
    within the entry's ``output_tolerances``, the elements the golden leaves NaN not
    compared, each gradient in the dtype of its input (a ``<name>_dtype`` tag as for
    ``out``); a missing gradient fails its row, a softmax gradient that fails is
    diagnosed as verify diagnoses it, and the gradients the manifest lists under
    ``grads_not_judged`` are n/a rows with its reason. ``grads=False`` (CLI
    ``--no-grads``) says the kernel computes no gradients: those rows are n/a.
    """
    from .catalogue import CATALOGUE
    from .report import Report

    manifest, files = _read_manifest(vectors)  # checked before any results file is read
    by_id = {c.id: c for suite in CATALOGUE.values() for c in suite}
    layout = manifest["layout"]
    rows = []
    for entry, arrays in _arrays(manifest["cases"], files):
        file = os.path.join(os.fspath(results), entry["file"])
        rows += _judge_file(manifest, entry, arrays, file, by_id, final_state, grads)
    return Report(kernel=f"results in {os.fspath(results)}", variant=manifest["variant"],
                  backend="vectors", layout=layout,
                  dtypes=tuple(dict.fromkeys(e["dtype"] for e in manifest["cases"])),
                  suite=manifest.get("suite", ""), seed=manifest.get("seed", 0),
                  semantics=manifest.get("semantics", {}), results=rows)


def _judge_file(manifest, entry, arrays, file, by_id, final_state, grads):
    """The rows of one case's results ``file``: ``out``, ``final_state`` where the
    vectors hold its golden, and a row per gradient of vectors exported with them."""
    from .diagnose import diagnose
    from .report import CaseResult

    base = {"case": entry["id"], "dtype": entry["dtype"]}
    layout = manifest["layout"]
    if not os.path.isfile(file):
        return [CaseResult.error(f"no results file {file}", **base)]
    try:
        held = _result_arrays(file)
        out, tag, tagged, state = _read_result(file, held)
    except ValueError as exc:
        return [CaseResult.error(str(exc), **base)]
    prep = _prepared(manifest, entry, by_id)
    keep = ... if prep is None or prep.keep is None else prep.keep
    if prep is not None and not np.array_equal(
            prep.golden[keep], from_layout(arrays["golden"], layout)[keep]):
        prep = None  # another golden than the file's: judged by the file alone
    if out.shape != arrays["golden"].shape:
        rows = [CaseResult.error(f"out has shape {out.shape}, expected "
                                 f"{arrays['golden'].shape} (layout {layout})",
                                 verdict="fail", **base)]
    else:
        rows = [_judge_out(entry, arrays, out, tag, tagged, prep, layout, base, diagnose)]
    if "golden_final_state" in arrays:
        rows.append(_judge_state(entry, arrays, state, prep, layout, file, base, final_state))
    return rows + _judge_grads(entry, arrays, held, prep, layout, file, base, grads)


def _judge_out(entry, arrays, out, tag, tagged, prep, layout, base, diagnose):
    from .report import CaseResult

    got = from_layout(out, layout)
    if prep is not None:
        res = prep.check(got)
    else:
        golden = from_layout(arrays["golden"], layout)
        keep = from_layout(arrays["compare"], layout)
        rows = from_layout(arrays["tol_rows"], layout) if "tol_rows" in arrays else None
        m = measure(got, np.where(keep, golden, 0.0), keep, rows)
        verdict, why, ratio = verdict_of(m, entry["tol_max_abs"], entry["tol_rms"])
        res = CaseResult(max_err=m.max_err, rms_err=m.rms_err, tol_max=entry["tol_max_abs"],
                         tol_rms=entry["tol_rms"], ratio=ratio,
                         worst=worst_of(m, entry["tol_max_abs"], entry["tol_rms"]),
                         verdict=verdict, diagnosis=why, **base)
    problem = _stored_dtype_problem(entry, out, tag, tagged)
    if problem:
        res.verdict = "fail"
        res.diagnosis = "; ".join(w for w in (problem, res.diagnosis) if w)
    elif res.verdict == "fail" and prep is not None:
        with np.errstate(all="ignore"):
            words = diagnose(prep, got, res)
        if words:
            res.diagnosis = "; ".join(w for w in (res.diagnosis, words) if w)
    return res


def _grad_dtype(entry, name):
    """The dtype the gradient of input ``name`` must be in: its input's (stored as the
    file stores it; bfloat16's bit patterns are the case's dtype)."""
    stored = entry["storage"].get(name)
    return entry["dtype"] if stored in (None, "uint16") else stored


def _judge_grads(entry, arrays, held, prep, layout, file, base, wanted):
    """The gradient rows of one case: one per ``golden_d*`` of its vectors (n/a when the
    kernel computes none), and an n/a row per gradient the manifest does not judge."""
    from .grads import diagnose_grads
    from .report import CaseResult

    names = [o[len("golden_"):] for o in entry.get("outputs", ()) if o.startswith("golden_d")]
    skipped = entry.get("grads_not_judged") or {}
    if not wanted:
        return [CaseResult.na(reason="the kernel computes no gradients (grads=False, --no-grads)",
                              output=n, **base) for n in names + list(skipped)]
    rows = [CaseResult.na(reason=why, output=n, **base) for n, why in skipped.items()]
    judged, hosts, gold = [], {}, {}
    for n in names:
        row = {**base, "output": n}
        golden = arrays["golden_" + n]
        if n not in held:
            rows.append(CaseResult.error(
                f"{file} holds no {n}, while the vectors hold golden_{n}: write the kernel's "
                f"gradient as {n!r} (in the layout and dtype of its input), or, if the kernel "
                f"computes no gradients, opt out with check_results(..., grads=False) / "
                f"--no-grads", verdict="fail", **row))
            continue
        try:
            # untagged uint16: the bits of its input's dtype, as the file stores the input
            got, tag, tagged = _decode(file, n, held, _grad_dtype(entry, n[1:]))
        except ValueError as exc:
            rows.append(CaseResult.error(str(exc), verdict="fail", **row))
            continue
        if got.shape != golden.shape:
            rows.append(CaseResult.error(f"{file}: {n} has shape {got.shape}, expected "
                                         f"{golden.shape} (layout {layout})", verdict="fail", **row))
            continue
        tol = entry["output_tolerances"][f"golden_{n}"]
        keep = np.isfinite(golden)  # NaN: excluded rows, values a near tie moves
        m = measure(got, np.where(keep, golden, 0.0), keep, arrays.get("tol_rows_" + n))
        verdict, why, ratio = verdict_of(m, tol["tol_max_abs"], tol["tol_rms"], n)
        res = CaseResult(max_err=m.max_err, rms_err=m.rms_err, tol_max=tol["tol_max_abs"],
                         tol_rms=tol["tol_rms"], ratio=ratio,
                         worst=worst_of(m, tol["tol_max_abs"], tol["tol_rms"]), verdict=verdict,
                         diagnosis=why, baseline_max=_nan_if_none(tol.get("baseline_max_abs")),
                         baseline_rms=_nan_if_none(tol.get("baseline_rms")), **row)
        problem = _stored_dtype_problem(entry, got, tag, tagged, n, _grad_dtype(entry, n[1:]))
        if problem:
            res.verdict = "fail"
            res.diagnosis = "; ".join(w for w in (problem, res.diagnosis) if w)
        res.unresolved(tol.get("unresolved", ""))
        rows.append(res)
        if n[1:] in ("q", "k", "v", "bias"):  # what diagnose_grads knows
            canon = (lambda x: from_layout(x, layout)) if n[1:] in ("q", "k", "v") else (
                lambda x: x[None, None] if layout == "nd" else x)
            hosts[n[1:]] = canon(got)
            g = canon(golden)
            gold[n[1:]] = (g, np.isfinite(g), tol["tol_max_abs"], tol["tol_rms"], None)
            judged.append(res)
    if prep is not None and "do" in arrays and any(
            r.verdict == "fail" and not r.diagnosis for r in judged):
        with np.errstate(all="ignore"):
            do = np.asarray(from_layout(arrays["do"], layout), dtype=np.float64)
            words = diagnose_grads(prep, do, hosts, gold)
        for r in judged:
            if r.verdict == "fail" and not r.diagnosis:
                r.diagnosis = words.get(r.output[1:]) or (
                    f"no known mistake explains it: error {r.ratio:.3g}x the tolerance, "
                    f"worst at index {tuple(int(i) for i in r.worst)}")
    return rows


def _nan_if_none(x):
    return float("nan") if x is None else float(x)


def _judge_state(entry, arrays, state, prep, layout, file, base, wanted):
    """The ``final_state`` row of one case: n/a when the kernel returns no state, a fail
    when it should and the file has none, else judged as verify judges it."""
    from .report import CaseResult

    row = {**base, "output": "final_state"}
    if not wanted:
        return CaseResult.na(reason="the kernel returns no final state (final_state=False, "
                                    "--no-final-state)", **row)
    if state is None:
        return CaseResult.error(
            f"{file} holds no final_state, while the vectors hold golden_final_state: write the "
            "kernel's final state as 'final_state' (N, H, d_k, d_v), float32 (or float64 for "
            "float64 cases), or, if the kernel returns no state, opt out with "
            "check_results(..., final_state=False) / --no-final-state", verdict="fail", **row)
    golden, e = arrays["golden_final_state"], EXTRAS["final_state"]
    try:
        got = np.asarray(state, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        return CaseResult.error(f"{file}: final_state stored as {state.dtype} is not numeric "
                                f"({exc})", verdict="fail", **row)
    if got.shape != golden.shape:
        words = e.explain_shape(prep, layout, got.shape) if prep is not None else ""
        return CaseResult.error(
            f"{file}: final_state has shape {got.shape}, expected {golden.shape} "
            f"({e.doc})" + (f": {words}" if words else ""), verdict="fail", **row)
    stored = str(state.dtype)
    if prep is not None and np.array_equal(final_state_golden(prep), e.canonical(golden, layout)):
        with np.errstate(all="ignore"):
            # the stored dtype goes to the judge, which names a state kept in float16
            # where rounding the golden to it reproduces the kernel's state
            res = e.judge(prep, e.canonical(got, layout), dtype=stored)
    else:
        ok, err, ratio = check_final_state(entry, arrays, got)
        res = CaseResult(verdict="pass" if ok else "fail", max_err=err, ratio=ratio, **row)
    acc = "float64" if entry["dtype"] == "float64" else "float32"
    if res.verdict == "fail" and MANTISSA_BITS.get(stored, 99) < MANTISSA_BITS[acc] \
            and f"returned in {stored}" not in res.diagnosis:
        # a state rounded by the kernel's own float32 computation before the store lands
        # off the golden's rounding by an ulp here and there: the judge then names no
        # cause, but the storage alone is one (as "out dtype ..." is for the output)
        res.diagnosis = "; ".join(w for w in (
            f"final_state stored as {stored}, below the {acc} the state accumulates in (fla "
            f"returns float32 states, float64 for float64 inputs)", res.diagnosis) if w)
    return res
