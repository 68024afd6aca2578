"""attn_ref.grad.reduced: pooled, query-reduced, Nystrom and clustered gradients."""

import numpy as np
import pytest

from attn_ref import grad
from attn_ref import reduced as R
from attn_ref.grad.reduced import iterative_pinv_vjp, pinv_vjp
from conformance.backends import from_numpy, load
from tests.helpers import host
from tests.test_grad_common import assert_grads_close, jax_vjp, numeric_vjp, run_vjp, torch_vjp

FORMS = {
    "pooled": (R.pooled_attention, grad.pooled_attention, {"num_segments": 4}),
    "pooled-causal": (R.pooled_attention, grad.pooled_attention,
                      {"num_segments": 3, "causal": "bottom-right"}),
    "query-reduced": (R.query_reduced_attention, grad.query_reduced_attention, {"num_segments": 3}),
    "nystrom": (R.nystrom_attention, grad.nystrom_attention, {"num_landmarks": 3}),
    "nystrom-exact-pinv": (R.nystrom_attention, grad.nystrom_attention,
                           {"num_landmarks": 3, "pinv_iterations": None}),
    "nystrom-global-init": (R.nystrom_attention, grad.nystrom_attention,
                            {"num_landmarks": 3, "pinv_init": "global"}),
}


def _case(seed, nq=7, nk=8):
    rng = np.random.default_rng(seed)
    args = {
        "q": rng.standard_normal((2, nq, 4)),
        "k": rng.standard_normal((2, nk, 4)),
        "v": rng.standard_normal((1, nk, 3)),
    }
    return args, rng.standard_normal((2, nq, 3))


_FD = {}


@pytest.mark.parametrize("form", FORMS)
def test_matches_finite_differences(backend, form):
    fwd, vjp, options = FORMS[form]
    args, do = _case(0, nq=8 if "nystrom" in form else 7)
    if form not in _FD:
        _FD[form] = numeric_vjp(fwd, args, do, options)
    got = run_vjp(backend, vjp, args, do, options)
    assert_grads_close(got, _FD[form], backend, rtol=1e-6, atol=1e-8)


def test_query_reduced_without_expansion(backend):
    args, do = _case(1)
    options = {"num_segments": 3, "expand": False}
    want = numeric_vjp(R.query_reduced_attention, args, do[:, :3], options)
    assert_grads_close(run_vjp(backend, grad.query_reduced_attention, args, do[:, :3], options), want,
                       backend, rtol=1e-7, atol=1e-8)


@pytest.mark.parametrize("form", ["pooled-causal", "nystrom", "nystrom-global-init"])
def test_matches_torch_autograd_and_jax_vjp_of_the_forward(form):
    fwd, vjp, options = FORMS[form]
    args, do = _case(2, nq=8)
    for name, autodiff in (("torch", torch_vjp), ("jax", jax_vjp)):
        try:
            backend = load(name)
        except Exception as exc:  # pragma: no cover
            pytest.skip(str(exc))
        want = autodiff(fwd, args, do, options)
        assert_grads_close(run_vjp(backend, vjp, args, do, options), want, backend, rtol=1e-9, atol=1e-10)


def test_pinv_vjps_match_finite_differences(backend):
    rng = np.random.default_rng(3)
    a = rng.random((2, 4, 4)) + np.eye(4)
    g = rng.standard_normal((2, 4, 4))
    for iters in (3, None):
        if iters is None:
            f = np.linalg.pinv
        else:
            def f(q, iters=iters):
                return np.asarray(R.iterative_pinv(q, iterations=iters))
        want = numeric_vjp(f, {"q": a}, g)["q"]
        aa, gg = from_numpy(a, backend), from_numpy(g, backend)
        if iters is None:
            if not hasattr(backend.xp, "linalg"):
                continue
            got = pinv_vjp(aa, backend.xp.linalg.pinv(aa), gg)
        else:
            got = iterative_pinv_vjp(aa, gg, iterations=iters)
        np.testing.assert_allclose(host(got), want, rtol=1e-6, atol=1e-8)


def test_global_pinv_init_couples_the_batch(backend):
    # One start for both batch entries: a cotangent on entry 0 alone reaches the inputs
    # of entry 1 through the batch-wide maximum (q's batch of 2, k's too), and the
    # gradients are not those of the per-matrix start.
    args, do = _case(5, nq=8)
    args["q"][1] *= 3.0  # sharper softmaxes: entry 1 holds the batch's largest column sum
    do[1] = 0.0
    kw = {"num_landmarks": 4}  # 3 landmarks: the 6 steps converge, the coupling is ~1e-11
    glob = run_vjp(backend, grad.nystrom_attention, args, do, {**kw, "pinv_init": "global"})
    per = run_vjp(backend, grad.nystrom_attention, args, do, kw)
    assert np.all(host(per["q"])[1] == 0.0) and np.all(host(per["k"])[1] == 0.0)
    coupled = max(np.abs(host(glob["q"])[1]).max(), np.abs(host(glob["k"])[1]).max())
    assert coupled > 1e-6
    want = numeric_vjp(R.nystrom_attention, args, do, {**kw, "pinv_init": "global"})
    assert_grads_close(glob, want, backend, rtol=1e-6, atol=1e-8)
    rng = np.random.default_rng(3)
    a = rng.random((2, 4, 4)) + np.eye(4)
    a[1] *= 4.0
    g = rng.standard_normal((2, 4, 4))

    def f(x):
        return np.asarray(R.iterative_pinv(x, iterations=3, pinv_init="global"))
    got = iterative_pinv_vjp(from_numpy(a, backend), from_numpy(g, backend), iterations=3,
                             pinv_init="global")
    np.testing.assert_allclose(host(got), numeric_vjp(f, {"q": a}, g)["q"], rtol=1e-6, atol=1e-8)


def test_landmarks_equal_n_with_exact_pinv_is_softmax(backend):
    args, do = _case(4, nq=6, nk=6)
    args["v"] = args["v"][0]
    nys = run_vjp(backend, grad.nystrom_attention, args, do, {"num_landmarks": 6, "pinv_iterations": None})
    soft = run_vjp(backend, grad.softmax_attention, args, do)
    for n in "qkv":
        np.testing.assert_allclose(host(nys[n]), host(soft[n]), rtol=1e-7, atol=1e-8)


def test_clustered_matches_finite_differences(backend):
    # The k-means assignment is piecewise constant: held constant, and finite
    # differences (small steps) do not change it, so the two agree.
    rng = np.random.default_rng(6)
    args = {"q": rng.standard_normal((2, 9, 3)), "k": rng.standard_normal((2, 7, 3)),
            "v": rng.standard_normal((1, 7, 2))}
    do = rng.standard_normal((2, 9, 2))
    options = {"num_clusters": 3, "iterations": 4, "seed": 1}
    if "clustered" not in _FD:
        _FD["clustered"] = numeric_vjp(R.clustered_attention, args, do, options)
    got = run_vjp(backend, grad.clustered_attention, args, do, options)
    assert_grads_close(got, _FD["clustered"], backend, rtol=1e-7, atol=1e-8)


TOPK = {
    "topk3": (3, {"num_clusters": 3, "iterations": 4, "seed": 1, "topk": 3}),
    "topk2-shared-q": (2, {"num_clusters": 2, "iterations": 3, "seed": 0, "topk": 2}),
}


def _topk_case(form):
    # q of rank 3 or (shared by the batch) rank 2; keys spread out so the centroids'
    # softmax rows have clear gaps at the top-k boundary.
    rng = np.random.default_rng(4)
    q = rng.standard_normal((2, 9, 3))
    args = {"q": q if TOPK[form][0] == 3 else q[0], "k": 2 * rng.standard_normal((2, 7, 3)),
            "v": rng.standard_normal((1, 7, 2))}
    return args, rng.standard_normal((2, 9, 2)), TOPK[form][1]


def _selection_margins(q, k, options):
    """Smallest gap, over queries and clusters, that a perturbation must close to change the
    k-means assignment (squared distances) or the top-k selection (centroid softmax)."""
    c, _, _ = R.kmeans(q, options["num_clusters"], iterations=options["iterations"], seed=options["seed"])
    d2 = np.sort(((q[..., :, None, :] - c[..., None, :, :]) ** 2).sum(-1), axis=-1)
    pc = np.sort(np.asarray(R.attention_weights(c, k)), axis=-1)[..., ::-1]
    t = options["topk"]
    return (d2[..., 1] - d2[..., 0]).min(), (pc[..., t - 1] - pc[..., t]).min()


@pytest.mark.parametrize("form", TOPK)
def test_clustered_topk_matches_finite_differences(backend, form):
    # Assignments and top-k selection are held constant; finite differences agree with
    # them only where steps of 1e-6 change neither, which the margins guarantee here.
    args, do, options = _topk_case(form)
    assignment_gap, selection_gap = _selection_margins(args["q"], args["k"], options)
    assert assignment_gap > 1e-2 and selection_gap > 1e-3, (assignment_gap, selection_gap)
    key = f"clustered-{form}"
    if key not in _FD:
        _FD[key] = numeric_vjp(R.clustered_attention, args, do, options)
    got = run_vjp(backend, grad.clustered_attention, args, do, options)
    assert_grads_close(got, _FD[key], backend, rtol=1e-7, atol=1e-8)


def test_clustered_topk_fixed_selection_matches_finite_differences(backend):
    # topk_keys fixes the selection as the forward's does: the VJP is that of the function
    # with those keys, another function than the natural selection's here.
    args, do, options = _topk_case("topk3")
    options = {**options, "topk_keys": np.array([[0, 1, 2], [2, 4, 6], [5, 6, 3]])}
    natural = R.clustered_attention(args["q"], args["k"], args["v"], **TOPK["topk3"][1])
    fixed = R.clustered_attention(args["q"], args["k"], args["v"], **options)
    assert np.max(np.abs(fixed - natural)) > 1e-2
    if "clustered-fixed" not in _FD:
        _FD["clustered-fixed"] = numeric_vjp(R.clustered_attention, args, do, options)
    got = run_vjp(backend, grad.clustered_attention, args, do, options)
    assert_grads_close(got, _FD["clustered-fixed"], backend, rtol=1e-7, atol=1e-8)


@pytest.mark.parametrize("topk", [None, 3])
def test_clustered_fixed_assignments_match_finite_differences(backend, topk):
    # assignments fixes k-means assignments as the forward's does: the VJP runs Lloyd's
    # steps back through the moved clusters' means, another function than the natural one.
    args, do, options = _topk_case("topk3")
    options = {**options, "topk": topk}
    moved = np.full((2, 5, 9), -1)
    moved[0, 3, 4], moved[1, 4, 0] = 2, 0  # the last update step and the final assignment
    options["assignments"] = moved
    natural = R.clustered_attention(args["q"], args["k"], args["v"], **{**options, "assignments": None})
    fixed = R.clustered_attention(args["q"], args["k"], args["v"], **options)
    assert np.max(np.abs(fixed - natural)) > 1e-2
    key = f"clustered-moved-{topk}"
    if key not in _FD:
        _FD[key] = numeric_vjp(R.clustered_attention, args, do, options)
    got = run_vjp(backend, grad.clustered_attention, args, do, options)
    assert_grads_close(got, _FD[key], backend, rtol=1e-7, atol=1e-8)


def test_clustered_topk_matches_torch_autograd_and_jax_vjp_of_the_forward():
    args, do, options = _topk_case("topk3")
    for name, autodiff in (("torch", torch_vjp), ("jax", jax_vjp)):
        try:
            backend = load(name)
        except Exception as exc:  # pragma: no cover
            pytest.skip(str(exc))
        want = autodiff(R.clustered_attention, args, do, options)
        assert_grads_close(run_vjp(backend, grad.clustered_attention, args, do, options), want,
                           backend, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("options", [{"num_clusters": 2, "topk": 6}, {"num_clusters": 6, "topk": 2}],
                         ids=["topk=N", "C=N"])
def test_clustered_topk_limits_are_softmax(backend, options):
    # topk = Nk: every member takes its own exact softmax over all keys. C = N: every query
    # is its own centroid, so its top-k softmax scaled by the centroid's mass on those keys,
    # plus the centroid's weights on the rest, is its own softmax row.
    args, do = _case(5, nq=6, nk=6)
    clustered = run_vjp(backend, grad.clustered_attention, args, do, options)
    soft = run_vjp(backend, grad.softmax_attention, args, do)
    for n in "qkv":
        np.testing.assert_allclose(host(clustered[n]), host(soft[n]), rtol=1e-9, atol=1e-10)
