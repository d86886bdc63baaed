"""The suite's mutation check: which tests catch each one-line wrong edit.

Each mutant replaces one exact string of the library's source, runs the named test
files (two xdist workers, as `make test`), records the tests that fail and restores
the source (also when interrupted). A mutant that no test catches is a gap in the
suite; before a test is deleted or merged, run this before and after and compare.

    .venv/bin/python dev/mutants.py                  # every mutant, its own files
    .venv/bin/python dev/mutants.py --all-files      # every mutant, the whole suite
    .venv/bin/python dev/mutants.py "stop batch_map" # one mutant

Prints one Markdown row per mutant (the catching tests) and writes them as JSON to
`--out` (default `mutants.json`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import subprocess
import sys
import time


ROOT = pathlib.Path(__file__).resolve().parents[1]
CHUNK = "        batch = _batch_size(body, inputs, options, auto, inputs.size, None)\n"
ORACLES = ["test_conformance", "test_memory"]


def stop(name: str, *files: str):
    """The entry point whose options are named `name` stops chunking (one chunk of
    all N examples): values stay right, so only memory, progress and program
    structure can catch it."""
    edit = CHUNK + f"        batch = None if name == {name!r} else batch\n"
    return ("chunkvmap/_core/_chunked.py", CHUNK, edit), [*ORACLES, *files]


GHOST_TESTS = ["test_ghost_rules", "test_ghost", "test_ghost_models", "test_clipping"]

MUTANTS = {
    "stop batch_vmap": stop("batch_vmap", "test_core", "test_progress"),
    "stop batch_map": stop("batch_map", "test_batch_map"),
    "stop per_example_grads": stop("per_example_grads", "test_grads"),
    "stop clipped_grad_sum": stop("clipped_grad_sum", "test_grads", "test_clipping"),
    "stop clipped_grad": stop("clipped_grad", "test_clipping"),
    "stop batch_jacfwd": stop("batch_jacfwd", "test_jacobians"),
    "stop batch_jacrev": stop("batch_jacrev", "test_jacobians"),
    "stop batch_vectorize": stop("batch_vectorize", "test_vectorize"),
    "stop eqx.filter_batch_vmap": stop("filter_batch_vmap", "test_eqx"),
    "stop linen.batch_vmap": stop("chunkvmap.linen.batch_vmap", "test_linen"),
    "stop nnx.batch_vmap": stop("chunkvmap.nnx.batch_vmap", "test_nnx"),
    "stop per_example_grad_norms": stop("per_example_grad_norms", "test_statistics"),
    "stop per_example_grad_stats": stop("per_example_grad_stats", "test_statistics"),
    "stop per_example_grad_gram": stop("per_example_grad_gram", "test_statistics"),
    "stop ggn_diagonal": stop("ggn_diagonal", "test_curvature"),
    "stop kfac_factors": stop("kfac_factors", "test_curvature"),
    "remainder window one example early": (
        (
            "chunkvmap/_core/_loop.py",
            "np.array(self.size - self.batch, i.dtype)",
            "np.array(self.size - self.batch - 1, i.dtype)",
        ),
        ["test_core", "test_conformance", "test_property", "test_reductions"],
    ),
    "ghost: dense pair term 1% too large": (
        (
            "chunkvmap/_quantities/ghost/_forms.py",
            "            terms.append(\n                jnp.einsum(\n",
            "            terms.append(\n                1.01 * jnp.einsum(\n",
        ),
        ["test_ghost_rules", "test_ghost", "test_ghost_models", "test_clipping"],
    ),
    "sharded: layout ignored, all N on every device": (
        (
            "chunkvmap/_core/_chunked.py",
            "    if lay is not None and lay.size > 1:\n",
            "    if False:\n",
        ),
        ["test_sharding", "test_layouts", "test_conformance", "test_memory"],
    ),
    "eager cache: programs keyed without their literals' values (Python constants)": (
        (
            "chunkvmap/_core/_program.py",
            '    return ("literal", v.aval, value.dtype.str, value.shape, value.tobytes'
            "())\n",
            '    return ("literal", v.aval)\n',
        ),
        ["test_cache", "test_compose"],
    ),
    "mesh: never resolved (nothing entered)": (
        (
            "chunkvmap/_core/_mesh.py",
            "    target = resolve(shard, mesh, flat)\n",
            "    target = None\n",
        ),
        ["test_wherever", "test_sharding", "test_layouts"],
    ),
    "mesh: mesh= entered with its own axis types over unplaced inputs": (
        (
            "chunkvmap/_core/_mesh.py",
            "return mesh if held else _sharding.all_auto(mesh)",
            "return mesh",
        ),
        ["test_wherever", "test_sharding", "test_layouts"],
    ),
    "conv: chunks keep their convolutions' layouts": (
        (
            "chunkvmap/_core/_chunked.py",
            "chunk_fn = _conv.canonical(chunk_fn)",
            "chunk_fn = chunk_fn",
        ),
        ["test_conv"],
    ),
    "conv: kernel gradient in the forward layout": (
        ("chunkvmap/_core/_conv.py", "laid = _for_kernel_grad(nd)", "pass"),
        ["test_conv"],
    ),
    "conv: input gradient's kernel with I and O unswapped": (
        (
            "chunkvmap/_core/_conv.py",
            "return (nd, nd + 1, *range(nd))",
            "return (nd + 1, nd, *range(nd))",
        ),
        ["test_conv"],
    ),
    "conv: output transposed back by the inverse permutation": (
        (
            "chunkvmap/_core/_conv.py",
            "out_perm[out_spec[role]] = out_at[role]",
            "out_perm[out_at[role]] = out_spec[role]",
        ),
        ["test_conv"],
    ),
    "conv: the input's tangent dropped": (
        (
            "chunkvmap/_core/_conv.py",
            "if not isinstance(d_lhs, SymbolicZero):",
            "if False:",
        ),
        ["test_conv"],
    ),
    "mesh: an eager transform under a held Explicit mesh not staged": (
        (
            "chunkvmap/_core/_mesh.py",
            "return _staged(held, None, run, flat, tree)",
            "return run(args, kwargs, None)",
        ),
        ["test_wherever"],
    ),
    "mesh: the adapters' calls not run under the call's mesh": (
        (
            "chunkvmap/_transforms/_batch_vmap.py",
            "key, lambda: self.cache(call()))",
            "key, lambda: _cache.EagerCache(call()))",
        ),
        ["test_wherever", "test_sharding"],
    ),
    "out_axes None: a varying output not checked before jax.vmap": (
        (
            "chunkvmap/_transforms/_batch_vmap.py",
            "        if a is None and b\n",
            "        if a is None and b and not b\n",
        ),
        ["test_core", "test_hostile", "test_eqx"],
    ),
    "moments: means held unshifted (a large mean cancels the variance)": (
        (
            "chunkvmap/_core/_accumulators.py",
            "    shift = lax.index_in_dim(g, 0, axis, keepdims=False)\n",
            "    shift = jnp.zeros_like(\n"
            "        lax.index_in_dim(g, 0, axis, keepdims=False))\n",
        ),
        ["test_statistics"],
    ),
    "ghost norms: a bf16 record's centred part left uncentred": (
        (
            "chunkvmap/_quantities/ghost/_forms.py",
            "    centred = (wide - mean).astype(kept[0])\n",
            "    centred = a.astype(kept[0])\n",
        ),
        ["test_ghost"],
    ),
    "ghost gradients: records of two types einsummed as they are": (
        (
            "chunkvmap/_quantities/ghost/_forms.py",
            "            *_common_type(arrays),\n",
            "            *arrays,\n",
        ),
        ["test_ghost"],
    ),
    "per-leaf norms: ghost's leaves in the wrong order": (
        (
            "chunkvmap/_quantities/_clipping.py",
            "each = [squares.get(k, zero) for k in range(len(record.plan.leaves))]",
            "each = [squares.get(k, zero) for k in range(len(record.plan.leaves))]"
            "[::-1]",
        ),
        ["test_statistics"],
    ),
    "per-leaf squared norms: ghost statistics' rules in the wrong order": (
        (
            "chunkvmap/_quantities/_statistics.py",
            "        for k, rows in zip(ruled, sq):\n",
            "        for k, rows in zip(ruled, sq[::-1]):\n",
        ),
        ["test_statistics"],
    ),
    "accumulators: stacked rows left at axis 0": (
        (
            "chunkvmap/_core/_accumulators.py",
            "next(kept) if a is None else jnp.moveaxis(next(stacked), 0, a)",
            "next(kept) if a is None else next(stacked)",
        ),
        ["test_loop", "test_nnx"],
    ),
    "accumulators: every fold taken for a sum": (
        (
            "chunkvmap/_core/_accumulators.py",
            "return self.reduction in _loop.SUMS",
            "return True",
        ),
        ["test_loop", "test_sharding"],
    ),
    "accumulators: moments merged with the other chunk's weight": (
        (
            "chunkvmap/_core/_accumulators.py",
            "weight = (count_a * share).astype(ma.dtype)",
            "weight = (count_b * share).astype(ma.dtype)",
        ),
        ["test_loop", "test_statistics"],
    ),
    "conv: depthwise convolutions laid out canonically": (
        ("chunkvmap/_core/_conv.py", "groups > 1\n", "groups < 0\n"),
        ["test_conv"],
    ),
    "conv: a per-example kernel gradient taken for a depthwise convolution": (
        (
            "chunkvmap/_core/_conv.py",
            "and window < math.prod(out[d] for d in out_spec[2:])",
            "",
        ),
        ["test_conv"],
    ),
    "ghost: c / w taken as linear in w": (
        (
            "chunkvmap/_quantities/ghost/_rules.py",
            "lax.div_p: Elementwise(linear=(0,)),",
            "lax.div_p: Elementwise(linear=(0, 1)),",
        ),
        GHOST_TESTS,
    ),
    "ghost: non-finite masking zeroes finite entries": (
        (
            "chunkvmap/_quantities/ghost/_forms.py",
            "                if set(syms) <= set(spec):",
            "                if set(syms) & set(spec):",
        ),
        GHOST_TESTS,
    ),
    "ghost: a cond inside a scan records the scan's axes": (
        (
            "chunkvmap/_quantities/ghost/_primitives.py",
            "avals = by_key[key].record_avals(at.depth)",
            "avals = by_key[key].record_avals(0)",
        ),
        GHOST_TESTS,
    ),
    "ghost: squared norms summed in bfloat16": (
        (
            "chunkvmap/_quantities/ghost/_plan.py",
            "return jnp.float64 if wide else jnp.float32",
            "return jnp.float64 if wide else jnp.bfloat16",
        ),
        GHOST_TESTS,
    ),
    "ghost: nan_safe's masked leaf's norm taken as finite": (
        (
            "chunkvmap/_quantities/_clipping.py",
            "squares[k] = jnp.where(finite, safe[-1], jnp.nan)",
            "squares[k] = safe[-1]",
        ),
        GHOST_TESTS,
    ),
    "ghost: a scan's constant leaf taken as stacked": (
        (
            "chunkvmap/_quantities/ghost/_primitives.py",
            "inner = [_level(i, Level(False, length), None) for i in consts]",
            "inner = [_level(i, Level(True, length), None) for i in consts]",
        ),
        GHOST_TESTS,
    ),
    "ghost: a rows form meeting a dense one the other way round unswapped": (
        (
            "chunkvmap/_quantities/ghost/_forms.py",
            "(EinsumForm, RowsForm): _ROWS_DENSE.swapped(),",
            "(EinsumForm, RowsForm): _ROWS_DENSE,",
        ),
        GHOST_TESTS,
    ),
    "ghost: nan_safe's fix of non-finite examples skipped": (
        (
            "chunkvmap/_quantities/_clipping.py",
            "jnp.any(chosen), self._fix_nonfinite",
            "jnp.any(chosen) & False, self._fix_nonfinite",
        ),
        GHOST_TESTS,
    ),
    "ghost: the ghost program runs wherever a leaf has a ghost norm": (
        (
            "chunkvmap/_quantities/ghost/_plan.py",
            "        if moved - extra >= _GAIN * vmap_cost:\n",
            "        if True:\n",
        ),
        GHOST_TESTS,
    ),
    "ghost: a ghost program predicted slower runs silently": (
        (
            "chunkvmap/_quantities/ghost/_plan.py",
            "                Method.GHOST,\n                True,\n",
            "                Method.GHOST,\n                False,\n",
        ),
        GHOST_TESTS,
    ),
    "ghost: a dynamic_slice's start index read unclamped": (
        (
            "chunkvmap/_quantities/ghost/_rules.py",
            "row, _ = _row_index(recorded[start].reshape(positions), rows_n)",
            "row = recorded[start].reshape(positions).astype(jnp.int32)",
        ),
        GHOST_TESTS,
    ),
    "ghost moments: examples merged unshifted": (
        (
            "chunkvmap/_quantities/_statistics.py",
            "            first.instantiate(k).astype(_stats_dtype(",
            "            0 * first.instantiate(k).astype(_stats_dtype(",
        ),
        ["test_statistics"],
    ),
    "ghost: einsum cross terms not centred over positions": (
        (
            "chunkvmap/_quantities/ghost/_forms.py",
            "    if not positions:\n",
            "    if True:\n",
        ),
        GHOST_TESTS,
    ),
    "ghost: convolution gradients formed from patches": (
        (
            "chunkvmap/_quantities/ghost/_rules.py",
            "            if not use.levels:\n                form.windows",
            "            if False:\n                form.windows",
        ),
        GHOST_TESTS,
    ),
    "ghost: the vmap program's convolution kernel gradients taken as cheap": (
        (
            "chunkvmap/_quantities/ghost/_plan.py",
            "            convs += _CONV * sum(",
            "            convs += 0 * sum(",
        ),
        GHOST_TESTS,
    ),
    "gram: each chunk of rows reaches one example fewer": (
        (
            "chunkvmap/_quantities/_statistics.py",
            "        width = min(size, size // 2 + batch)\n",
            "        width = min(size, size // 2 + batch - 1)\n",
        ),
        ["test_statistics", "test_conformance"],
    ),
    "gram: an entry read from its own row wherever that reached it": (
        (
            "chunkvmap/_quantities/_statistics.py",
            "        mine = (ij < width) & ((i <= j) | (ji >= width))\n",
            "        mine = ij < width\n",
        ),
        ["test_statistics", "test_conformance"],
    ),
    "gram: ghost terms kept for every ghost leaf": (
        (
            "chunkvmap/_quantities/_statistics.py",
            "    return ghost < _GRAM_GHOST_SPEED * (2 * leaf.size + inst / chunk)\n",
            "    return True\n",
        ),
        ["test_statistics"],
    ),
    "accumulators: a fold's last chunk summarises its whole window": (
        (
            "chunkvmap/_core/_accumulators.py",
            "        windows=all(leaf.windows for leaf in leaves),\n",
            "        windows=True,\n",
        ),
        ["test_statistics", "test_reductions", "test_conformance", "test_clipping"],
    ),
    "ghost: a program predicted slower run for its memory without checking it": (
        (
            "chunkvmap/_quantities/_choice.py",
            "    return report.slower and report.verdict is not None\n",
            "    return False\n",
        ),
        [*GHOST_TESTS, "test_choice"],
    ),
    "choice: a vmap program whose chunk fits the budget not run": (
        (
            "chunkvmap/_quantities/_choice.py",
            "    if budget is not None and v <= budget:\n",
            "    if budget is not None and v < 0:\n",
        ),
        [*GHOST_TESTS, "test_choice"],
    ),
    "policy: projections run their ghost program whatever the choice": (
        (
            "chunkvmap/_quantities/_projections.py",
            "        if runs is None:\n            runs = _chosen(",
            "        if runs is None:\n"
            "            runs = ghost.Method.GHOST or _chosen(",
        ),
        ["test_choice", "test_projections"],
    ),
    "policy: the GGN diagonal runs its ghost program whatever the choice": (
        (
            "chunkvmap/_quantities/_curvature.py",
            "            runs = self._chosen("
            "transform, quantity, args, kwargs, extra)\n",
            "            runs = ghost.Method.GHOST\n",
        ),
        ["test_choice", "test_curvature"],
    ),
    "policy: EK-FAC runs its ghost program whatever the choice": (
        (
            "chunkvmap/_quantities/_ekfac.py",
            "            runs = _chosen(transform, fun, found, data, how, quantity, "
            "redo=redo)\n",
            "            runs = ghost.Method.GHOST\n",
        ),
        ["test_choice", "test_ekfac"],
    ),
    "policy: the Gram matrix runs its ghost program whatever the choice": (
        (
            "chunkvmap/_quantities/_statistics.py",
            "                runs = self.chosen(rows, dots, args, diff, in_axes)\n",
            "                runs = ghost.Method.GHOST\n",
        ),
        ["test_choice", "test_statistics"],
    ),
    "policy: a quantity's ghost program taken to help where it helps no leaf": (
        (
            "chunkvmap/_quantities/_choice.py",
            "    if not helped:\n",
            "    if False:\n",
        ),
        ["test_choice", "test_projections", "test_curvature", "test_ekfac"],
    ),
    "policy: a fallback not warned": (
        (
            "chunkvmap/_quantities/_choice.py",
            "    warn_fallback(transform, fun, report)\n    return report.runs\n",
            "    return report.runs\n",
        ),
        [*GHOST_TESTS, "test_choice", "test_statistics"],
    ),
    "choice: a call's memory_limit not its budget": (
        (
            "chunkvmap/_quantities/_choice.py",
            "    return limit if limit is not None else _memory.host_budget()\n",
            "    return _memory.host_budget()\n",
        ),
        ["test_choice"],
    ),
    "choice: the budget the machine's whole memory": (
        (
            "chunkvmap/_core/_memory.py",
            "HOST_FRACTION = 0.25\n",
            "HOST_FRACTION = 1.0\n",
        ),
        ["test_choice"],
    ),
    "auto: an accelerator's temporary figure taken for its memory": (
        (
            "chunkvmap/_core/_memory.py",
            '    if (platform or default_platform()) == "cpu":\n'
            "        return temp\n",
            "    return temp\n",
        ),
        ["test_auto"],
    ),
    "auto: a program on the CPU measured by the default backend's rule": (
        (
            "chunkvmap/_core/_memory.py",
            "    return program_bytes(analysis, platform_of(compiled))\n",
            "    return program_bytes(analysis)\n",
        ),
        ["test_auto"],
    ),
    "auto: the budget counts memory the device already holds as free": (
        (
            "chunkvmap/_core/_memory.py",
            '    free = limit - int((stats or {}).get("bytes_in_use", 0))\n',
            "    free = limit\n",
        ),
        ["test_auto"],
    ),
    "backend: a dtype the backend lacks reaches its compiler": (
        (
            "chunkvmap/_transforms/_batch_vmap.py",
            "    if not missing:\n        return\n",
            "    return\n",
        ),
        ["test_errors", "test_grads"],
    ),
    "choice: an unmeasured accelerator call warned by the CPU model": (
        (
            "chunkvmap/_quantities/_choice.py",
            '    if platform() != "cpu":\n        report = _unmeasured(report)\n',
            "",
        ),
        ["test_choice"],
    ),
    "choice: a failed measurement warned slower by the CPU model": (
        (
            "chunkvmap/_quantities/_choice.py",
            "        return _unmeasured(report)\n    logger.info(",
            "        return report\n    logger.info(",
        ),
        ["test_choice"],
    ),
    "choice: each process of a job times its own": (
        (
            "chunkvmap/_quantities/_choice.py",
            "        and jax.process_count() == 1\n",
            "",
        ),
        ["test_choice"],
    ),
    "choice: the slower measured program runs": (
        (
            "chunkvmap/_quantities/_choice.py",
            "        if v is None or (g is not None and g <= _TIE * v)\n",
            "        if v is None or (g is not None and g >= _TIE * v)\n",
        ),
        ["test_choice"],
    ),
    "choice: nothing against nothing taken as memory saved": (
        (
            "chunkvmap/_quantities/_choice.py",
            "    if v > 0 and g <= (1 - _MEMORY_GAIN) * v:\n",
            "    if g <= (1 - _MEMORY_GAIN) * v:\n",
        ),
        ["test_choice"],
    ),
    "choice: a measurement kept for another chunk size": (
        (
            "chunkvmap/_quantities/_choice.py",
            '    key = ("timed" if timed else "memory", chunk, device.id, device.platform)\n',
            '    key = ("timed" if timed else "memory", device.id, device.platform)\n',
        ),
        ["test_choice"],
    ),
    "choice: a program out of device memory chosen": (
        (
            "chunkvmap/_quantities/_choice.py",
            "        if v is None or (g is not None and g <= _TIE * v)",
            "        if v is not None and (g is not None and g <= _TIE * v)",
        ),
        ["test_choice"],
    ),
    "choice: the stand-ins keep the call's number of examples": (
        (
            "chunkvmap/_quantities/_choice.py",
            "        shape[axis] = chunk\n",
            "        pass\n",
        ),
        ["test_choice"],
    ),
    "trace: the chunk traced outside the context its loop runs in": (
        (
            "chunkvmap/_core/_chunked.py",
            "    if lay is None or lay.size <= 1:\n",
            "    if True:\n",
        ),
        ["test_sharding"],
    ),
    "trace: over Explicit axes, the chunk traced at plain types": (
        (
            "chunkvmap/_core/_sharding.py",
            "    if lay is None or not lay.explicit or not isinstance(x, jax.Array):",
            "    if True:",
        ),
        ["test_sharding"],
    ),
    "trace: a trace made under one mesh run under another": (
        (
            "chunkvmap/_core/_program.py",
            "    return portable and "
            "jax.sharding.AxisType.Explicit not in here.axis_types",
            "    return True",
        ),
        ["test_sharding", "test_wherever"],
    ),
    "trace: a retrace's outputs in the latest trace's structure, not its own": (
        (
            "chunkvmap/_core/_program.py",
            "        return tree.unflatten(this.apply(params, *values))",
            "        return self._tree().unflatten(this.apply(params, *values))",
        ),
        ["test_sharding", "test_ghost"],
    ),
    "trace: an unmapped leaf over Explicit axes traced at its plain type": (
        (
            "chunkvmap/_core/_sharding.py",
            "    if axis is None:  # as `_prepare` lays it out: off the layout's "
            "axes\n",
            "    if axis is None:  # as `_prepare` lays it out: off the layout's "
            "axes\n        return plain\n",
        ),
        ["test_sharding"],
    ),
    "trace: the global remainder chunked at its own length, not the shares'": (
        (
            "chunkvmap/_core/_sharding.py",
            "        plan = window(n, length, offset)",
            "        plan = make_plan(n, self.batch, offset)",
        ),
        ["test_sharding"],
    ),
    "window: a remainder window keeps its first outputs, not its last": (
        (
            "chunkvmap/_core/_loop.py",
            "    return lax.slice_in_dim(y, y.shape[axis] - n, y.shape[axis], "
            "axis=axis)",
            "    return lax.slice_in_dim(y, 0, n, axis=axis)",
        ),
        ["test_sharding"],
    ),
    "mesh: the layout takes the mesh= given, not the one the call resolved": (
        (
            "chunkvmap/_core/_sharding.py",
            "        mesh = known.mesh\n",
            "        mesh = known.mesh if mesh is None else mesh\n",
        ),
        ["test_sharding", "test_wherever"],
    ),
    "ghost: a loss planned again on every eager call": (
        (
            "chunkvmap/_quantities/ghost/_traced.py",
            '    kept = memo(("ghost loss", key), lambda: traced)\n',
            "    kept = traced\n",
        ),
        ["test_cache", *GHOST_TESTS],
    ),
    "ghost: a later call evaluated by the first call's program": (
        (
            "chunkvmap/_quantities/ghost/_traced.py",
            "        self.closed = other.closed\n",
            "        self.closed = self.closed\n",
        ),
        ["test_cache", "test_closures", *GHOST_TESTS],
    ),
    "gram: per-share starts gathered, not rolled": (
        (
            "chunkvmap/_quantities/_statistics.py",
            "        if ghost.explicit_spec(()) is not None:",
            "        if False:",
        ),
        ["test_statistics", "test_wherever"],
    ),
    "padding: chunks of padding alone evaluated": (
        (
            "chunkvmap/_core/_loop.py",
            "            return lax.cond(plan.active(i), step, lambda c, i: c, carry, "
            "i), None\n",
            "            return step(carry, i), None\n",
        ),
        ["test_padding", "test_clipping"],
    ),
    "padding: the padding's per-example outputs left as evaluated": (
        (
            "chunkvmap/_quantities/_clipping.py",
            "    extras = _padding.zeroed(call.padding, extras)\n",
            "    pass\n",
        ),
        ["test_padding", "test_clipping"],
    ),
    "padding: batch_vmap's padding outputs not zeroed": (
        (
            "chunkvmap/_transforms/_batch_vmap.py",
            "        return jax.tree.map(lambda o: jnp.where(pad, jnp.zeros((), "
            "o.dtype), o), out)\n",
            "        return out\n",
        ),
        ["test_padding"],
    ),
    "padding: clipped_grad_sum counts the padding": (
        (
            "chunkvmap/_quantities/_clipping.py",
            "    return total, extras, size - jnp.sum(call.padding, dtype=jnp.int32)\n",
            "    return total, extras, size\n",
        ),
        ["test_padding", "test_clipping"],
    ),
    "padding: the real examples not evaluated first": (
        (
            "chunkvmap/_core/_loop.py",
            "    order = jnp.zeros(size, np.int32).at[place].set(examples, "
            "unique_indices=True)\n",
            "    order = examples\n",
        ),
        ["test_padding", "test_clipping"],
    ),
    "curvature: the exact root without the square root of p": (
        (
            "chunkvmap/_quantities/_curvature.py",
            "    root = (eye - p[..., :, None]) * jnp.sqrt(p)[..., None, :]\n",
            "    root = (eye - p[..., :, None]) * p[..., None, :]\n",
        ),
        ["test_curvature"],
    ),
    "curvature: Monte-Carlo labels not scaled by the samples": (
        (
            "chunkvmap/_quantities/_curvature.py",
            "        return (p[None] - drawn) / math.sqrt(samples)\n",
            "        return p[None] - drawn\n",
        ),
        ["test_curvature"],
    ),
    "curvature: the diagonal squares the sum over the cotangents": (
        (
            "chunkvmap/_quantities/_curvature.py",
            "            squares = [[jnp.sum(jnp.square(g), 0) for g in part] for part "
            "in grads]\n",
            "            squares = [[jnp.square(jnp.sum(g, 0)) for g in part] for part "
            "in grads]\n",
        ),
        ["test_curvature"],
    ),
    "curvature: the ghost diagonal's activations not squared": (
        (
            "chunkvmap/_quantities/_curvature.py",
            "                squares = [a * a, jnp.sum(jnp.square(g), 0)]\n",
            "                squares = [a, jnp.sum(jnp.square(g), 0)]\n",
        ),
        ["test_curvature"],
    ),
    "curvature: a use over positions taken as one outer product": (
        (
            "chunkvmap/_quantities/_curvature.py",
            "        and _positions(u.form) == 1\n",
            "        and _positions(u.form) >= 1\n",
        ),
        ["test_curvature"],
    ),
    "curvature: reduce sums the activations instead of averaging": (
        (
            "chunkvmap/_quantities/_curvature.py",
            "            mean = a_sum / count\n",
            "            mean = a_sum\n",
        ),
        ["test_curvature"],
    ),
    "curvature: a bias's corner entry one, not the count of its positions": (
        (
            "chunkvmap/_quantities/_curvature.py",
            "            corner = jnp.full((1, 1), count, inputs.dtype)\n",
            "            corner = jnp.full((1, 1), 1, inputs.dtype)\n",
        ),
        ["test_curvature"],
    ),
    "curvature: a bias not joined to its weight's factors": (
        (
            "chunkvmap/_quantities/_curvature.py",
            "                pairs[w] = b\n",
            "                pass\n",
        ),
        ["test_curvature"],
    ),
    "curvature: a leaf with no factors squares its summed cotangents": (
        (
            "chunkvmap/_quantities/_curvature.py",
            "    return jnp.sum(jnp.square(f32(formed(plan, k, records, deltas, pe))), 0)\n",
            "    return jnp.square(jnp.sum(f32(formed(plan, k, records, deltas, pe)), 0))\n",
        ),
        ["test_curvature"],
    ),
    "curvature: a tied leaf given Kronecker factors of one use": (
        (
            "chunkvmap/_quantities/_curvature.py",
            "        if len(found) != 1:\n",
            "        if not found:\n",
        ),
        ["test_curvature"],
    ),
    "projections: a part of a leaf projected by the wrong rows": (
        (
            "chunkvmap/_quantities/_projections.py",
            "    return m[start : start + (size - 1) * stride + 1 : stride]\n",
            "    return m[:size]\n",
        ),
        ["test_projections"],
    ),
    "projections: a projected axis moved to the front": (
        (
            "chunkvmap/_quantities/_projections.py",
            "            g = jnp.moveaxis(jnp.tensordot(g, p.astype(g.dtype), "
            "([j], [0])), -1, j)\n",
            "            g = jnp.moveaxis(jnp.tensordot(g, p.astype(g.dtype), "
            "([j], [0])), -1, 0)\n",
        ),
        ["test_projections"],
    ),
    "projections: cosine scores without normalising the other batch": (
        (
            "chunkvmap/_quantities/_projections.py",
            "        other = other / jnp.linalg.norm(other, axis=1, keepdims=True)\n",
            "        pass\n",
        ),
        ["test_projections"],
    ),
    "projections: a lookup's padding positions projected": (
        (
            "chunkvmap/_quantities/_projections.py",
            "        picked = jnp.where(valid[:, None], jnp.take(p, rows, axis=0), 0)"
            "\n",
            "        picked = jnp.take(p, rows, axis=0)\n",
        ),
        ["test_projections"],
    ),
    "curvature: a Kronecker's count of examples alone, not their positions": (
        (
            "chunkvmap/_quantities/_curvature.py",
            "                count += a.shape[0] * _positions(u.form)\n",
            "                count += a.shape[0]\n",
        ),
        ["test_curvature"],
    ),
    "curvature: a Kronecker's axes in the leaf's order, not the factors'": (
        (
            "chunkvmap/_quantities/_curvature.py",
            "    return tuple(tuple(s.axis for s in g) for g in groups)\n",
            "    return tuple(tuple(sorted(s.axis for s in g)) for g in "
            "groups[::-1])\n",
        ),
        ["test_curvature"],
    ),
    "preconditioning: the outputs factor not divided by the count": (
        (
            "chunkvmap/_quantities/_projections.py",
            "    (sa, ua), (sg, ug) = eigh(a), eigh(g / entry.count)\n",
            "    (sa, ua), (sg, ug) = eigh(a), eigh(g)\n",
        ),
        ["test_projections"],
    ),
    "preconditioning: damping absolute, not relative to the mean eigenvalue": (
        (
            "chunkvmap/_quantities/_projections.py",
            "    lam = damping * jnp.mean(values)\n",
            "    lam = jnp.asarray(damping)\n",
        ),
        ["test_projections"],
    ),
    "preconditioning: the whitened block put back in the factors' axis order": (
        (
            "chunkvmap/_quantities/_projections.py",
            "        return x.transpose(np.argsort(order)).reshape(-1)\n",
            "        return x.transpose(order).reshape(-1)\n",
        ),
        ["test_projections"],
    ),
    "conv windows: the Gram's cross term counted once": (
        (
            "chunkvmap/_quantities/ghost/_rules.py",
            "                2 * jnp.sum(cross * ds),\n",
            "                jnp.sum(cross * ds),\n",
        ),
        GHOST_TESTS,
    ),
    "conv windows: the means' term left out": (
        (
            "chunkvmap/_quantities/ghost/_rules.py",
            "                jnp.sum(means * ss),\n",
            "                jnp.zeros((), acc),\n",
        ),
        GHOST_TESTS,
    ),
    "conv windows: the views not centred": (
        (
            "chunkvmap/_quantities/ghost/_rules.py",
            "            cv = v - m\n",
            "            cv = v\n",
        ),
        GHOST_TESTS,
    ),
    "conv windows: each offset's entries summed, not squared": (
        (
            "chunkvmap/_quantities/ghost/_rules.py",
            "                return None, jnp.sum(jnp.square(gk))\n",
            "                return None, jnp.sum(gk)\n",
        ),
        GHOST_TESTS,
    ),
    "conv windows: the kernel's constant factor left out of its norm": (
        (
            "chunkvmap/_quantities/ghost/_rules.py",
            "        if self.scale != 1.0:\n",
            "        if False:\n",
        ),
        GHOST_TESTS,
    ),
    "conv windows: a kernel broadcast from its leaf taken as the leaf": (
        (
            "chunkvmap/_quantities/ghost/_rules.py",
            "    return form.complete and None not in leaves and len(set(leaves)) == "
            "len(leaves)\n",
            "    return form.complete\n",
        ),
        GHOST_TESTS,
    ),
    "conv windows: non-finite columns not zeroed in the views": (
        (
            "chunkvmap/_quantities/ghost/_rules.py",
            "            return jnp.where(bad_k.reshape(shape), "
            "jnp.zeros((), xs.dtype), xs)\n",
            "            return xs\n",
        ),
        GHOST_TESTS,
    ),
    "conv windows: non-finite output features not zeroed": (
        (
            "chunkvmap/_quantities/ghost/_rules.py",
            "    return columns, jnp.where(features, jnp.zeros((), delta.dtype), delta)"
            "\n",
            "    return columns, delta\n",
        ),
        GHOST_TESTS,
    ),
    "conv windows: a gradient finite whatever its columns": (
        (
            "chunkvmap/_quantities/ghost/_rules.py",
            "        finite = ~(jnp.any(bad) | jnp.any(bad_out))\n",
            "        finite = ~jnp.any(bad_out)\n",
        ),
        GHOST_TESTS,
    ),
    "nan_safe: a leaf smaller than its operands masked, not formed": (
        (
            "chunkvmap/_quantities/_clipping.py",
            "            if safe and plan.maskable(k) and not (k in instantiated and "
            "small(k))\n",
            "            if safe and plan.maskable(k)\n",
        ),
        GHOST_TESTS,
    ),
    "remainder: the ghost sums' last window summarised at its own length": (
        (
            "chunkvmap/_quantities/_records.py",
            "        quantity.chunk, quantity.combine, uncount=quantity.uncount, "
            "pure=True\n",
            "        quantity.chunk, quantity.combine, uncount=None, pure=True\n",
        ),
        GHOST_TESTS,
    ),
    "remainder: the last window's covered examples counted again": (
        (
            "chunkvmap/_core/_loop.py",
            "        return lax.iota(jnp.int32, self.batch) >= first\n",
            "        return lax.iota(jnp.int32, self.batch) >= 0\n",
        ),
        GHOST_TESTS,
    ),
    "remainder: the last window's covered non-finite examples fixed again": (
        (
            "chunkvmap/_quantities/_clipping.py",
            "        return fix if self.fresh is None else fix & self.fresh\n",
            "        return fix\n",
        ),
        GHOST_TESTS,
    ),
    "remainder: the ghost moments' last window summarised at its own length": (
        (
            "chunkvmap/_quantities/_statistics.py",
            "        real = fresh if real is None else real & fresh\n",
            "        return chunk\n",
        ),
        ["test_statistics"],
    ),
    "tap: only the first iteration's norm": (
        (
            "chunkvmap/_quantities/ghost/_plan.py",
            "jnp.sum(deltas.pop(self.leaves[k].uses[0].path).zero)",
            "jnp.sum(deltas.pop(self.leaves[k].uses[0].path).zero.ravel()[:1])",
        ),
        GHOST_TESTS,
    ),
    "tap: a leaf every iteration reads whole tapped per iteration": (
        (
            "chunkvmap/_quantities/ghost/_plan.py",
            "            and all(level.stacked for level in u.levels)\n",
            "            and True\n",
        ),
        [*GHOST_TESTS, "test_statistics"],
    ),
    "tap: the layer's input cotangent not passed back": (
        (
            "chunkvmap/_quantities/ghost/_plan.py",
            "            return cotangents, sq.astype(zero.dtype)\n",
            "            return jax.tree.map(jnp.zeros_like, cotangents), "
            "sq.astype(zero.dtype)\n",
        ),
        GHOST_TESTS,
    ),
    "two passes: the second backward pass unweighted": (
        (
            "chunkvmap/_quantities/_clipping.py",
            "        return c.astype(value.dtype) * value\n",
            "        return value\n",
        ),
        GHOST_TESTS,
    ),
    "two passes: an example not counted keeps its own inputs": (
        (
            "chunkvmap/_quantities/_clipping.py",
            "            pick = lambda x, y: jnp.where(left_out, y, x)  # noqa: E731\n",
            "            pick = lambda x, y: x  # noqa: E731\n",
        ),
        GHOST_TESTS,
    ),
    "conv: an accelerator's call laid out as the CPU's": (
        (
            "chunkvmap/_core/_conv.py",
            '        if default_platform() != "cpu":\n',
            "        if False:\n",
        ),
        ["test_conv"],
    ),
    "passes: a left-out example keeps its weight": (
        (
            "chunkvmap/_quantities/_clipping.py",
            "            c = jnp.where(left_out, jnp.zeros((), c.dtype), c)\n",
            "            c = c\n",
        ),
        ["test_clipping", "test_padding", *GHOST_TESTS],
    ),
    "passes: the non-finite examples not formed apart": (
        (
            "chunkvmap/_quantities/_clipping.py",
            "    total = jax.tree.map(lambda t, f: t + f.astype(t.dtype), total, fixed)\n",
            "    total = total\n",
        ),
        ["test_clipping", "test_padding"],
    ),
    "passes: every example read as finite": (
        (
            "chunkvmap/_quantities/_clipping.py",
            "        return (scale, jnp.isfinite(sq)), extras\n",
            "        return (scale, jnp.ones((), bool)), extras\n",
        ),
        ["test_clipping", "test_padding"],
    ),
    "passes: the finite examples formed apart again": (
        (
            "chunkvmap/_quantities/_clipping.py",
            "        formed, (*call.args, ~fix), call.kwargs,",
            "        formed, (*call.args, fix), call.kwargs,",
        ),
        ["test_clipping", "test_padding"],
    ),
    "passes: taken on the CPU too": (
        (
            "chunkvmap/_quantities/_clipping.py",
            'IN_PASSES = frozenset({"tpu"})\n',
            'IN_PASSES = frozenset({"tpu", "cpu"})\n',
        ),
        ["test_clipping", "test_padding"],
    ),
    "two passes: nan_safe's non-finite examples not formed apart": (
        (
            "chunkvmap/_quantities/_clipping.py",
            "            if self.config.nan_safe:  # the non-finite examples, formed "
            "apart\n",
            "            if False:\n",
        ),
        GHOST_TESTS,
    ),
    "two passes: a formed example's non-finite entries kept": (
        (
            "chunkvmap/_quantities/_clipping.py",
            "            grads = [_nan_to_zero(g) for g in grads]\n",
            "            grads = list(grads)\n",
        ),
        GHOST_TESTS,
    ),
    "choice: the verdict measures another program than the call's": (
        (
            "chunkvmap/_quantities/_clipping.py",
            "        forced = dataclasses.replace(config, runs=method)\n",
            "        forced = dataclasses.replace(config, runs=method, sums=False)\n",
        ),
        GHOST_TESTS,
    ),
    "preconditioning: a joined bias's block the identity": (
        (
            "chunkvmap/_quantities/_projections.py",
            "    return _dense_whitening(g, damping)\n",
            "    return _dense_whitening(jnp.eye(len(g)), damping)\n",
        ),
        ["test_projections"],
    ),
    "preconditioning: the other batch's rows not whitened": (
        (
            "chunkvmap/_quantities/_projections.py",
            "            rows = rows_of(other, kwargs, _axes.NOTHING_KNOWN, whiten)"
            "[0]\n",
            "            rows = rows_of(other, kwargs, _axes.NOTHING_KNOWN, None)[0]\n",
        ),
        ["test_projections"],
    ),
    "padding: stacked chunks of padding alone evaluated": (
        (
            "chunkvmap/_core/_loop.py",
            "            return lax.cond(plan.active(i), write, lambda b, i: b, "
            "buffers, i), None\n",
            "            return write(buffers, i), None\n",
        ),
        ["test_padding"],
    ),
    "padding: batch_map's padding rows not zeroed": (
        (
            "chunkvmap/_transforms/_batch_map.py",
            "        return _padding.zeroed(flags, fun(xs))\n",
            "        return fun(xs)\n",
        ),
        ["test_padding", "test_batch_map"],
    ),
    "padding: moments count the padding": (
        (
            "chunkvmap/_core/_accumulators.py",
            "            n = jnp.sum(real, dtype=kind)\n",
            "            n = jnp.asarray(n, kind)\n",
        ),
        ["test_padding", "test_statistics"],
    ),
    "padding: the moments' shift from the padding": (
        (
            "chunkvmap/_core/_accumulators.py",
            "    shift = jnp.take(g, jnp.argmax(real), axis=axis)\n",
            "    shift = lax.index_in_dim(g, 0, axis, keepdims=False)\n",
        ),
        ["test_padding", "test_statistics", "test_reductions"],
    ),
    "padding: ghost moments merge the padding": (
        (
            "chunkvmap/_quantities/_statistics.py",
            "                d = [jnp.where(counts, x, 0) for x in d]\n",
            "                pass\n",
        ),
        ["test_padding", "test_statistics"],
    ),
    "padding: merging nothing into nothing divides by zero": (
        (
            "chunkvmap/_core/_accumulators.py",
            "    share = count_b / jnp.where(count == 0, 1, count)",
            "    share = count_b / count",
        ),
        ["test_padding", "test_statistics"],
    ),
    "padding: devices of a shard_map evaluate their padding": (
        (
            "chunkvmap/_core/_sharding.py",
            "        if inputs.padding is not None:  # this device's padding",
            "        if False:",
        ),
        ["test_padding", "test_sharding"],
    ),
    "padding: Explicit shares evaluate their padding": (
        (
            "chunkvmap/_core/_sharding.py",
            "    if inputs.padding is None:\n        return plan\n    first =",
            "    if True:\n        return plan\n    first =",
        ),
        ["test_padding", "test_sharding"],
    ),
    "padding: shares skip a chunk where one share is padding alone": (
        (
            "chunkvmap/_core/_loop.py",
            "        real = jnp.max(self.count) if self.shared else self.count\n",
            "        real = jnp.min(self.count) if self.shared else self.count\n",
        ),
        ["test_padding", "test_sharding"],
    ),
    "eager cache: equations' parameters left out of the key": (
        (
            "chunkvmap/_core/_program.py",
            "            part = (eqn.primitive, ins, outs, eqn.ctx, params)\n",
            "            part = (eqn.primitive, ins, outs, eqn.ctx, ())\n",
        ),
        ["test_cache", "test_closures"],
    ),
    "options: a keyword the entry point does not take accepted": (
        (
            "chunkvmap/_core/_options.py",
            "                if k not in valid:\n",
            "                if False:\n",
        ),
        ["test_imports", "test_errors"],
    ),
    "ghost: a cross term between two uses of a leaf counted once": (
        (
            "chunkvmap/_quantities/ghost/_plan.py",
            "        return same + 2 * total(cross, acc) if cross else same\n",
            "        return same + total(cross, acc) if cross else same\n",
        ),
        GHOST_TESTS,
    ),
    "eager cache: held objects (host callbacks) left out of the key": (
        (
            "chunkvmap/_core/_program.py",
            "                return _equivalence.Held(v) if _equivalence.opaque(v) "
            "else _value(v)\n",
            "                return None if _equivalence.opaque(v) else _value(v)\n",
        ),
        ["test_cache", "test_closures"],
    ),
    "eager cache: a held function's defaults not compared": (
        (
            "chunkvmap/_core/_equivalence.py",
            "        or not _all(a.__defaults__ or (), b.__defaults__ or (), depth)\n",
            "",
        ),
        ["test_cache", "test_closures", "test_equivalence"],
    ),
    "eager cache: held floats compared by == (0.0 is -0.0)": (
        (
            "chunkvmap/_core/_equivalence.py",
            "        return bits(a) == bits(b)\n",
            "        return a == b\n",
        ),
        ["test_cache", "test_closures", "test_equivalence"],
    ),
    "eager cache: nested jits' constants compiled in, not arguments": (
        (
            "chunkvmap/_core/_program.py",
            "        key, _ = walk.key(jaxpr, hoisting=True)\n",
            "        key, _ = walk.key(jaxpr, hoisting=False)\n",
        ),
        ["test_cache", "test_closures"],
    ),
    "eager cache: NumPy constants compiled in taken by identity": (
        (
            "chunkvmap/_core/_program.py",
            "    if isinstance(c, np.ndarray):\n",
            "    if False:\n",
        ),
        ["test_cache", "test_closures"],
    ),
    "eager cache: a custom_vjp's output trees keyed": (
        ("chunkvmap/_core/_program.py", '     "out_trees"}', "}"),
        ["test_cache", "test_closures"],
    ),
    "mesh: mesh= overrides a held mesh over inputs placed on it": (
        (
            "chunkvmap/_core/_mesh.py",
            "    if not jax.sharding.get_abstract_mesh().empty:\n",
            "    if not jax.sharding.get_abstract_mesh().empty and mesh is None:\n",
        ),
        ["test_sharding", "test_wherever"],
    ),
    "gram: a convolution's patch cost multiplied by the chunk": (
        (
            "chunkvmap/_quantities/_statistics.py",
            "    ghost += sum(u.form.build_cost for u in leaf.uses) / chunk\n",
            "    ghost += sum(u.form.build_cost for u in leaf.uses) * chunk\n",
        ),
        ["test_statistics"],
    ),
    "conv: every kernel laid out, however few its channels": (
        (
            "chunkvmap/_core/_conv.py",
            "        and rhs.shape[out_dim] * rhs.shape[in_dim] >= _MIN_CHANNELS\n",
            "",
        ),
        ["test_conv"],
    ),
    "conv: a namedtuple parameter rebuilt from one iterable": (
        (
            "chunkvmap/_core/_jaxprs.py",
            '    if hasattr(value, "_fields"):',
            "    if False:",
        ),
        ["test_conv"],
    ),
    "auto: the largest size that fits, not the fewest chunks' shortest": (
        ("chunkvmap/_core/_memory.py", "    return balanced\n", "    return best\n"),
        ["test_auto", "test_conformance"],
    ),
    "shares: every leaf, functions too, through the vmap over the shares": (
        (
            "chunkvmap/_core/_loop.py",
            "            if a is not None or isinstance(x, ARRAY_TYPES)\n",
            "            if True\n",
        ),
        ["test_eqx", "test_wherever"],
    ),
    "eager programs: a whole traced program reading a tracer compiled": (
        ("chunkvmap/_core/_program.py", "    if trace.traced:\n", "    if False:\n"),
        ["test_cache", "test_closures"],
    ),
    "eager programs: a chunk closing over a tracer closure-converted": (
        (
            "chunkvmap/_core/_program.py",
            "        if self.first.traced:\n",
            "        if False:\n",
        ),
        ["test_cache", "test_closures"],
    ),
    "eager programs: a body known without its chunk's trace": (
        (
            "chunkvmap/_core/_chunked.py",
            "        traced.first.key, length, convolutions, tuple(axes), out_tree,\n",
            "        length, convolutions, tuple(axes), out_tree,\n",
        ),
        ["test_cache", "test_closures"],
    ),
    "eager programs: a body with any accumulator known by its chunk's trace": (
        (
            "chunkvmap/_core/_chunked.py",
            "        and (own is None or own.pure)\n",
            "",
        ),
        ["test_cache", "test_closures"],
    ),
    "eager programs: a retrace's own arrays compiled into a kept program": (
        (
            "chunkvmap/_core/_program.py",
            "            self.kept = False\n",
            "            pass\n",
        ),
        ["test_cache", "test_closures", "test_auto"],
    ),
    "eager programs: a retrace that reads other arrays given the first's": (
        (
            "chunkvmap/_core/_program.py",
            "        if not this.reads(self.first.consts):\n",
            "        if False:\n",
        ),
        ["test_cache", "test_closures"],
    ),
    "projections: matrices made in the caller's trace and mesh": (
        (
            "chunkvmap/_quantities/_projections.py",
            "        return thread.submit(made).result()\n",
            "        return made()\n",
        ),
        ["test_wherever", "test_projections"],
    ),
    "curvature: output cotangents not typed as the output": (
        (
            "chunkvmap/_quantities/_curvature.py",
            "    if want is None or getattr(jax.typeof(vectors).sharding",
            "    if True or getattr(jax.typeof(vectors).sharding",
        ),
        ["test_wherever", "test_curvature"],
    ),
    "curvature: sum x x^T sharded as its operand": (
        (
            "chunkvmap/_quantities/_curvature.py",
            "        out_sharding=explicit_spec([None] * len(out)),\n",
            "",
        ),
        ["test_wherever", "test_curvature"],
    ),
    "gram: a module's functions taken as arrays": (
        (
            "chunkvmap/_quantities/_statistics.py",
            "        if _axes.is_arraylike(x)\n",
            "",
        ),
        ["test_eqx", "test_statistics"],
    ),
    "eager programs: a custom rule inlined under grad": (
        (
            "chunkvmap/_core/_program.py",
            '    prims.custom_vjp_call_p: _with_consts("call_jaxpr", "num_consts"),\n',
            "    prims.custom_vjp_call_p: _inline,\n",
        ),
        ["test_higher_order", "test_closures"],
    ),
    "loop: a nest of two checkpoints (rules kept to second order only)": (
        (
            "chunkvmap/_core/_loop.py",
            "    for _ in range(RULE_ORDERS - 1):\n",
            "    for _ in range(1):\n",
        ),
        ["test_higher_order"],
    ),
    "loop: remat=True saves every residual": (
        (
            "chunkvmap/_core/_loop.py",
            "        return jax.checkpoint(fn, prevent_cse=False)\n",
            "        return fn\n",
        ),
        ["test_memory", "test_compose"],
    ),
    "loop: a policy taken as saving everything": (
        (
            "chunkvmap/_core/_loop.py",
            "    policy = everything if remat is False else remat\n",
            "    policy = everything\n",
        ),
        ["test_memory", "test_compose", "test_grads", "test_higher_order"],
    ),
    "loop: a loop that saves residuals checkpointed once (rules dropped)": (
        (
            "chunkvmap/_core/_loop.py",
            "        fn = jax.checkpoint(fn, prevent_cse=False, policy=everything)\n",
            "        pass\n",
        ),
        ["test_higher_order"],
    ),
    "eager programs: a while loop rebuilt through lax.while_loop": (
        (
            "chunkvmap/_core/_program.py",
            "    prims.while_p: _while,\n",
            "    prims.while_p: lambda run, eqn, ins: jax.lax.while_loop(\n"
            "        lambda c: run.sub(eqn.params['cond_jaxpr'], *c)[0],\n"
            "        lambda c: run.sub(eqn.params['body_jaxpr'], *c), ins),\n",
        ),
        ["test_higher_order"],
    ),
    "ghost: a tap of a broadcast leaf": (
        (
            "chunkvmap/_quantities/ghost/_primitives.py",
            "        if view is None or view.stacked[-1].leaf is None:\n",
            "        if view is None:\n",
        ),
        ["test_ghost", "test_ghost_rules", "test_ghost_models"],
    ),
    "padding masked only forward": (
        (
            "chunkvmap/_core/_loop.py",
            "        if self.flags is None:\n            return chunk\n",
            "        if True:\n            return chunk\n",
        ),
        ["test_padding", "test_core"],
    ),
    "two-pass ghost: a stand-in taken where no example counts": (
        (
            "chunkvmap/_quantities/_clipping.py",
            "        jnp.any(counted),\n",
            "        True,\n",
        ),
        ["test_padding", "test_clipping", "test_ghost"],
    ),
    "ghost: a traced constant read by value": (
        (
            "chunkvmap/_quantities/ghost/_primitives.py",
            "    if c is None or isinstance(c, jax.core.Tracer):\n        return None\n",
            "    if c is None:\n        return None\n",
        ),
        ["test_ghost", "test_statistics"],
    ),
    "eager cache: a bound method's instance left out of the key": (
        (
            "chunkvmap/_core/_equivalence.py",
            "        return _same_owner(a.__self__, b.__self__) and interchangeable(\n",
            "        return True and interchangeable(\n",
        ),
        ["test_cache", "test_closures", "test_equivalence"],
    ),
    "eager cache: a held partial's keywords left out of the key": (
        (
            "chunkvmap/_core/_equivalence.py",
            "            and _same_dict(a.keywords, b.keywords, depth)\n",
            "            and True\n",
        ),
        ["test_cache", "test_closures", "test_equivalence"],
    ),
    "eager cache: a ghost quantity's settings left out of its key": (
        (
            "chunkvmap/_quantities/_records.py",
            "        made = tuple(_equivalence.Held(x) for x in self.made_with())\n",
            "        made = ()\n",
        ),
        ["test_cache"],
    ),
    "eager cache: ghost quantities of one type taken as alike": (
        (
            "chunkvmap/_core/_equivalence.py",
            "    return type(a) is type(b) and _keyed(a) and "
            "a.program_key() == b.program_key()\n",
            "    return type(a) is type(b) and _keyed(a)\n",
        ),
        ["test_cache", "test_equivalence"],
    ),
    "choice: a measurement kept whatever its programs compute": (
        (
            "chunkvmap/_quantities/_choice.py",
            "        measured = MEASURED.get_or_build("
            "(quantity.program_key(), key), measure)\n",
            "        measured = MEASURED.get_or_build(key, measure)\n",
        ),
        ["test_choice"],
    ),
    "statistics: float32 merge weights": (
        (
            "chunkvmap/_core/_accumulators.py",
            "    return jnp.dtype(jnp.float64 if wide else jnp.float32)\n",
            "    return jnp.dtype(jnp.float32)\n",
        ),
        ["test_statistics", "test_reductions"],
    ),
    "ekfac: rotated without the input basis": (
        (
            "chunkvmap/_quantities/_ekfac.py",
            '        g = jnp.einsum("...ij,...ik->...jk", q_in, g)\n',
            "        g = g\n",
        ),
        ["test_ekfac"],
    ),
    "ekfac: a joined bias's row zeroed": (
        (
            "chunkvmap/_quantities/_ekfac.py",
            "    return jnp.concatenate([g, row], axis=-2)\n",
            "    return jnp.concatenate([g, 0 * row], axis=-2)\n",
        ),
        ["test_ekfac"],
    ),
    "entry points: a wrapper's frame not hidden": (
        (
            "chunkvmap/_core/_options.py",
            "            __tracebackhide__ = True\n",
            "            __tracebackhide__ = False\n",
        ),
        ["test_imports"],
    ),
    "eigh on the host: its derivative's gaps reversed": (
        (
            "chunkvmap/_quantities/_eigh.py",
            "    gaps = values[..., None, :] - values[..., :, None]\n",
            "    gaps = values[..., :, None] - values[..., None, :]\n",
        ),
        ["test_ekfac"],
    ),
    "eigh on the host: the platforms ignored": (
        (
            "chunkvmap/_quantities/_eigh.py",
            "    if _memory.call_platform() not in ON_HOST:\n",
            "    if True:\n",
        ),
        ["test_ekfac"],
    ),
    "eigh on the host: an eager result left where the callback put it": (
        (
            "chunkvmap/_quantities/_eigh.py",
            "    if isinstance(x, jax.core.Tracer):\n",
            "    if True:\n",
        ),
        ["test_ekfac"],
    ),
    "multiply_inverse: a traced damping's shape not checked": (
        (
            "chunkvmap/_quantities/_ekfac.py",
            "        if jnp.shape(damping) != () or not jnp.issubdtype(damping.dtype, jnp.floating):\n",
            "        if False:\n",
        ),
        ["test_ekfac"],
    ),
    "multiply_inverse: damping doubled": (
        (
            "chunkvmap/_quantities/_ekfac.py",
            "    r = _rotated(laid, q_in, q_out) / (values + damping)\n",
            "    r = _rotated(laid, q_in, q_out) / (values + 2 * damping)\n",
        ),
        ["test_ekfac"],
    ),
    "multiply_inverse: a KFAC block's count ignored": (
        (
            "chunkvmap/_quantities/_ekfac.py",
            "    return q_in, q_out, in_vals[..., :, None] * out_vals[..., None, :] / f.count\n",
            "    return q_in, q_out, in_vals[..., :, None] * out_vals[..., None, :]\n",
        ),
        ["test_ekfac"],
    ),
    "projections: EK-FAC whitening without its eigenvalues": (
        (
            "chunkvmap/_quantities/_projections.py",
            '    half = jnp.einsum("...aj,...cj,...jl->...acl", u, u, values)\n',
            '    half = jnp.einsum("...aj,...cj,...jl->...acl", u, u, 1 + 0 * values)\n',
        ),
        ["test_ekfac"],
    ),
    "projections: an EK-FAC joined bias's basis row not squared": (
        (
            "chunkvmap/_quantities/_projections.py",
            '        w = jnp.einsum("j,jl->l", f32(weight.input_basis[-1]) ** 2, weight.eigenvalues)\n',
            '        w = jnp.einsum("j,jl->l", f32(weight.input_basis[-1]), weight.eigenvalues)\n',
        ),
        ["test_ekfac"],
    ),
    "store: each block an eager call (traced per block)": (
        (
            "chunkvmap/_quantities/_store.py",
            "    project = _one_program(projections, params, extra)\n",
            "    project = lambda block: projections(params, *block, **extra)\n",
        ),
        ["test_store"],
    ),
    "store: opponents ranked as proponents": (
        (
            "chunkvmap/_quantities/_store.py",
            "    low, low_i = keep(low, low_i, -s)\n",
            "    low, low_i = keep(low, low_i, s)\n",
        ),
        ["test_store"],
    ),
    "store: a resumed build starts over": (
        (
            "chunkvmap/_quantities/_store.py",
            "    starts = range(done, n, write_size)\n",
            "    starts = range(0, n, write_size)\n",
        ),
        ["test_store"],
    ),
    "store: cosine without the stored rows' norms": (
        (
            "chunkvmap/_quantities/_store.py",
            "        s = s / jnp.maximum(norms, 1e-30)[None, :]\n",
            "        s = s\n",
        ),
        ["test_store"],
    ),
    "store: a query by other parameters accepted": (
        (
            "chunkvmap/_quantities/_store.py",
            '        if fingerprint(params) != cfg["params"]:\n',
            "        if False:\n",
        ),
        ["test_store"],
    ),
    "projections: per position, every position's gradient the summed loss's": (
        (
            "chunkvmap/_quantities/_projections.py",
            "        eye = jnp.eye(value.size, dtype=value.dtype).reshape(value.size, *value.shape)\n",
            "        eye = jnp.ones((value.size, value.size), value.dtype).reshape(value.size, *value.shape)\n",
        ),
        ["test_store"],
    ),
    "ekfac ghost: the records' rotated gradient 1% too large": (
        (
            "chunkvmap/_quantities/_ekfac.py",
            "    out = squared_products(jnp.swapaxes(a, 0, 1), jnp.swapaxes(d, 0, 1))\n",
            "    out = squared_products(jnp.swapaxes(a, 0, 1), 1.01 * jnp.swapaxes(d, 0, 1))\n",
        ),
        ["test_ekfac"],
    ),
    "ekfac ghost: a joined bias's activation left out": (
        (
            "chunkvmap/_quantities/_ekfac.py",
            "            a = a + row.reshape(*lead, *([1] * len(pos_a)), row.shape[-1])\n",
            "            a = a\n",
        ),
        ["test_ekfac"],
    ),
    "ekfac factors=: the given factors ignored (the first pass run)": (
        (
            "chunkvmap/_quantities/_ekfac.py",
            '        given = kwargs.pop("factors", None)\n',
            '        given = kwargs.pop("factors", None) and None\n',
        ),
        ["test_ekfac"],
    ),
    "ekfac factors=: the other leaves' diagonals not summed": (
        (
            "chunkvmap/_quantities/_ekfac.py",
            "        redo = given is not None  # (the diagonals too are these examples')\n",
            "        redo = False\n",
        ),
        ["test_ekfac"],
    ),
    "store: a build's program not kept for later builds": (
        (
            "chunkvmap/_quantities/_store.py",
            "                functools.partial(program, block_tree), values, _memory.PROGRAMS, types\n",
            "                functools.partial(program, block_tree), values, _program.LRU(), types\n",
        ),
        ["test_store"],
    ),
    "takes: __wrapped__ dropped (the source shown is the wrapper's)": (
        (
            "chunkvmap/_core/_options.py",
            "        return checked\n",
            "        del checked.__wrapped__\n        return checked\n",
        ),
        ["test_imports"],
    ),
    "held loop: chunks not held": (
        (
            "chunkvmap/_core/_loop.py",
            "    return lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)\n",
            "    return x\n",
        ),
        ["test_loop"],
    ),
    "held loop: chunks held through their bits (no transpose)": (
        (
            "chunkvmap/_core/_loop.py",
            "    return lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)\n",
            "    kind = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[x.dtype.itemsize]\n"
            "    return lax.bitcast_convert_type(lax.bitcast_convert_type(x, kind), x.dtype)\n",
        ),
        ["test_loop"],
    ),
    "held loop: chunks rounded to a narrower precision": (
        (
            "chunkvmap/_core/_loop.py",
            "    return lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)\n",
            "    return lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=7)\n",
        ),
        ["test_loop"],
    ),
    "held loop: held whatever it writes": (
        (
            "chunkvmap/_core/_loop.py",
            "    return bool(held) and not weak and written <= read\n",
            "    return bool(held) and not weak\n",
        ),
        ["test_loop"],
    ),
    "held loop: the scan's xs and ys taken (not written in place)": (
        (
            "chunkvmap/_core/_loop.py",
            "            and plan.rem == 0\n"
            "            and all(a == 0 for a in out_axes)\n",
            "            and plan.rem == 0\n"
            "            and all(a == 0 for a in out_axes)\n            or held\n",
        ),
        ["test_loop"],
    ),
    "regroup: several groups reshaped at once (refused over Explicit axes)": (
        (
            "chunkvmap/_core/_loop.py",
            "    if 0 in src or math.prod(src) != math.prod(dst):\n",
            "    if True:\n",
        ),
        ["test_ekfac"],
    ),
    "ekfac ghost: a lookup's rotated gradient 1% too large": (
        (
            "chunkvmap/_quantities/_ekfac.py",
            "    return jnp.where(valid[:, None], read, jnp.zeros((), d.dtype)), d\n",
            "    return jnp.where(valid[:, None], read, jnp.zeros((), d.dtype)), 1.01 * d\n",
        ),
        ["test_ekfac"],
    ),
    "ekfac ghost: a lookup's positions that read no row kept": (
        (
            "chunkvmap/_quantities/_ekfac.py",
            "    return jnp.where(valid[:, None], read, jnp.zeros((), d.dtype)), d\n",
            "    return read, d\n",
        ),
        ["test_ekfac"],
    ),
    "squares kernel: called without its derivative rule": (
        (
            "chunkvmap/_quantities/_squares.py",
            "        return _by_kernel(a, d)\n",
            "        return _kernel_sum(a, d, interpret=INTERPRET)\n",
        ),
        ["test_ekfac"],
    ),
    "squares kernel: an example of each step left out": (
        (
            "chunkvmap/_quantities/_squares.py",
            "    for e in range(examples):  # (unrolled: one matmul per example)\n",
            "    for e in range(examples - 1):  # (unrolled: one matmul per example)\n",
        ),
        ["test_ekfac"],
    ),
    "squares kernel: the tile's sum restarted at every step over the examples": (
        (
            "chunkvmap/_quantities/_squares.py",
            "    total = out_ref[...]\n",
            "    total = jnp.zeros(out_ref.shape, out_ref.dtype)\n",
        ),
        ["test_ekfac"],
    ),
    "squares kernel: the rows' padding not cut off (the columns' kept)": (
        (
            "chunkvmap/_quantities/_squares.py",
            "    return out[:, :rows, :cols]\n",
            "    return out[:, : rows + 1, :cols][:, 1:]\n",
        ),
        ["test_ekfac"],
    ),
    "reused evaluation: rules left out of its key": (
        (
            "chunkvmap/_core/_program.py",
            "    key, _ = _Walk(rules=True).key(jaxpr, hoisting=False)\n    return key\n",
            "    key, _ = _Walk(rules=False).key(jaxpr, hoisting=False)\n    return key\n",
        ),
        ["test_cache", "test_closures"],
    ),
    "reused evaluation: a key holding arrays kept": (
        (
            "chunkvmap/_core/_equivalence.py",
            "        if may_hold_arrays(key.value, 0):\n            raise _NotKeepable\n",
            "        if False:\n            raise _NotKeepable\n",
        ),
        ["test_cache", "test_closures"],
    ),
    "reused evaluation: the loss's constants compiled in": (
        (
            "chunkvmap/_quantities/ghost/_traced.py",
            "        traced.closed = closed.replace(consts=list(consts))\n",
            "        traced.closed = closed\n",
        ),
        ["test_cache", "test_closures"],
    ),
    "reused evaluation: the quantity left out of its key": (
        (
            "chunkvmap/_quantities/ghost/_traced.py",
            "        key = (made, exact, jax.sharding.get_abstract_mesh())\n",
            "        key = (type(quantity), exact, jax.sharding.get_abstract_mesh())\n",
        ),
        ["test_cache", "test_closures"],
    ),
    "reused evaluation: the call's loss kept by the cache": (
        (
            "chunkvmap/_quantities/ghost/_traced.py",
            "            calling.pop()\n",
            "            pass\n",
        ),
        ["test_cache", "test_closures"],
    ),
    "reused evaluation: a custom JVP rule known by nothing": (
        (
            "chunkvmap/_core/_program.py",
            "                part += (_jvp_key(eqn),)\n",
            "                pass\n",
        ),
        ["test_cache", "test_closures"],
    ),
    "MC labels: a typed key's generator dropped": (
        (
            "chunkvmap/_quantities/_curvature.py",
            "            return [key, jnp.arange(n, dtype=jnp.uint32)]\n",
            "            data = jax.random.key_data(key) if _typed(key) else key\n"
            "            return [data, jnp.arange(n, dtype=jnp.uint32)]\n",
        ),
        ["test_curvature", "test_ekfac"],
    ),
    "store: each block's program makes the whitening": (
        (
            "chunkvmap/_quantities/_store.py",
            '    return {\n        "precondition": prepared_whitening(\n'
            '            "build_store", params, precondition, dim=dim, seed=seed, '
            "damping=damping\n        )\n    }\n",
            '    return {"precondition": precondition, "damping": damping}\n',
        ),
        ["test_store"],
    ),
    "clipped sums in passes: the eager pass run as it is (compiled at every call)": (
        (
            "chunkvmap/_quantities/_clipping.py",
            "    return _program.run_traced(summed, [], programs, ())\n",
            "    return summed()\n",
        ),
        ["test_closures"],
    ),
    "MC labels: a draw at the total not held to a class of mass": (
        (
            "chunkvmap/_quantities/_curvature.py",
            "    return jnp.minimum(first, last)\n",
            "    return jnp.minimum(first, size - 1)\n",
        ),
        ["test_curvature"],
    ),
    "MC labels: the block holding the draw counted by <": (
        (
            "chunkvmap/_quantities/_curvature.py",
            "    first = jnp.sum(ends <= v[..., None], -1)\n",
            "    first = jnp.sum(ends < v[..., None], -1)\n",
        ),
        ["test_curvature"],
    ),
    "MC labels: drawn by jax.random.categorical again": (
        (
            "chunkvmap/_quantities/_curvature.py",
            "        drawn = jax.nn.one_hot(drawn_classes(key, p, samples), classes, "
            "dtype=f.dtype)\n",
            "        drawn = jax.random.categorical(key, f, shape=(samples, "
            "*f.shape[:-1]))\n        drawn = jax.nn.one_hot(drawn, classes, "
            "dtype=f.dtype)\n",
        ),
        ["test_curvature", "test_ekfac"],
    ),
    "store: each block written before the next is dispatched": (
        (
            "chunkvmap/_quantities/_store.py",
            "        running = (start, project(block))\n        if held is not None:\n"
            "            yield held\n        held = running\n",
            "        yield (start, project(block))\n",
        ),
        ["test_store"],
    ),
    "benchmarks: every round in the same order": (
        (
            "benchmarks/_common.py",
            "        for t, f in pairs if r % 2 == 0 else pairs[::-1]:\n",
            "        for t, f in pairs:\n",
        ),
        ["test_benchmarks"],
    ),
    "benchmarks: a timed call right after another function's": (
        (
            "benchmarks/_common.py",
            "        for t, f in pairs if r % 2 == 0 else pairs[::-1]:\n"
            "            jax.block_until_ready(f(*args))\n",
            "        for t, f in pairs if r % 2 == 0 else pairs[::-1]:\n",
        ),
        ["test_benchmarks"],
    ),
}


def run(name: str, all_files: bool) -> dict:
    (path, old, new), files = MUTANTS[name]
    source = ROOT / path
    text = source.read_text()
    if text.count(old) != 1:
        raise SystemExit(f"{name}: the text to replace is not found once in {path}")
    paths = ["tests"] if all_files else [f"tests/{f}.py" for f in files]
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile"]
    cmd += ["-p", "no:cacheprovider", "-rf", *paths]
    start = time.time()
    source.write_text(text.replace(old, new))
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    finally:
        source.write_text(text)
    failed = sorted(
        {
            re.sub(r" - .*", "", line[len("FAILED ") :])
            for line in proc.stdout.splitlines()
            if line.startswith("FAILED ")
        }
    )
    return {"files": paths, "caught_by": failed, "seconds": round(time.time() - start)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--all-files", action="store_true")
    parser.add_argument("--out", default="mutants.json")
    args = parser.parse_args()
    unknown = set(args.names) - set(MUTANTS)
    if unknown:
        parser.error(f"unknown mutants {sorted(unknown)}; known: {sorted(MUTANTS)}")
    results = {}
    print("| mutant | caught by |\n|---|---|")
    for name in args.names or MUTANTS:
        results[name] = run(name, args.all_files)
        caught = results[name]["caught_by"]
        shown = ", ".join(t.removeprefix("tests/") for t in caught) or "**nothing**"
        print(f"| {name} | {shown} |", flush=True)
        pathlib.Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
