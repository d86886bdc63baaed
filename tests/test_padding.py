"""Poisson lots in one program: a padded buffer (`is_padding_example=`) costs what its
real examples cost, with values equal to the program for exactly those examples.

Chunks that hold only padding are skipped at run time (the real examples are
evaluated first, wherever the padding sits), so one compiled program serves every lot
size up to the buffer's capacity; the padding's per-example outputs are zeros.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from chunkvmap import batch_vmap, clipped_grad, clipped_grad_sum

from .helpers import clipped_sum, tree_allclose


C, B = 40, 8


def loss(p, x, y):
    h = jnp.tanh(x @ p["w"] + p["b"])
    return jnp.mean((h @ p["v"] - y) ** 2)


def _data(rng):
    p = {
        "w": jnp.asarray(rng.normal(size=(5, 7)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=7), jnp.float32),
        "v": jnp.asarray(rng.normal(size=(7, 2)), jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(C, 5)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(C, 2)), jnp.float32)
    return p, x, y


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_one_program_serves_twenty_lot_sizes(method, rng, always_ghost):
    """20 lot sizes from 0 to the capacity (half with the padding shuffled through
    the buffer), one jitted program: the clipped sum and the real examples' norms
    equal the oracle's (`jax.vmap(jax.grad)` of the whole buffer, the padding left
    out of the sum) and, for three of the lots, the program compiled for exactly
    the real examples; the padding's norms are zeros (an empty lot's sum too)."""
    p, x, y = _data(rng)
    grad = clipped_grad(
        loss, l2_clip_norm=0.5, batch_argnums=(1, 2), batch_size=B, method=method,
        return_grad_norms=True, keep_batch_dim=False,
    )  # fmt: skip
    padded = jax.jit(lambda p, x, y, m: grad(p, x, y, is_padding_example=m))
    sizes = [0, 1, 2, 5, 7, 8, 9, 11, 15, 16, 17, 20, 23, 24, 25, 31, 32, 33, 39, 40]
    for k, n in enumerate(sizes):
        pad = np.arange(C) >= n
        if k % 2:
            pad = rng.permutation(pad)
        total, aux = padded(p, x, y, jnp.asarray(pad))
        norms, real = np.asarray(aux.grad_norms), np.nonzero(~pad)[0]
        np.testing.assert_array_equal(norms[pad], 0.0)
        expected, expected_norms = clipped_sum(loss, 0.5, (p, x, y), pad=pad)
        tree_allclose(total, expected, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(norms[real], expected_norms[real], rtol=2e-5)
        if n in (9, 23, 40):  # the program for exactly the real examples
            exact_total, exact_aux = grad(p, x[real], y[real])
            tree_allclose(total, exact_total, rtol=2e-5, atol=1e-6)
            np.testing.assert_allclose(norms[real], exact_aux.grad_norms, rtol=2e-5)
    assert padded._cache_size() == 1


@pytest.mark.parametrize("method", ["vmap", "ghost"])
@pytest.mark.parametrize("where", ["end", "shuffled"])
def test_chunks_of_padding_alone_are_not_evaluated(method, where, rng, always_ghost):
    """9 real examples of 40 in chunks of 8: two chunks are evaluated (16 examples,
    the last partly padding), not five, wherever the padding sits."""
    p, x, y = _data(rng)
    evaluated = []

    def counted(p, x, y):
        jax.debug.callback(lambda v: evaluated.append(1), x)
        return loss(p, x, y)

    grad = clipped_grad(
        counted,
        l2_clip_norm=0.5,
        batch_argnums=(1, 2),
        batch_size=B,
        method=method,
        keep_batch_dim=False,
    )
    pad = np.arange(C) >= 9
    if where == "shuffled":
        pad = rng.permutation(pad)
    jax.block_until_ready(grad(p, x, y, is_padding_example=jnp.asarray(pad)))
    jax.effects_barrier()
    assert len(evaluated) == 16


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_a_padded_buffer_split_over_a_mesh(method, rng, always_ghost):
    """Split over the devices (`shard=True`, 8 CPU devices), a padded buffer gives
    the exact-size values too, and its padding's per-example outputs are zeros."""
    p, x, y = _data(rng)
    grad = clipped_grad(
        loss, l2_clip_norm=0.5, batch_argnums=(1, 2), batch_size=2, method=method,
        return_grad_norms=True, keep_batch_dim=False, shard=True,
    )  # fmt: skip
    pad = rng.permutation(np.arange(C) >= 13)
    real = np.nonzero(~pad)[0]
    total, aux = grad(p, x, y, is_padding_example=jnp.asarray(pad))
    exact_total, exact_aux = grad(p, x[real], y[real])
    tree_allclose(total, exact_total, rtol=2e-5, atol=1e-6)
    norms = np.asarray(aux.grad_norms)
    np.testing.assert_allclose(norms[real], exact_aux.grad_norms, rtol=2e-5)
    np.testing.assert_array_equal(norms[pad], 0.0)


def _net(w, v):
    return jnp.tanh(v @ w)


def test_batch_vmap_folds_a_padded_buffer_in_one_program(rng):
    """`batch_vmap(padded=True)` with a reduction: one jitted program for lots of
    every size (padding at the end or shuffled), equal to `jax.vmap` over the real
    examples alone, under `jax.grad` too; chunks of padding alone are skipped."""
    w = jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(C, 5)), jnp.float32)
    folded = batch_vmap(
        _net, (None, 0), batch_size=B, reduction=jnp.add,
        chunk_reduction=lambda y: y.sum(0), padded=True,
    )  # fmt: skip
    run = jax.jit(lambda w, x, m: folded(w, x, is_padding_example=m))
    grad = jax.jit(jax.grad(lambda w, x, m: run(w, x, m).sum()))
    for k, n in enumerate([1, 8, 13, 29, 40]):
        pad = np.arange(C) >= n
        if k % 2:
            pad = rng.permutation(pad)
        real = x[np.nonzero(~pad)[0]]
        np.testing.assert_allclose(
            run(w, x, pad), jax.vmap(_net, (None, 0))(w, real).sum(0), rtol=1e-5
        )
        expected = jax.grad(lambda w: jax.vmap(_net, (None, 0))(w, real).sum())(w)
        np.testing.assert_allclose(grad(w, x, pad), expected, rtol=1e-5, atol=1e-6)
    assert run._cache_size() == 1 and grad._cache_size() == 1
    evaluated = []

    def counted(w, v):
        jax.debug.callback(lambda _: evaluated.append(1), v)
        return _net(w, v)

    sums = batch_vmap(
        counted, (None, 0), batch_size=B, reduction=jnp.add,
        chunk_reduction=lambda y: y.sum(0), padded=True,
    )  # fmt: skip
    jax.block_until_ready(
        sums(w, x, is_padding_example=rng.permutation(np.arange(C) >= 9))
    )
    jax.effects_barrier()
    assert len(evaluated) == 16


def test_batch_vmap_padded_needs_a_reduction_and_flags():
    with pytest.raises(ValueError, match="padded=True without a reduction"):
        batch_vmap(_net, (None, 0), batch_size=2, padded=True)
    f = batch_vmap(
        _net, (None, 0), batch_size=2, reduction=jnp.add,
        chunk_reduction=lambda y: y.sum(0), padded=True,
    )  # fmt: skip
    w, x = jnp.ones((5, 3)), jnp.ones((6, 5))
    with pytest.raises(TypeError, match="is_padding_example=, a boolean vector"):
        f(w, x)
    with pytest.raises(TypeError, match="is_padding_example: an array of shape"):
        f(w, x, is_padding_example=jnp.zeros(6))
    with pytest.raises(ValueError, match="is_padding_example"):
        f(w, x, is_padding_example=jnp.zeros(4, bool))


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_clipped_grad_sum_counts_the_real_examples(method, rng, always_ghost):
    """`clipped_grad_sum` takes `is_padding_example=` too: one program for every
    lot, the sum over the real examples, and their count."""
    p, x, y = _data(rng)
    sums = clipped_grad_sum(loss, 0.5, batch_size=B, method=method)
    run = jax.jit(lambda p, x, y, m: sums(p, x, y, is_padding_example=m))
    for n in (0, 9, 31):
        pad = rng.permutation(np.arange(C) >= n)
        total, count = run(p, x, y, pad)
        assert int(count) == n
        tree_allclose(total, clipped_sum(loss, 0.5, (p, x, y), pad=pad)[0], atol=1e-6)
    assert run._cache_size() == 1
