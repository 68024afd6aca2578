"""Exported test vectors, for kernels tested outside Python (C++, CUDA, Rust, ...).

``export_vectors(DIR, "softmax", dtypes=("float16",))`` writes one ``.npz`` per case and
dtype plus ``DIR/manifest.json``. Each ``.npz`` (plain NumPy arrays, loadable without
pickle: ``np.load(path, allow_pickle=False)``, or cnpy / xtensor-io in C++) holds

* ``q``, ``k``, ``v`` - inputs in the kernel dtype and the manifest's layout
  (float16/float32/float64 natively; **bfloat16 as uint16 bit patterns**, the upper
  half of the float32 bits);
* ``mask`` (bool, ``(B|1, H|1, Nq, Nk)``, True = may attend) and ``bias`` (kernel
  dtype, same shape) when the case has them; the variant's extra parameters under
  their own names;
* ``golden`` - float64, the expected output in the same layout (rows excluded by
  ``fully_masked="excluded"`` are NaN);
* ``compare`` - bool, which golden elements are compared.

``manifest.json``: ``{"format": "attn-ref-vectors", "version": 1, "variant",
"variant_options", "layout", "semantics", "seed", "suite", "tolerance_model", "cases":
[...]}``; ``variant_options`` are the options of the variant's function the vectors were
computed with (the registered defaults and those set with ``options=``, see
:func:`conformance.judging.with_options`; a callable option is recorded by name); each case
entry has ``file``, ``id``, ``dtype``, ``shapes``, ``causal`` (``null``, ``"top-left"``,
``"bottom-right"``), ``scale`` (the value to use; always given), ``params`` (plain
options), ``options`` (the case's feature options: ``gqa``, ``window`` ``[left, right]``
with -1 unbounded, ``softcap``, ``dropout_p``, ``seqlens_q``/``seqlens_k``; the arrays
``alibi_slopes`` ``(H,)`` and ``dropout_mask`` ``(B, H, Nq, Nk)`` are in the file),
``arrays`` (names in the file), ``tol_max_abs`` and ``tol_rms`` (the bounds a
kernel's max-abs and RMS errors over compared elements must stay under), and the
``baseline_max_abs`` / ``baseline_rms`` they were derived from. A kernel passes a case
when both errors are within bounds and it produced no NaN/Inf where the golden is
finite. With ``grads=True`` (CLI ``--grads``) each file also holds ``do`` (the output
cotangent, kernel dtype) and ``golden_dq``/``golden_dk``/``golden_dv`` (``golden_dbias``
when the case has a bias; float64, ``dq`` rows excluded by ``fully_masked="excluded"``
are NaN); ``outputs`` lists them and ``output_tolerances`` gives each one's
``tol_max_abs``/``tol_rms`` and baselines.
"""

from __future__ import annotations

import json
import os

import numpy as np

from .catalogue import cases as _cases
from .features import NotApplicable, default_scale
from .judging import parse_semantics, prepare, with_options
from .layouts import to_layout
from .report import jsonable
from .tolerance import DEFAULTS, bf16_round

__all__ = ["export_vectors", "load_vectors", "FORMAT", "VERSION"]

FORMAT, VERSION = "attn-ref-vectors", 1


def _store(x: np.ndarray, dtype: str) -> np.ndarray:
    if x.dtype == np.bool_:
        return np.ascontiguousarray(x)
    if dtype == "bfloat16":
        return (bf16_round(x).view(np.uint32) >> 16).astype(np.uint16)
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
    todo = list(cases) if cases is not None else _cases(None, suite)
    entries, skipped = [], []
    for dt in dtypes:
        for i, case in enumerate(todo):
            if layout == "nd" and (case.batch != (1, 1) or case.kv_batch is not None):
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
                    arrays[n] = _store(a, dt)
            keep = np.ones(prep.golden.shape, bool) if prep.keep is None else np.array(prep.keep)
            golden = np.where(keep, prep.golden, np.nan)
            arrays["golden"] = np.ascontiguousarray(to_layout(golden, layout))
            arrays["compare"] = np.ascontiguousarray(to_layout(keep, layout))
            outputs, grad_tols = ["golden"], {}
            if grads:
                outputs, grad_tols = _add_grads(prep, arrays, layout, dt)
            np.savez(os.path.join(directory, fname), **arrays)
            scale = prep.kwargs.get("scale")
            entries.append({
                "file": fname,
                "id": case.id,
                "dtype": dt,
                "storage": {n: str(a.dtype) for n, a in arrays.items()},
                "shapes": {n: list(a.shape) for n, a in arrays.items()},
                "causal": prep.kwargs.get("causal"),
                "scale": scale if scale is not None else default_scale(case.d),
                "default_scale": scale is None,
                "params": {n: p for n, p in prep.params.items() if not isinstance(p, np.ndarray)}
                | {n: p for n, p in prep.options.items()},
                # the case's other plain reference options: gqa, window, softcap,
                # dropout_p, seqlens_q/seqlens_k (see conformance.catalogue.FEATURES)
                "options": {n: list(x) if isinstance(x, tuple) else x
                            for n, x in prep.kwargs.items() if n not in ("causal", "scale")},
                "arrays": sorted(arrays),
                "outputs": outputs,
                "output_tolerances": grad_tols,
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


def _add_grads(prep, arrays, layout, dtype):
    """``do`` (kernel dtype) and ``golden_dq``... (float64) into ``arrays``; their bounds."""
    from .grads import GRAD_OUTPUTS, prepare_grads

    try:
        g = prepare_grads(prep)
    except NotApplicable:
        return ["golden"], {}
    arrays["do"] = _store(to_layout(g["do"], layout), dtype)
    outputs, tols = ["golden"], {}
    for n in ("q", "k", "v", "bias"):
        if n not in g:
            continue
        gold, keep, tmax, trms, bm = g[n]
        name = "golden_" + GRAD_OUTPUTS[n]
        gold = np.where(keep, gold, np.nan) if keep is not None else gold
        arrays[name] = np.ascontiguousarray(
            (gold[0, 0] if layout == "nd" else gold) if n == "bias" else to_layout(gold, layout))
        outputs.append(name)
        tols[name] = {"tol_max_abs": tmax, "tol_rms": trms,
                      "baseline_max_abs": bm.max_err if bm else None,
                      "baseline_rms": bm.rms_err if bm else None}
    return outputs, tols


def load_vectors(directory):
    """Yield ``(entry, arrays)`` for each exported case; bfloat16 comes back as float32."""
    with open(os.path.join(directory, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{directory} does not hold attn-ref vectors")
    for entry in manifest["cases"]:
        with np.load(os.path.join(directory, entry["file"]), allow_pickle=False) as z:
            arrays = {n: _restore(z[n], entry["dtype"]) for n in z.files}
        yield entry, arrays
