"""Bad input gets an error naming the argument, what was expected and what arrived."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from chunkvmap import batch_map, batch_vmap

from .helpers import make_mesh


X = jnp.ones((6, 3), jnp.float32)


@pytest.mark.parametrize(
    "value, exc, match",
    [
        (
            0,
            ValueError,
            r"batch_size must be a positive int or None, but got batch_size=0",
        ),
        (-3, ValueError, r"batch_size=-3"),
        (2.0, TypeError, r"batch_size=2.0 of type float"),
        (True, TypeError, r"batch_size=True of type bool"),
        ("4", TypeError, r"batch_size='4' of type str"),
    ],
)
def test_bad_batch_size(value, exc, match):
    with pytest.raises(exc, match=match):
        batch_vmap(jnp.sum, batch_size=value)
    with pytest.raises(exc, match=match):
        batch_map(jnp.sum, X, value)


def test_numpy_integer_batch_size_is_accepted():
    out = batch_vmap(jnp.sum, batch_size=np.int64(4))(X)
    np.testing.assert_allclose(out, X.sum(1))


def test_unknown_keyword_is_named():
    with pytest.raises(
        TypeError,
        match=r"batch_vmap\(\) got an unexpected keyword argument 'chunksize'",
    ):
        batch_vmap(jnp.sum, chunksize=2)


def test_chunk_size_alias_conflicts_and_is_checked():
    with pytest.raises(TypeError, match="both batch_size=2 and its alias chunk_size=3"):
        batch_vmap(jnp.sum, batch_size=2, chunk_size=3)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        batch_vmap(jnp.sum, chunk_size=0)


def test_non_callables():
    with pytest.raises(TypeError, match="batch_vmap f must be a callable"):
        batch_vmap(3)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="reduction must be a callable or None"):
        batch_vmap(jnp.sum, reduction="sum")  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="chunk_reduction must be a callable"):
        batch_vmap(jnp.sum, chunk_reduction=None)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="batch_map fun must be a callable"):
        batch_map(None, X)  # pyright: ignore[reportArgumentType]


def test_mismatched_mapped_sizes_list_every_argument():
    with pytest.raises(ValueError) as info:
        batch_vmap(lambda a, b: a + b, batch_size=2)(X, {"y": jnp.ones((5, 3))})
    message = str(info.value)
    assert "inconsistent sizes for the mapped axis" in message
    assert "args[0] of shape (6, 3) has size 6 along axis 0" in message
    assert "args[1]['y'] of shape (5, 3) has size 5 along axis 0" in message


def test_mismatched_keyword_size_is_named():
    with pytest.raises(ValueError, match=r"kwargs\['w'\] of shape \(4,\) has size 4"):
        batch_vmap(lambda a, w: a.sum() * w, batch_size=2)(X, w=jnp.ones(4))


def test_axis_size_must_agree():
    with pytest.raises(ValueError, match="axis_size=5"):
        batch_vmap(jnp.sum, axis_size=5, batch_size=2)(X)


def test_no_mapped_argument_needs_axis_size():
    with pytest.raises(ValueError, match="at least one non-None value in in_axes"):
        batch_vmap(jnp.sum, in_axes=None, batch_size=2)(X)


def test_in_axes_of_wrong_type():
    with pytest.raises(TypeError, match=r"in_axes must be an int, None, or a tuple"):
        batch_vmap(jnp.sum, in_axes={"a": 0})
    with pytest.raises(TypeError, match=r"containing 'x' \(str\)"):
        batch_vmap(jnp.sum, in_axes=(0, "x"))
    with pytest.raises(TypeError, match=r"containing 1.0 \(float\)"):
        batch_vmap(jnp.sum, out_axes=1.0)
    with pytest.raises(TypeError, match=r"in_axes=True of type bool"):
        batch_vmap(jnp.sum, in_axes=True)


def test_in_axes_not_matching_the_arguments():
    with pytest.raises(
        ValueError, match=r"one entry per positional argument.*2 entries.*1"
    ):
        batch_vmap(jnp.sum, in_axes=(0, None), batch_size=2)(X)
    with pytest.raises(ValueError, match=r"in_axes must be a pytree prefix"):
        batch_vmap(lambda d: d["a"], in_axes=({"b": 0},), batch_size=2)({"a": X})


def test_out_axes_not_matching_the_output():
    with pytest.raises(ValueError, match=r"out_axes must be a pytree prefix"):
        batch_vmap(lambda v: (v, v), out_axes=(0, 0, 0), batch_size=2)(X)


def test_out_of_range_axes():
    with pytest.raises(
        ValueError,
        match=r"args\[0\] along axis 2, which is out of range for its shape \(6, 3\)",
    ):
        batch_vmap(jnp.sum, in_axes=2, batch_size=2)(X)
    with pytest.raises(ValueError, match=r"axis -3"):
        batch_vmap(jnp.sum, in_axes=-3, batch_size=2)(X)
    with pytest.raises(ValueError, match=r"is a scalar"):
        batch_vmap(jnp.sum, batch_size=2)(jnp.float32(1.0))
    with pytest.raises(
        ValueError,
        match=r"out_axes=2 is out of range for output out: .*valid axes are -1..0",
    ):
        batch_vmap(lambda v: v.sum(), out_axes=2, batch_size=2)(X)


def test_mapping_a_non_array():
    with pytest.raises(
        TypeError, match=r"maps args\[1\] along axis 0, but it is not an array"
    ):
        batch_vmap(lambda a, s: a, batch_size=2)(X, "text")


def test_axis_name_with_chunking_is_an_error():
    with pytest.raises(
        ValueError, match="collectives over 'i' inside f would only see one chunk"
    ):
        batch_vmap(lambda v: jax.lax.psum(v, "i"), axis_name="i", batch_size=2)(X)
    # Unchunked, it is plain vmap.
    out = batch_vmap(lambda v: jax.lax.psum(v, "i"), axis_name="i", batch_size=6)(X)
    np.testing.assert_allclose(
        out, jax.vmap(lambda v: jax.lax.psum(v, "i"), axis_name="i")(X)
    )


def test_shard_and_mesh_validation():
    with pytest.raises(TypeError, match="shard must be a bool, a mesh axis name"):
        batch_vmap(jnp.sum, shard=1)  # pyright: ignore[reportArgumentType]
    mesh1 = make_mesh((8,), ("b",), axis_types=(jax.sharding.AxisType.Auto,))
    mesh2 = make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with pytest.raises(
        ValueError,
        match=r"shard=True with a mesh of axes \('a', 'b'\).*shard='a' or "
        r"shard=\('a', 'b'\)",
    ):
        batch_vmap(jnp.sum, shard=True, mesh=mesh2)
    with pytest.raises(
        ValueError, match=r"shard=\('c',\), but the mesh has no axis 'c'"
    ):
        batch_vmap(jnp.sum, shard="c", mesh=mesh2)
    with pytest.raises(ValueError, match="shard=False"):
        batch_vmap(jnp.sum, mesh=mesh1)
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        batch_vmap(jnp.sum, shard=True, mesh="mesh")  # pyright: ignore[reportArgumentType]
    # Ambient N-D meshes are checked when called.
    with jax.set_mesh(mesh2):
        with pytest.raises(ValueError, match=r"shard=True with a mesh of axes"):
            batch_vmap(jnp.sum, shard=True)(jnp.ones((8, 2)))


def test_batch_map_bad_inputs():
    with pytest.raises(
        ValueError, match="strip_dim0=True .* needs batch_size=1, but got batch_size=2"
    ):
        batch_map(jnp.sum, X, 2, strip_dim0=True)
    with pytest.raises(TypeError, match=r"xs\[1\] is not an array"):
        batch_map(lambda c: c, (X, "a"), 2)
    with pytest.raises(ValueError, match="no array leaves"):
        batch_map(lambda c: c, {}, 2)
    with pytest.raises(ValueError, match=r"xs\['b'\] of shape \(5,\) has size 5"):
        batch_map(lambda c: c, {"a": X, "b": jnp.ones(5)}, 2)
    with pytest.raises(
        ValueError,
        match=r"chunk's 4 examples, but output out\[0\] has shape \(3,\)",
    ):
        batch_map(lambda c: (c.sum(0), c), X, 4)


def test_bad_remat():
    with pytest.raises(
        TypeError, match="remat must be True, False, or a jax.checkpoint policy"
    ):
        batch_vmap(jnp.sum, remat="yes")  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="remat=1 of type int"):
        batch_map(jnp.sum, X, 2, remat=1)  # pyright: ignore[reportArgumentType]


def test_bad_axis_size():
    with pytest.raises(TypeError, match="axis_size=False of type bool"):
        batch_vmap(jnp.sum, axis_size=False)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="axis_size=0.0 of type float"):
        batch_vmap(jnp.sum, axis_size=0.0)  # pyright: ignore[reportArgumentType]
    with pytest.raises(
        ValueError, match="non-negative int or None, but got axis_size=-1"
    ):
        batch_vmap(jnp.sum, axis_size=-1)


def test_batch_map_errors_name_batch_map():
    with pytest.raises(
        ValueError, match="^batch_map batch_size must be a positive int"
    ):
        batch_map(jnp.sum, X, 0)
    with pytest.raises(ValueError, match="^batch_map got inconsistent sizes"):
        batch_map(lambda c: c, {"a": X, "b": jnp.ones(5)}, 2)
    with pytest.raises(
        ValueError,
        match=r"^batch_map xs maps xs\['a'\] along axis 0, but it is a scalar",
    ):
        batch_map(lambda c: c, {"a": jnp.float32(1.0)}, 2)


def test_size_errors_name_the_users_arguments():
    from chunkvmap import per_example_grads

    loss = per_example_grads(
        lambda w, x, y: jnp.sum(w * x * y), batch_argnums=(1, 2), batch_size=2
    )
    with pytest.raises(
        ValueError,
        match=r"per_example_grads got inconsistent sizes(.|\n)*"
        r"  args\[1\] of shape \(5, 3\)(.|\n)*  args\[2\] of shape \(4, 3\)",
    ):
        loss(jnp.ones(3), jnp.ones((5, 3)), jnp.ones((4, 3)))


def test_filter_batch_vmap_size_errors_name_the_users_arguments():
    eqx = pytest.importorskip("equinox")
    from chunkvmap.eqx import filter_batch_vmap

    keys = jax.random.split(jax.random.key(0), 4)
    models = eqx.filter_vmap(lambda k: eqx.nn.Linear(3, 2, key=k))(keys)
    with pytest.raises(
        ValueError,
        match=r"filter_batch_vmap got inconsistent sizes(.|\n)*"
        r"  args\[0\]\.weight of shape \(4, 2, 3\)(.|\n)*  args\[1\] of shape \(5, 3\)",
    ):
        filter_batch_vmap(lambda m, x: m(x), batch_size=2)(models, jnp.ones((5, 3)))


@pytest.mark.parametrize("alias", ["batch_size", "chunk_size"])
def test_static_errors_are_raised_when_built_naming_the_argument(alias):
    from chunkvmap import batch_jacfwd, batch_map, batch_vectorize, per_example_grads

    with pytest.raises(
        ValueError, match=f"per_example_grads memory_limit='1MiB' .* {alias}='auto'"
    ):
        per_example_grads(jnp.sum, **{alias: 2}, memory_limit="1MiB")
    with pytest.raises(ValueError, match=f"batch_jacfwd {alias} must be a positive"):
        batch_jacfwd(jnp.sin, **{alias: 0})
    with pytest.raises(ValueError, match=f"batch_vectorize memory_limit=.* {alias}=2"):
        batch_vectorize(jnp.sin, **{alias: 2}, memory_limit="1MiB")
    with pytest.raises(ValueError, match="batch_map strip_dim0=True .* needs " + alias):
        batch_map(lambda c: c, jnp.ones(3), strip_dim0=True, **{alias: 2})


# --------------------------------------------------------------------------------------
# Issue 15's first findings: errors in the user's terms, the decorator form, and
# last_batch_size for a fixed batch size.


def test_non_jax_outputs_name_the_users_function_and_output():
    def my_model(x):
        return {"y": x, "label": "cat"}

    with pytest.raises(
        TypeError,
        match=r"batch_vmap: the function .*my_model returned a value of type str at "
        r"out\['label'\], which is not a valid JAX type",
    ):
        batch_vmap(my_model, batch_size=2)(jnp.ones(4))


def test_differentiating_an_integer_argument_raises_like_jax_grad():
    from chunkvmap import clipped_grad_sum, per_example_grads

    def loss(w, x, i):
        return (w * x).sum() * i

    args = (jnp.ones(3), jnp.ones((4, 3)), jnp.int32(2))
    with pytest.raises(TypeError):  # what jax.grad does
        jax.grad(loss, argnums=2)(jnp.ones(3), jnp.ones(3), jnp.int32(2))
    with pytest.raises(TypeError, match=r"per_example_grads differentiates args\[2\]"):
        per_example_grads(loss, argnums=2, batch_argnums=1)(*args)
    with pytest.raises(TypeError, match=r"clipped_grad_sum .* has dtype int32"):
        clipped_grad_sum(loss, 1.0, argnums=(0, 2), batch_argnums=1)(*args)


def test_batch_vmap_as_a_decorator_with_options():
    @batch_vmap(in_axes=(0, None), batch_size=2)
    def scaled(x, k):
        return x * k

    np.testing.assert_allclose(scaled(jnp.arange(5.0), 3.0), 3.0 * np.arange(5.0))


def test_last_batch_size_for_a_fixed_batch_size():
    from chunkvmap import last_batch_size, per_example_grads

    f = batch_vmap(jnp.sin, batch_size=3)
    assert last_batch_size(f) is None  # not called yet
    f(jnp.ones(10))
    assert last_batch_size(f) == 3
    f(jnp.ones(2))
    assert last_batch_size(f) == 2  # min(batch_size, N)

    def fun(c):
        return c * 2

    batch_map(fun, jnp.ones((7, 2)), batch_size=4)
    assert last_batch_size(fun) == 4
    grads = per_example_grads(lambda w, x: (w * x).sum(), chunk_size=4)
    grads(jnp.ones(3), jnp.ones((10, 3)))
    assert last_batch_size(grads) == 4


def test_messages_a_newcomer_meets():
    """The messages of a first hour: a shape error with keep_batch_dim=False gets a
    note about batches of one; a value that cannot be mapped is told how to pass it
    unmapped in the option's own words; shard=<axis names> without a mesh says so; a
    non-callable function is shown by type and shape; an out-of-range out_axes is
    named once."""
    import chunkvmap

    def loss(p, batch):  # written for a batch of one example
        x, y = batch
        return jnp.sum((x[0, :] @ p - y[0]) ** 2)

    p, x, y = jnp.ones(3), jnp.ones((5, 3)), jnp.ones(5)
    for method in ("vmap", "ghost"):
        fn = chunkvmap.clipped_grad(
            loss, l2_clip_norm=1.0, keep_batch_dim=False, method=method
        )
        with pytest.raises(IndexError) as info:
            fn(p, (x, y))
        assert any(
            "keep_batch_dim=True, the default" in n for n in info.value.__notes__
        )
    with pytest.raises(
        ValueError, match=r"scalar .*leave its argument out of batch_argnums"
    ):
        chunkvmap.clipped_grad_sum(lambda w, s: w * s, 1.0, batch_argnums=1)(1.0, 2.0)
    with pytest.raises(
        ValueError, match=r"pass it positionally, outside batch_argnums"
    ):
        chunkvmap.per_example_grads(lambda w, *, s: w * s)(jnp.ones(2), s=2.0)
    with pytest.raises(ValueError, match=r"names mesh axes, but no mesh: pass mesh="):
        batch_vmap(jnp.sin, shard="nonexistent")(jnp.ones(4))
    with pytest.raises(
        TypeError, match=r"f: an array of shape \(1000,\) and dtype float32\.$"
    ):
        batch_vmap(jnp.ones(1000))
    with pytest.raises(ValueError) as info:
        batch_vmap(jnp.sin, out_axes=3)(jnp.ones((2, 3)))
    assert str(info.value).count("out of range") == 1


def test_ghost_report_checks_its_loss_and_keywords():
    """`ghost_report` of a non-scalar loss raises as `clipped_grad_sum` does (it
    printed a report); a chunking option passed to it is named, not handed to the
    loss; the loss's own keyword arguments still reach it."""
    from chunkvmap import clipped_grad_sum, ghost_report

    p, x = {"w": jnp.ones((3, 2))}, jnp.ones(3)

    def outputs(p, x):
        return jnp.tanh(x @ p["w"])

    for call in (
        lambda: ghost_report(outputs, p, x),
        lambda: clipped_grad_sum(outputs, 1.0, method="ghost")(p, x[None]),
    ):
        with pytest.raises(TypeError, match=r"must return a real scalar loss"):
            call()

    def loss(p, x, scale=1.0, **options):
        return scale * jnp.sum(jnp.tanh(x @ p["w"]))

    def strict(p, x):
        return jnp.sum(jnp.tanh(x @ p["w"]))

    for fun in (loss, strict):
        with pytest.raises(
            TypeError,
            match=r"ghost_report got the keyword argument 'batch_size', which "
            rf".*{fun.__name__} does not (name|take)\. ghost_report\(fun, \*args, "
            r"argnums=0, batch_argnums=None, has_aux=False, \*\*kwargs\) takes "
            r".*batch_size is an option of the chunked functions",
        ):
            ghost_report(fun, p, x, batch_size=4)
    with pytest.raises(TypeError, match=r"keyword argument 'scal', which .*strict"):
        ghost_report(strict, p, x, scal=2.0)
    assert ghost_report(loss, p, x, scale=2.0).as_dict() == {"args[0]['w']": "ghost"}


def test_a_loss_written_for_a_whole_batch_gets_a_note():
    """A jax-privacy-style `loss(params, batch)` handed to the functions that map
    each example fails inside the loss with its own error, which gets a note (the
    loss sees one example; clipped_grad takes a loss of a whole batch); an error
    that is not the loss's own gets none."""
    from chunkvmap import clipped_grad_sum, per_example_grads

    def loss(params, batch):  # for a whole batch: one example has no batch axis
        x, y = batch
        return jnp.mean(jnp.sum((x @ params - y[:, None]) ** 2, 1))

    p, batch = jnp.ones(3), (jnp.ones((5, 3)), jnp.ones(5))
    for fn in (
        per_example_grads(loss),
        clipped_grad_sum(loss, 1.0),
        clipped_grad_sum(loss, 1.0, method="ghost"),
    ):
        with pytest.raises(IndexError, match=r"Too many indices") as info:
            fn(p, batch)
        (note,) = [n for n in info.value.__notes__ if "one example" in n]
        assert re.search(
            r"(per_example_grads|clipped_grad_sum) calls .*loss on one example at a "
            r"time, with the batch axis removed .* use chunkvmap\.clipped_grad, "
            r"which takes a loss of a whole batch",
            note,
        )

    def concrete(params, x):  # a tracer error: no note
        return jnp.sum(params * x) if x[0] > 0 else jnp.sum(params)

    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        per_example_grads(concrete)(p, batch[0])
    assert not any("one example" in n for n in getattr(info.value, "__notes__", []))


def test_argnums_pointing_at_the_examples_is_named():
    """`argnums` at the batch (the default `batch_argnums` then maps the
    parameters): said so, where the parameters' leaves were reported as
    inconsistent sizes; a batch whose own sizes disagree keeps that message."""
    from chunkvmap import clipped_grad_sum, per_example_grads

    def loss(p, batch):
        x, y = batch
        return jnp.sum((x @ p["w"] + p["b"] - y) ** 2)

    p = {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}
    batch = (jnp.ones((5, 3)), jnp.ones((5, 2)))
    for fn in (
        per_example_grads(loss, argnums=1),
        clipped_grad_sum(loss, 1.0, argnums=1),
    ):
        with pytest.raises(
            ValueError,
            match=r"differentiates args\[1\] \(argnums=1\), whose leaves all have "
            r"size 5 along axis 0, as a batch of examples has, and maps every other "
            r"argument \(batch_argnums=None\), the parameters included: "
            r"args\[0\]\['b'\] has 2; args\[0\]\['w'\] has 3\. argnums selects the "
            r"parameters to differentiate, passed whole to every example \(not "
            r"mapped\); batch_argnums selects the arguments holding the examples.* "
            r"Here the examples are differentiated and the parameters mapped: if "
            r"args\[1\] holds the examples, pass argnums=0 and batch_argnums=1\.",
        ):
            fn(p, batch)
    with pytest.raises(ValueError, match=r"inconsistent sizes"):
        per_example_grads(loss)(p, (jnp.ones((5, 3)), jnp.ones((4, 2))))


def test_a_scalar_keyword_argument_is_told_how_to_pass_it_unmapped():
    """Keyword arguments are always mapped (as in jax.vmap): the advice for a scalar
    one is not in_axes=None, which a keyword cannot be given."""

    def f(x, scale):
        return x * scale

    with pytest.raises(
        ValueError,
        match=r"kwargs\['scale'\].*positionally with "
        r"in_axes=None.*functools.partial",
    ):
        batch_vmap(f, batch_size=2)(jnp.ones(4), scale=2.0)
    with pytest.raises(ValueError, match=r"args\[1\].*: give it in_axes=None"):
        batch_vmap(f, batch_size=2)(jnp.ones(4), 2.0)


@pytest.mark.parametrize(
    "entry",
    ["clipped_grad_sum", "per_example_grads", "per_example_grad_norms", "clipped_grad"],
)
def test_parameters_without_a_float_leaf_are_refused(entry):
    """Integer parameters have no gradient: `jax.grad` raises, and so does every
    gradient transform, naming the argument and the dtypes (`clipped_grad_sum`
    returned `({'b': None, 'w': None}, n)` with no word: a DP loop trained
    nothing)."""
    import chunkvmap

    def loss(p, x):
        return jnp.sum(p["w"] * x) + p["b"]

    p = {"w": jnp.ones(3, jnp.int32), "b": jnp.int32(1)}
    x = jnp.ones((4, 3))
    fn = getattr(chunkvmap, entry)
    made = {
        "clipped_grad_sum": lambda: fn(loss, 1.0),
        "clipped_grad": lambda: fn(
            lambda p, x: jax.vmap(loss, (None, 0))(p, x).sum(), l2_clip_norm=1.0
        ),
    }.get(entry, lambda: fn(loss))()
    with pytest.raises(TypeError, match=r"args\[0\].*no floating-point leaf.*int32"):
        made(p, x)


def _lacking_entries():
    import chunkvmap

    def loss(p, x):
        return jnp.sum(jnp.abs(p["w"] * x) ** 2)

    return {
        "batch_vmap": lambda p, x: chunkvmap.batch_vmap(loss, (None, 0))(p, x),
        "batch_map": lambda p, x: chunkvmap.batch_map(lambda q: loss(q, x[0]), p),
        "per_example_grads": lambda p, x: chunkvmap.per_example_grads(loss)(p, x),
        "clipped_grad_sum": lambda p, x: chunkvmap.clipped_grad_sum(loss, 1.0)(p, x),
    }


@pytest.mark.parametrize(
    "entry", ["batch_vmap", "batch_map", "per_example_grads", "clipped_grad_sum"]
)
def test_a_dtype_the_backend_lacks_is_refused_by_name(monkeypatch, entry):
    """A backend without complex128 (the TPU: its compiler aborts the process on
    one) refuses such an argument at the call, naming it and the cast to make;
    here the current backend is told it lacks complex128."""
    import chunkvmap._transforms._batch_vmap as transforms

    backend = jax.default_backend()
    monkeypatch.setitem(transforms._MISSING_DTYPES, backend, (np.dtype(np.complex128),))
    with jax.enable_x64(True):
        p = {"w": jnp.ones((4, 3) if entry == "batch_map" else 3, jnp.complex128)}
        x = jnp.ones((4, 3), jnp.complex64)
        with pytest.raises(
            TypeError,
            match=rf"{entry} got args\[0\]\['w'\] of dtype complex128, which the "
            rf"{backend} backend does not have; cast it to complex64",
        ):
            _lacking_entries()[entry](p, x)
