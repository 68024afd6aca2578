"""Each sparse pattern once, as a predicate on positions ``(i, j)``, and the defining
forms built from it: ``(N, N)`` boolean masks and host-side block layouts.
Conventions: :mod:`attn_ref.sparse`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import array_api_compat

from .._checks import check_flag, check_nonnegative_int, check_positive_int, check_real
from .._common import ceil_div

__all__ = [
    "local_mask",
    "strided_mask",
    "fixed_mask",
    "global_mask",
    "longformer_mask",
    "bigbird_layout",
    "bigbird_mask",
    "layout_mask",
    "random_block_layout",
    # Shared with the efficient forms (attn_ref.sparse.plans).
    "local_pred",
    "position_grid",
    "check_global_tokens",
    "check_sparse_window",
    "layout_rows",
    "banded_rows",
    "check_summary",
    "global_vector",
    "bigbird_rows",
]


_STRIDED_PARTS = ("both", "local", "strided")
_FIXED_PARTS = ("both", "block", "summary")


# ---------------------------------------------------------------- predicates
# Each pattern is written once, as a predicate on broadcastable integer position
# arrays ``i`` (queries) and ``j`` (keys). The mask builders evaluate it on the full
# grid; the efficient forms evaluate it only on the gathered blocks.


def local_pred(xp, i, j, reach, one_sided, dilation):
    """The local window: ``|i - j| <= reach`` (``0 <= i - j <= reach`` one-sided), on
    every ``dilation``-th key."""
    diff = i - j
    ok = (diff >= 0) if one_sided else (diff >= -reach)
    ok = xp.logical_and(ok, diff <= reach)
    if dilation > 1:
        ok = xp.logical_and(ok, xp.remainder(diff, dilation) == 0)
    return ok


def _strided_pred(xp, i, j, stride, causal, part):
    diff = i - j
    local = xp.logical_and(diff >= (0 if causal else -stride), diff <= stride)
    strided = xp.remainder(diff, stride) == 0
    if causal:
        strided = xp.logical_and(strided, diff >= 0)
    return {"local": local, "strided": strided, "both": xp.logical_or(local, strided)}[part]


def _fixed_pred(xp, i, j, stride, summary, causal, part):
    block = xp.floor_divide(i, stride) == xp.floor_divide(j, stride)
    summ = xp.remainder(j, stride) >= stride - summary
    ok = {"block": block, "summary": summ, "both": xp.logical_or(block, summ)}[part]
    return xp.logical_and(ok, j <= i) if causal else ok


def position_grid(xp, nq, nk, device):
    """Query positions ``(Nq, 1)`` and key positions ``(1, Nk)`` as int64 arrays."""
    i = xp.arange(nq, dtype=xp.int64, device=device)[:, None]
    j = xp.arange(nk, dtype=xp.int64, device=device)[None, :]
    return i, j


# ---------------------------------------------------------------- argument checks


def _check_part(name, part, allowed):
    if part not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {part!r}")


def check_global_tokens(global_tokens, n):
    """``global_tokens`` as a sorted tuple of distinct positions in ``[0, n)``."""
    if isinstance(global_tokens, (str, bytes)) or not isinstance(global_tokens, (Sequence, range)):
        raise TypeError(
            "global_tokens must be a sequence of token indices (a tuple or range), "
            f"got {type(global_tokens).__name__}"
        )
    out = []
    for t in global_tokens:
        t = check_nonnegative_int("global_tokens entry", t)
        if not t < n:
            raise ValueError(
                f"global_tokens must hold integer positions in [0, N) = [0, {n}), got {t!r}"
            )
        out.append(t)
    return tuple(sorted(set(out)))


def check_sparse_window(window, dilation):
    """Check ``window`` (>= 0) and ``dilation`` (>= 1); return the reach ``window * dilation``."""
    check_nonnegative_int("window", window)
    check_positive_int("dilation", dilation)
    return window * dilation


def _is_flag(x):
    """A NumPy bool (or bool) as a layout entry, by the flag rule of :func:`check_flag`."""
    try:
        check_flag("layout entry", x)
    except TypeError:
        return False
    return True


def layout_rows(layout, nbq, nbk, block_size, nq, nk):
    """Validate a block layout; return, per query block, the tuple of active key blocks."""
    want = (
        f"a boolean block layout of shape (ceil(Nq/block_size), ceil(Nk/block_size)) = "
        f"(ceil({nq}/{block_size}), ceil({nk}/{block_size})) = ({nbq}, {nbk})"
    )
    if array_api_compat.is_array_api_obj(layout):
        lxp = array_api_compat.array_namespace(layout)
        if layout.dtype != lxp.bool:
            raise TypeError(f"layout must be {want}, got an array of dtype {layout.dtype}")
        if tuple(layout.shape) != (nbq, nbk):
            raise ValueError(f"layout must be {want}, got shape {tuple(layout.shape)}")
        return tuple(tuple(b for b in range(nbk) if bool(layout[a, b])) for a in range(nbq))
    if isinstance(layout, (str, bytes)) or not isinstance(layout, Sequence):
        raise TypeError(f"layout must be {want}, got {type(layout).__name__}")
    rows = []
    for a, row in enumerate(layout):
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
            raise TypeError(f"layout must be {want}, got row {a} of type {type(row).__name__}")
        if len(row) != nbk:
            raise ValueError(f"layout must be {want}, got row {a} of length {len(row)}")
        for b, x in enumerate(row):
            ok = x in (0, 1) if isinstance(x, int) else _is_flag(x)
            if not ok:
                raise TypeError(f"layout must be {want}, got entry ({a}, {b}) = {x!r}")
        rows.append(tuple(b for b, x in enumerate(row) if x))
    if len(rows) != nbq:
        raise ValueError(f"layout must be {want}, got {len(rows)} rows")
    return tuple(rows)


def banded_rows(nb, block_size, reach, one_sided):
    """Key blocks of a window of ``reach`` positions (per side) at block size B.

    Every row has the same length; slots that fall off either end are ``-1`` (an
    empty block), so a banded layout is one gather and one matmul.
    """
    lo = min(nb - 1, ceil_div(reach, block_size))
    hi = 0 if one_sided else min(nb - 1, (block_size - 1 + reach) // block_size)
    return tuple(
        tuple(b if 0 <= b < nb else -1 for b in range(a - lo, a + hi + 1)) for a in range(nb)
    )


# ---------------------------------------------------------------- mask builders


def local_mask(n, /, *, window, one_sided=False, dilation=1, xp, device=None):
    """Sliding-window mask: query ``i`` sees key ``j`` within ``window`` steps.

    Parameters
    ----------
    n : int
        Sequence length.
    window : int
        Keys per side (``>= 0``); see :mod:`attn_ref.sparse`.
    one_sided : bool
        Only the past and the present (``0 <= i - j``): a causal sliding window.
    dilation : int
        Gap between attended keys (``>= 1``); the reach is ``window * dilation``.
    xp : namespace
        Array namespace to build the mask in (required).
    device : optional
        Device of the mask.

    Returns
    -------
    bool array, shape (n, n)

    Examples
    --------
    >>> import array_api_strict as xp
    >>> from attn_ref.sparse import local_mask
    >>> m = local_mask(5, window=1, xp=xp)
    >>> [int(xp.sum(xp.astype(m[i, :], xp.int64))) for i in range(5)]
    [2, 3, 3, 3, 2]
    """
    check_nonnegative_int("n", n)
    reach = check_sparse_window(window, dilation)
    i, j = position_grid(xp, n, n, device)
    return local_pred(xp, i, j, reach, bool(one_sided), dilation)


def strided_mask(n, /, *, stride, causal=True, part="both", xp, device=None):
    """The strided pattern of the Sparse Transformer (Child et al. 2019).

    ``A1(i) = {j : 0 <= i - j <= stride}`` (the previous ``stride`` positions and
    ``i`` itself) and ``A2(i) = {j : (i - j) mod stride = 0}``; the paper gives each to
    a different head, ``part="both"`` is their union (one head attending both). With
    ``causal=False`` both parts look both ways: ``|i - j| <= stride``.

    Parameters
    ----------
    n : int
    stride : int
        ``l`` in the paper, ``>= 1``; ``sqrt(N)`` gives ``O(N sqrt(N))`` pairs.
    causal : bool
    part : {"both", "local", "strided"}
    xp, device
        As in :func:`local_mask`.

    Returns
    -------
    bool array, shape (n, n)
    """
    check_nonnegative_int("n", n)
    check_positive_int("stride", stride)
    _check_part("part", part, _STRIDED_PARTS)
    i, j = position_grid(xp, n, n, device)
    return _strided_pred(xp, i, j, stride, bool(causal), part)


def fixed_mask(n, /, *, stride, summary=1, causal=True, part="both", xp, device=None):
    """The fixed pattern of the Sparse Transformer (Child et al. 2019).

    ``A1(i) = {j : floor(j / l) = floor(i / l)}`` (the block of ``stride = l``
    positions holding ``i``) and ``A2(i) = {j : j mod l >= l - c}`` (the last
    ``summary = c`` positions of every block, which summarise it). ``causal=True``
    keeps ``j <= i`` in both.

    Parameters
    ----------
    n : int
    stride : int
        Block length ``l >= 1``.
    summary : int
        ``c`` with ``1 <= c <= stride``.
    causal : bool
    part : {"both", "block", "summary"}
    xp, device
        As in :func:`local_mask`.

    Returns
    -------
    bool array, shape (n, n)
    """
    check_nonnegative_int("n", n)
    check_positive_int("stride", stride)
    check_summary(summary, stride)
    _check_part("part", part, _FIXED_PARTS)
    i, j = position_grid(xp, n, n, device)
    return _fixed_pred(xp, i, j, stride, summary, bool(causal), part)


def check_summary(summary, stride):
    """Check ``summary``: an integer in ``[1, stride]``."""
    check_positive_int("summary", summary)
    if summary > stride:
        raise ValueError(f"summary must be at most stride = {stride}, got {summary}")


def global_vector(xp, tokens, n, device):
    """Bool ``(n,)``: True at the global token positions ``tokens``."""
    g = [False] * n
    for t in tokens:
        g[t] = True
    return xp.asarray(g, dtype=xp.bool, device=device)


def global_mask(n, /, *, global_tokens, xp, device=None):
    """Longformer's symmetric global attention: global tokens see and are seen by all.

    ``mask[i, j]`` is True when ``i`` or ``j`` is in ``global_tokens``.

    Parameters
    ----------
    n : int
    global_tokens : sequence of int
        Positions in ``[0, n)``; duplicates are ignored.
    xp, device
        As in :func:`local_mask`.

    Returns
    -------
    bool array, shape (n, n)
    """
    check_nonnegative_int("n", n)
    tokens = check_global_tokens(global_tokens, n)
    g = global_vector(xp, tokens, n, device)
    return xp.logical_or(g[:, None], g[None, :])


def longformer_mask(n, /, *, window, global_tokens, dilation=1, xp, device=None):
    """Longformer (Beltagy et al. 2020): a two-sided (dilated) window plus global tokens.

    The union of :func:`local_mask` and :func:`global_mask`; see those for the
    parameters.
    """
    local = local_mask(n, window=window, dilation=dilation, xp=xp, device=device)
    return xp.logical_or(local, global_mask(n, global_tokens=global_tokens, xp=xp, device=device))


def bigbird_layout(num_blocks, /, *, window=1, global_blocks=1, random_blocks=1, seed=0,
                   last_global_blocks=0):
    """BigBird's block layout (Zaheer et al. 2020, ITC form), built on the host.

    Query block ``a`` sees key blocks ``b`` with ``|a - b| <= window`` (sliding
    blocks), the first ``global_blocks`` blocks (global columns), and
    ``random_blocks`` further blocks drawn without replacement from the rest; the first
    ``global_blocks`` query blocks see every block (global rows). The draw is a
    function of ``seed`` only (through :func:`attn_ref.random.permutation`).

    ``last_global_blocks`` (default 0) makes the last blocks global too, rows and
    columns: the ITC layout of google-research's BigBird code and of HuggingFace
    ``transformers``' ``BigBirdBlockSparseAttention`` (``global_block_top`` / ``bottom`` /
    ``left`` / ``right``), whose global blocks are the first and the last one
    (``global_blocks=1, last_global_blocks=1``); the random blocks are then drawn from
    the blocks neither in the window nor global. At 0 the layout, random draw included,
    is the one without the option.

    Returns
    -------
    tuple of tuples of bool, shape (num_blocks, num_blocks)
        Hashable, so it can be a static argument of a jitted function.

    Examples
    --------
    >>> from attn_ref.sparse import bigbird_layout
    >>> lay = bigbird_layout(4, window=0, global_blocks=1, random_blocks=0)
    >>> [[int(x) for x in row] for row in lay]
    [[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]]
    """
    from ..random import permutation

    check_nonnegative_int("num_blocks", num_blocks)
    check_nonnegative_int("window", window)
    check_nonnegative_int("global_blocks", global_blocks)
    check_nonnegative_int("random_blocks", random_blocks)
    check_nonnegative_int("last_global_blocks", last_global_blocks)
    nb = num_blocks
    first_last = nb - last_global_blocks  # blocks from here on are global (none at 0)
    # One permutation of all (a, b) cells ranks the candidates of every row.
    rank = permutation(nb * nb, seed=seed) if random_blocks and nb else []
    rows = []
    for a in range(nb):
        if a < global_blocks or a >= first_last:
            rows.append((True,) * nb)
            continue
        active = [abs(a - b) <= window or b < global_blocks or b >= first_last for b in range(nb)]
        if random_blocks:
            rest = sorted((b for b in range(nb) if not active[b]), key=lambda b: rank[a * nb + b])
            for b in rest[:random_blocks]:
                active[b] = True
        rows.append(tuple(active))
    return tuple(rows)


def layout_mask(layout, block_size, /, *, nq=None, nk=None, xp, device=None):
    """Expand a block layout into the element mask it stands for.

    Parameters
    ----------
    layout : nested sequences of bool or bool array, shape (ceil(nq/B), ceil(nk/B))
    block_size : int
        ``B >= 1``.
    nq, nk : int, optional
        Sequence lengths; default ``B`` times the layout's number of rows / columns.
    xp, device
        As in :func:`local_mask`.

    Returns
    -------
    bool array, shape (nq, nk)
    """
    check_positive_int("block_size", block_size)
    nbq, nbk = _layout_shape(layout)
    nq = nbq * block_size if nq is None else check_nonnegative_int("nq", nq)
    nk = nbk * block_size if nk is None else check_nonnegative_int("nk", nk)
    rows = layout_rows(layout, ceil_div(nq, block_size), ceil_div(nk, block_size), block_size, nq, nk)
    return _rows_mask(xp, rows, block_size, nq, nk, device)


def _layout_shape(layout):
    """(rows, columns) of a layout, as far as it has them; :func:`layout_rows` checks the rest."""
    if array_api_compat.is_array_api_obj(layout):
        shape = tuple(layout.shape)
    elif isinstance(layout, Sequence) and not isinstance(layout, (str, bytes)):
        first = layout[0] if len(layout) else ()
        shape = (len(layout), len(first) if isinstance(first, Sequence) else 0)
    else:
        raise TypeError(f"layout must be a boolean block layout, got {type(layout).__name__}")
    return (shape + (0, 0))[:2]


def _rows_mask(xp, rows, block_size, nq, nk, device):
    nbk = ceil_div(nk, block_size)
    table = xp.asarray([[b in set(r) for b in range(nbk)] for r in rows] or [[False] * nbk],
                       dtype=xp.bool, device=device)
    i, j = position_grid(xp, nq, nk, device)
    rows_of = xp.take(table, xp.floor_divide(i[:, 0], block_size), axis=0)
    return xp.take(rows_of, xp.floor_divide(j[0, :], block_size), axis=1)


def bigbird_mask(n, /, *, block_size, window=1, global_blocks=1, random_blocks=1, seed=0, xp,
                 device=None, last_global_blocks=0):
    """The element mask of :func:`bigbird_layout` for a sequence of length ``n``.

    Blocks have ``block_size`` positions; the last one may be ragged.

    Returns
    -------
    bool array, shape (n, n)
    """
    check_nonnegative_int("n", n)
    check_positive_int("block_size", block_size)
    rows = bigbird_rows(n, block_size, window, global_blocks, random_blocks, seed, last_global_blocks)
    return _rows_mask(xp, rows, block_size, n, n, device)


def bigbird_rows(n, block_size, window, global_blocks, random_blocks, seed, last_global_blocks=0):
    """Per query block, the key blocks of :func:`bigbird_layout` for a sequence of length ``n``."""
    nb = ceil_div(n, block_size)
    lay = bigbird_layout(nb, window=window, global_blocks=global_blocks,
                         random_blocks=random_blocks, seed=seed, last_global_blocks=last_global_blocks)
    return tuple(tuple(b for b, x in enumerate(row) if x) for row in lay)


# ---------------------------------------------------------------- registration


def random_block_layout(num_q_blocks, num_k_blocks, /, *, density=0.5, seed=0):
    """A seeded random block layout with every diagonal block active (host tuples).

    Used to exercise :func:`block_sparse_attention` generically; ``density`` is the
    fraction of off-diagonal blocks made active.
    """
    from ..random import permutation

    check_nonnegative_int("num_q_blocks", num_q_blocks)
    check_nonnegative_int("num_k_blocks", num_k_blocks)
    if not 0.0 <= check_real("density", density, "a number in [0, 1]") <= 1.0:
        raise ValueError(f"density must be a number in [0, 1], got {density!r}")
    cells = num_q_blocks * num_k_blocks
    rank = permutation(cells, seed=seed)
    cut = math.floor(density * cells)
    return tuple(
        tuple(a == b or rank[a * num_k_blocks + b] < cut for b in range(num_k_blocks))
        for a in range(num_q_blocks)
    )
