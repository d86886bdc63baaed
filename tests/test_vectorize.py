"""batch_vectorize against jnp.vectorize: broadcasting, signatures, excluded, errors,
rank promotion, composition, and the no-broadcast-copy memory claim."""

import functools as ft
import math
import re
import warnings

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax.test_util import check_grads

from chunkvmap import batch_vectorize, batch_vmap

from .helpers import temp_bytes, tree_allclose


# Most cases have N = 12 examples: None (one vmap), 1, a divisor, a non-divisor, > N.
BATCH_SIZES = [None, 1, 4, 5, 100]


def _weak(tree):
    return [jax.typeof(jnp.asarray(x)).weak_type for x in jax.tree.leaves(tree)]


def check(fn, *args, batch_size, excluded=frozenset(), signature=None, **kw):
    """batch_vectorize(...) equals jnp.vectorize(...): structure, shapes, dtypes
    (weak types included) and values. (Both run eagerly: eager op compiles are cached
    by shape, so the oracle's warm the nested-vmap path of batch_size None.)"""
    expected = jnp.vectorize(fn, excluded=excluded, signature=signature)(*args, **kw)
    actual = batch_vectorize(
        fn, excluded=excluded, signature=signature, batch_size=batch_size
    )(*args, **kw)
    tree_allclose(actual, expected)
    assert _weak(actual) == _weak(expected)
    return actual


def arange(*shape, start=0.0):
    """Distinct float32 values (built in NumPy: no compile per shape)."""
    x = start + np.arange(math.prod(shape), dtype=np.float32).reshape(shape) / 7
    return jnp.asarray(x, dtype=jnp.float32)


# --------------------------------------------------------------------------------------
# No signature: scalar functions and broadcasting.


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
@pytest.mark.parametrize(
    "shapes",
    [
        [(3, 4)],  # one argument
        [(3, 4), (3, 4)],  # both full: mapped
        [(3, 1), (1, 4)],  # both partially broadcast: gathered
        [(3, 4), (1, 4)],  # one full, one partial
        [(3, 4), (1, 1)],  # one full, one all-ones: unmapped
        [(3, 4), ()],  # a 0-d input
        [(2, 3, 1), (1, 3, 2), (2, 1, 1)],  # three inputs, size-1 dims everywhere
    ],
)
def test_broadcasting(batch_size, shapes):
    args = [arange(*s, start=i) for i, s in enumerate(shapes)]

    def f(*xs):
        assert all(x.shape == () for x in xs)
        return sum(x**2 * (i + 1) for i, x in enumerate(xs))

    out = check(f, *args, batch_size=batch_size)
    assert out.shape == jnp.broadcast_shapes(*shapes)


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_pytree_and_integer_outputs(batch_size):
    def f(x, n):
        return x * 2, (n + 1, jnp.stack([x, x]))

    x, n = arange(3, 4), jnp.arange(4, dtype=jnp.int32).reshape(1, 4)
    out = check(f, x, n, batch_size=batch_size)
    assert out[1][0].dtype == jnp.int32 and out[1][1].shape == (3, 4, 2)


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_scalar_list_and_numpy_inputs(batch_size):
    def f(a, b, c, d):
        return a * b + c - d

    c = np.arange(12, dtype=np.float32).reshape(3, 4)
    d = [[0.5, 1.0, 1.5, 2.0]]
    out = check(f, 3.0, jnp.float32(2.0), c, d, batch_size=batch_size)
    assert out.shape == (3, 4)
    # All-Python-scalar inputs keep JAX's weak type, as in jnp.vectorize.
    check(f, 3.0, 2.0, 1.0, 0.5, batch_size=batch_size)


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_all_loop_dims_size_one(batch_size):
    check(lambda x, y: x * y, arange(1, 1), arange(1, 1), batch_size=batch_size)


@pytest.mark.parametrize(
    "batch_size, chunked", [(None, False), (12, False), (100, False), (5, True)]
)
def test_chunked_only_when_batch_size_below_n(batch_size, chunked):
    f = batch_vectorize(lambda x, y: x * y, batch_size=batch_size)
    jaxpr = str(jax.make_jaxpr(f)(arange(3, 1), arange(1, 4)))  # N = 12
    assert ("scan" in jaxpr) == chunked


# --------------------------------------------------------------------------------------
# Signatures.


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_signature_inner_product(batch_size):
    def dot(x, y):
        assert x.shape == y.shape == (5,)
        return jnp.dot(x, y)

    check(
        dot,
        arange(3, 4, 5),
        arange(1, 4, 5),
        batch_size=batch_size,
        signature="(n),(n)->()",
    )
    # Outer-product style: both inputs partially broadcast.
    a, b = arange(3, 5), arange(4, 5, start=1)
    check(dot, a[:, None], b[None], batch_size=batch_size, signature="(n),(n)->()")


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_signature_matvec(batch_size):
    def matvec(m, v):
        assert m.shape == (2, 5) and v.shape == (5,)
        return m @ v

    out = check(
        matvec,
        arange(3, 1, 2, 5),
        arange(1, 4, 5, start=1),
        batch_size=batch_size,
        signature="(m,n),(n)->(m)",
    )
    assert out.shape == (3, 4, 2)


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_signature_multiple_outputs(batch_size):
    def centre(x):
        return x - x.mean(), x.mean()

    out = check(centre, arange(3, 4, 5), batch_size=batch_size, signature="(n)->(n),()")
    assert out[0].shape == (3, 4, 5) and out[1].shape == (3, 4)


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_signature_new_core_dim_from_function(batch_size):
    def powers(x):
        return x ** jnp.arange(3.0)

    out = check(powers, arange(3, 4), batch_size=batch_size, signature="()->(k)")
    assert out.shape == (3, 4, 3)


@pytest.mark.parametrize("batch_size", [None, 5])
def test_signature_whitespace_and_repeated_dims(batch_size):
    # jnp.vectorize rejects whitespace; NumPy and batch_vectorize ignore it.
    f = batch_vectorize(jnp.trace, signature=" (n, n) -> () ", batch_size=batch_size)
    expected = jnp.vectorize(jnp.trace, signature="(n,n)->()")(arange(12, 3, 3))
    tree_allclose(f(arange(12, 3, 3)), expected)


# --------------------------------------------------------------------------------------
# excluded, keyword arguments and None.


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_excluded_positional_and_keyword(batch_size):
    def poly(coeffs, x, *, mode):
        assert isinstance(coeffs, list) and isinstance(mode, str)
        value = sum(c * x**i for i, c in enumerate(coeffs))
        return -value if mode == "neg" else value

    check(
        poly,
        [1.0, 2.0, 3.0],
        arange(3, 4),
        batch_size=batch_size,
        excluded={0, "mode"},
        mode="neg",
    )
    # An excluded position past the end of the call is ignored, as in jnp.vectorize.
    check(lambda x: x + 1, arange(12), batch_size=batch_size, excluded=frozenset({3}))


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_excluded_array_in_signature(batch_size):
    def shift(x, offsets):
        return x + offsets

    w = arange(5)
    f = batch_vectorize(
        shift, excluded={1}, signature="(n)->(n)", batch_size=batch_size
    )
    expected = jnp.vectorize(shift, excluded={1}, signature="(n)->(n)")(
        arange(3, 4, 5), w
    )
    tree_allclose(f(arange(3, 4, 5), w), expected)


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_keyword_arguments_are_vectorised(batch_size):
    # Deviation: jnp.vectorize (JAX 0.10) silently drops keyword arguments that are not
    # excluded; batch_vectorize vectorises them, as np.vectorize does. The oracle is
    # jnp.vectorize with the keyword passed positionally.
    def f(x, y=1.0):
        return x * y

    x, y = arange(3, 1), arange(1, 4, start=1)
    actual = batch_vectorize(f, batch_size=batch_size)(x, y=y)
    tree_allclose(actual, jnp.vectorize(f)(x, y))

    def g(a, b, *, scale):
        return jnp.dot(a, b) * scale

    a, b, s = arange(3, 1, 5), arange(1, 4, 5), arange(3, 4)
    actual = batch_vectorize(g, signature="(k),(k),()->()", batch_size=batch_size)(
        a, b, scale=s
    )
    expected = jnp.vectorize(
        lambda a, b, s: g(a, b, scale=s), signature="(k),(k),()->()"
    )(a, b, s)
    tree_allclose(actual, expected)


@pytest.mark.parametrize("batch_size", [None, 5])
def test_none_argument_passes_through(batch_size):
    def f(x, y, z):
        assert y is None
        return x if z is None else x + z

    x, z = arange(3, 4), arange(1, 4)
    check(f, x, None, z, batch_size=batch_size)
    # jnp.vectorize fails on None in position 0 (`any({0})` is False); we do not.
    g = batch_vectorize(lambda y, x: x * 2 if y is None else y, batch_size=batch_size)
    tree_allclose(g(None, x), jnp.vectorize(lambda x, y: x * 2)(x, None))


# --------------------------------------------------------------------------------------
# Empty loop dimensions.


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_empty_loop(batch_size):
    check(lambda x, y: x * y, arange(0, 4), arange(1, 4), batch_size=batch_size)
    check(lambda x, y: x * y, arange(0, 1), arange(1, 4), batch_size=batch_size)
    check(
        lambda x: x ** jnp.arange(3.0),
        arange(2, 0),
        batch_size=batch_size,
        signature="()->(k)",
    )
    check(
        jnp.dot,
        arange(0, 3, 5),
        arange(1, 3, 5),
        batch_size=batch_size,
        signature="(n),(n)->()",
    )


# --------------------------------------------------------------------------------------
# Composition: jit and grad.


def _loss(vectorize, a, b, w):
    f = vectorize(
        lambda x, y, w: jnp.tanh(x * w) @ y, excluded={2}, signature="(k),(k)->()"
    )
    return jnp.sum(f(a[:, None], b, w) ** 2)


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_jit_and_grad(batch_size):
    a, b, w = arange(3, 5), arange(4, 5, start=1) * 0.3, arange(5) * 0.1
    b = jnp.stack([b, -b, 2 * b])  # (3, 4, 5): full loop shape

    def ours(*args):
        def vectorize(f, **kw):
            return batch_vectorize(f, batch_size=batch_size, **kw)

        return _loss(vectorize, *args)

    def theirs(*args):
        return _loss(jnp.vectorize, *args)

    value_and_grad = jax.value_and_grad(ours, argnums=(0, 1, 2))
    expected = jax.value_and_grad(theirs, argnums=(0, 1, 2))(a, b, w)
    tree_allclose(jax.jit(value_and_grad)(a, b, w), expected, rtol=1e-4)
    if batch_size == 4:
        check_grads(jax.jit(ours), (a, b, w), order=1, modes=["rev"], atol=1e-2)


def test_traced_batch_inputs_under_vmap():
    f = batch_vectorize(lambda x, y: x * y, batch_size=5)
    xs, y = arange(2, 3, 4), arange(1, 4)
    tree_allclose(jax.vmap(f, in_axes=(0, None))(xs, y), xs * y[None])


# --------------------------------------------------------------------------------------
# Errors: the same type as jnp.vectorize, and a message naming what broke.


def both_raise(error, fn, args, match, *, signature=None, excluded=frozenset()):
    with pytest.raises(error):
        jnp.vectorize(fn, signature=signature, excluded=excluded)(*args)
    for batch_size in [None, 2]:
        f = batch_vectorize(
            fn, signature=signature, excluded=excluded, batch_size=batch_size
        )
        with pytest.raises(error, match=match):
            f(*args)


@pytest.mark.parametrize(
    "signature",
    ["(n)->", "->()", "n->()", "(n),->()", "(n->()", "(n)(m)->()", "(a-b)->()", "()"],
)
def test_bad_signature_string(signature):
    with pytest.raises(ValueError, match="not a valid gufunc signature"):
        jnp.vectorize(jnp.sin, signature=signature)(1.0)
    # Checked when batch_vectorize is called, not at the first call of the result.
    with pytest.raises(
        ValueError, match=rf"invalid gufunc signature={re.escape(repr(signature))}"
    ):
        batch_vectorize(jnp.sin, signature=signature)


def test_signature_of_wrong_type():
    with pytest.raises(TypeError):
        jnp.vectorize(jnp.sin, signature=3)(1.0)
    with pytest.raises(TypeError, match=r"signature must be a str.*got signature=3"):
        batch_vectorize(jnp.sin, signature=3)  # pyright: ignore[reportArgumentType]


def test_wrong_number_of_arguments_for_signature():
    both_raise(
        TypeError,
        jnp.dot,
        (arange(3), arange(3), arange(3)),
        r"signature='\(n\),\(n\)->\(\)' expects 2 vectorised argument\(s\), but got "
        r"3 \(args\[0\], args\[1\], args\[2\]",
        signature="(n),(n)->()",
    )


def test_mismatched_core_dims():
    both_raise(
        ValueError,
        jnp.dot,
        (arange(2, 3), arange(2, 4)),
        r"core dimension 'n' .* 3 in args\[0\] \(shape \(2, 3\)\), but 4 in args\[1\]",
        signature="(n),(n)->()",
    )
    # A size-1 core dimension is not broadcast against n.
    both_raise(
        ValueError,
        jnp.dot,
        (arange(2, 3), arange(2, 1)),
        r"'n' .* 3 in args\[0\].* but 1 in args\[1\]",
        signature="(n),(n)->()",
    )


def test_too_few_dims():
    both_raise(
        ValueError,
        jnp.matmul,
        (arange(3), arange(3)),
        r"args\[0\] has shape \(3,\), which has too few dimensions for its core "
        r"dimensions \('m', 'n'\).*expected at least 2",
        signature="(m,n),(n)->(m)",
    )


def test_loop_shapes_do_not_broadcast():
    both_raise(
        ValueError,
        lambda x, y: x + y,
        (arange(3), arange(4)),
        r"cannot broadcast .* sizes \[3, 4\]. Loop shapes: args\[0\] \(3,\), "
        r"args\[1\] \(4,\)",
    )


def test_bad_outputs():
    both_raise(
        TypeError,
        lambda x: x,
        (arange(3, 2),),
        r"has 2 outputs, so the function must return a tuple of 2 arrays, but it "
        r"returned a single array of shape \(2,\) per example",
        signature="(n)->(n),()",
    )
    both_raise(
        TypeError,
        lambda x: (x, x, x),
        (arange(3, 2),),
        r"has 2 output\(s\), but the function returned a tuple of 3",
        signature="(n)->(n),()",
    )
    both_raise(
        ValueError,
        lambda x: x,
        (arange(3, 2),),
        r"output 0 \(shape \(2,\) per example\) does not match its core dimensions "
        r"\(\).*expected 0 dimension\(s\) per example, got 1",
        signature="(n)->()",
    )
    both_raise(
        ValueError,
        lambda x: x[:1],
        (arange(3, 2),),
        r"'n' .* 2 in the inputs, but 1 in output 0",
        signature="(n)->(n)",
    )
    both_raise(
        ValueError,
        lambda x: (jnp.ones(2), jnp.ones(3)),
        (arange(3),),
        r"'k' .* 2 in output 0 .* but 3 in output 1",
        signature="()->(k),(k)",
    )


def test_none_with_core_dims():
    both_raise(
        ValueError,
        jnp.dot,
        (arange(3), None),
        r"None for args\[1\], whose core dimensions .* are \('n',\)",
        signature="(n),(n)->()",
    )


def test_argument_not_an_array():
    both_raise(
        TypeError,
        lambda x, y: x,
        (arange(3), "abc"),
        r"vectorises args\[1\], so it must be convertible with jnp.asarray, but got "
        r"a value of type str.*excluded",
    )


@pytest.mark.parametrize(
    "batch_size, error, match",
    [
        (
            0,
            ValueError,
            r"positive int or None, but got batch_size=0",
        ),
        (-3, ValueError, r"positive int or None, but got batch_size=-3"),
        (2.5, TypeError, r"positive int or None, but got batch_size=2.5 of type float"),
        # batch_vectorize takes "auto" too, as every entry point does.
        (
            "4",
            TypeError,
            r"positive int, None, or 'auto', but got batch_size='4' of type str",
        ),
        (
            True,
            TypeError,
            r"positive int or None, but got batch_size=True of type bool",
        ),
    ],
)
def test_bad_batch_size(batch_size, error, match):
    with pytest.raises(error):  # the same error type as batch_vmap
        batch_vmap(jnp.sin, batch_size=batch_size)(arange(3))
    with pytest.raises(error, match="batch_vectorize batch_size must be a " + match):
        batch_vectorize(jnp.sin, batch_size=batch_size)


@pytest.mark.parametrize(
    "excluded, error, match",
    [
        ({1.5}, TypeError, r"excluded can only hold .* contains 1.5 \(float\)"),
        ({0, None}, TypeError, r"contains None \(NoneType\)"),
        (3, TypeError, r"excluded must be a collection .* got excluded=3 of type int"),
        ({-1}, ValueError, r"excluded positions must be non-negative.*contains -1"),
    ],
)
def test_bad_excluded(excluded, error, match):
    with pytest.raises(error):
        jnp.vectorize(jnp.sin, excluded=excluded)
    with pytest.raises(error, match=match):
        batch_vectorize(jnp.sin, excluded=excluded)


def test_excluded_bare_string_and_bool():
    # Stricter than jnp.vectorize, which reads excluded="ab" as {"a", "b"} and True
    # as position 1.
    with pytest.raises(TypeError, match=r"bare string excluded='scale'.*\{'scale'\}"):
        batch_vectorize(jnp.sin, excluded="scale")  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"contains True \(bool\)"):
        batch_vectorize(jnp.sin, excluded={True})


def test_pyfunc_not_callable():
    with pytest.raises(
        TypeError,
        match="batch_vectorize pyfunc must be a callable, but got pyfunc=3 of type int",
    ):
        batch_vectorize(3)  # pyright: ignore[reportArgumentType]


# --------------------------------------------------------------------------------------
# Rank promotion (tests/conftest.py sets 'raise' for the suite).


RANK_CASES = [
    # (shapes, signature, promotes); a shape None is the Python scalar 2.0.
    # jnp.vectorize counts the loop rank of every argument except 0-d ones.
    ([(4,), (3, 4)], None, True),
    ([(3, 4), ()], None, False),  # a 0-d argument never promotes
    ([(3, 4), None], None, False),
    ([(5,), (3, 5)], "(n),(n)->()", True),  # loop ranks 0 and 1
    ([(3, 5), (2, 3, 5)], "(n),(n)->()", True),
    ([(3, 5), (1, 3, 5)], "(n),(n)->()", True),
]


def _rank_case(shapes, signature):
    args = [2.0 if s is None else arange(*s, start=i) for i, s in enumerate(shapes)]
    return (jnp.dot if signature else (lambda x, y: x * y)), args


@pytest.mark.parametrize("shapes, signature, promotes", RANK_CASES)
@pytest.mark.parametrize("batch_size", [None, 5])
def test_rank_promotion_raise(shapes, signature, promotes, batch_size):
    assert jax.config.jax_numpy_rank_promotion == "raise"  # pyright: ignore
    f, args = _rank_case(shapes, signature)
    if promotes:
        both_raise(
            ValueError,
            f,
            args,
            r"loop \(non-core\) dimensions of different ranks need rank promotion.*"
            r"args\[0\] \(\d.*args\[1\] \(\d.*jax_numpy_rank_promotion",
            signature=signature,
        )
    else:
        check(f, *args, batch_size=batch_size, signature=signature)


@pytest.mark.parametrize("shapes, signature, promotes", RANK_CASES)
@pytest.mark.parametrize("batch_size", [None, 5])
def test_rank_promotion_allow(shapes, signature, promotes, batch_size):
    f, args = _rank_case(shapes, signature)
    with jax.numpy_rank_promotion("allow"):
        check(f, *args, batch_size=batch_size, signature=signature)


def test_rank_promotion_warn():
    args = (arange(4), arange(3, 4))
    with jax.numpy_rank_promotion("warn"):
        with pytest.warns(UserWarning, match="rank promotion"):
            expected = jnp.vectorize(lambda x, y: x * y)(*args)
        with pytest.warns(UserWarning, match=r"batch_vectorize .*rank promotion"):
            actual = batch_vectorize(lambda x, y: x * y, batch_size=5)(*args)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning without promotion
            batch_vectorize(lambda x, y: x * y, batch_size=5)(arange(1, 4), args[1])
    tree_allclose(actual, expected)


# --------------------------------------------------------------------------------------
# Property: random loop shapes with broadcasting, random batch sizes.


@st.composite
def broadcast_problem(draw):
    loop = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
    shapes = []
    for _ in range(draw(st.integers(1, 3))):
        ones = draw(st.lists(st.booleans(), min_size=len(loop), max_size=len(loop)))
        shapes.append(tuple(1 if o else n for o, n in zip(ones, loop)))
    batch_size = draw(st.one_of(st.none(), st.integers(1, 2 * max(1, math.prod(loop)))))
    return loop, shapes, batch_size


@settings(max_examples=12, deadline=None, derandomize=True, database=None)
@given(broadcast_problem())
def test_property_broadcasting(problem):
    loop, shapes, batch_size = problem
    args = [arange(*s, 2, start=i) for i, s in enumerate(shapes)]

    def f(*xs):
        return sum(jnp.sin(x).sum() * (i + 1) for i, x in enumerate(xs)), xs[0][::-1]

    out = check(
        f,
        *args,
        batch_size=batch_size,
        signature=",".join(["(c)"] * len(args)) + "->(),(c)",
    )
    assert out[0].shape == np.broadcast_shapes(*shapes)


# --------------------------------------------------------------------------------------
# Memory: no broadcast copy of any input.


def test_no_broadcast_copies():
    """An outer-product style call with L = (n, n) never builds the (n, n, k) broadcast
    of either input: by XLA's estimate, temp memory is the per-chunk working set plus
    the (N,) int32 example index, not the 4 * n * n * k bytes of one broadcast input,
    while jnp.vectorize (whose function here cannot be fused) pays for it."""
    n, k, batch = 256, 32, 64
    a = jax.ShapeDtypeStruct((n, k), jnp.float32)
    broadcast_bytes = 4 * n * n * k  # one input broadcast to the loop shape

    def program(vectorize):
        def run(x, y):
            f = vectorize(lambda u, v: jnp.sort(u * v)[-1], signature="(k),(k)->()")
            return f(x[:, None, :], y[None, :, :])

        return run

    ours = temp_bytes(
        program(lambda f, **kw: batch_vectorize(f, batch_size=batch, **kw)), a, a
    )
    theirs = temp_bytes(program(jnp.vectorize), a, a)
    assert theirs >= broadcast_bytes  # the reference does materialise it
    assert ours <= 4 * n * n + 8 * batch * k * 4  # the index and a few chunk buffers
    assert ours * 10 < broadcast_bytes

    # Inputs with the full loop shape are reshaped and sliced in place (no copy).
    full = jax.ShapeDtypeStruct((n, n, k), jnp.float32)
    f = batch_vectorize(
        lambda u, v: jnp.sort(u * v)[-1], signature="(k),(k)->()", batch_size=batch
    )
    assert temp_bytes(f, full, full) <= 8 * batch * k * 4


# jnp.vectorize's own wording first, chunkvmap's explanation after (issue 15): code and
# tests that match on jnp.vectorize's messages keep working.
JNP_ERRORS = {
    "none": lambda v: v(lambda x, y: x, signature="(n),(n)->(n)")(jnp.ones(3), None),
    "rank": lambda v: v(lambda x, y: x + y)(jnp.ones((2, 3)), jnp.ones(3)),
    "nargs": lambda v: v(lambda x, y: x, signature="(n),(n)->(n)")(jnp.ones(3)),
    "core": lambda v: v(jnp.dot, signature="(n),(n)->()")(jnp.ones(3), jnp.ones(4)),
    "ndim": lambda v: v(jnp.dot, signature="(m,n),(n)->(m)")(jnp.ones(3), jnp.ones(3)),
    "loop": lambda v: v(lambda x, y: x * y)(jnp.ones((2, 3)), jnp.ones((4, 3))),
    "out": lambda v: v(lambda x, e: x, signature="(n)->(m,m)", excluded={1})(
        jnp.ones(3), 0
    ),
}


@pytest.mark.parametrize("case", JNP_ERRORS)
def test_errors_start_with_jnp_vectorize_wording(case):
    with pytest.raises((TypeError, ValueError)) as expected:
        JNP_ERRORS[case](jnp.vectorize)
    chunked = ft.partial(batch_vectorize, batch_size=2)
    with pytest.raises(expected.type) as ours:
        JNP_ERRORS[case](chunked)
    # Up to jnp.vectorize's own pointer to the config option, if any.
    theirs = str(expected.value).split(" Set the jax_numpy_rank_promotion")[0]
    assert str(ours.value).startswith(theirs.rstrip(".")), (str(ours.value), theirs)
    assert "batch_vectorize" in str(ours.value)
