"""A gradient store: a training set's projected per-example gradients on disk,
written block by block, resumable, and scored against queries block by block.

`build_store(path, loss, params, *data, dim=...)` projects the examples'
gradients (`per_example_grad_projections`, optionally whitened by
`precondition=` KFAC or EK-FAC factors) `write_size` examples at a time and
writes each block's rows into `rows.npy` (a NumPy memmap of `(N, width)`
float32) before it records the block as done in `state.json`; an interrupted
build called again with the same arguments resumes after the last block
written. `config.json` holds what the rows depend on: the projection's `dim`,
`seed`, method and damping, the data's shapes and dtypes, and fingerprints of
the parameters and the preconditioner, so that a query by other parameters or
another preconditioner is refused. `GradientStore.query(loss, params,
*queries)` projects the queries the same way, then reads the store `read_size`
rows at a time, scores them (`"dot"`: inner products, influence where the rows
are whitened; `"cosine"`) and keeps each query's `k` highest (proponents) and
lowest (opponents): memory holds one block and the queries' rows, whatever the
store's size.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._core import _axes, _memory, _program, _progress
from ._projections import per_example_grad_projections, prepared_whitening


FORMAT = 1


class TopK(NamedTuple):
    """The queries' most influential training examples (`GradientStore.query`).

    Attributes:
      proponents: `(queries, k)` indices of the `k` highest-scoring training
        examples of each query, highest first.
      proponent_scores: their scores.
      opponents: `(queries, k)` indices of the `k` lowest-scoring, lowest first.
      opponent_scores: their scores.

    Examples:
      >>> import numpy as np
      >>> from chunkvmap import TopK
      >>> TopK(np.array([[2]]), np.array([[0.5]]), np.array([[0]]),
      ...      np.array([[-1.0]])).proponents
      array([[2]])
    """

    proponents: np.ndarray
    proponent_scores: np.ndarray
    opponents: np.ndarray
    opponent_scores: np.ndarray


def fingerprint(tree: Any) -> str:
    """A SHA-256 of `tree`'s structure, shapes, dtypes and values (on the host)."""
    h = hashlib.sha256()
    leaves, treedef = jax.tree.flatten(tree)
    h.update(str(treedef).encode())
    for x in leaves:
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        if not isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex)):
            # (a model's functions and other static leaves: by their type)
            h.update(f"{type(x).__module__}.{type(x).__qualname__}".encode())
            continue
        a = np.asarray(jax.device_get(x))
        h.update(f"{a.shape}{a.dtype}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _data_spec(data: Sequence[Any]) -> tuple[int, list]:
    """The examples' count and each leaf's per-example shape and dtype."""
    leaves = jax.tree.leaves(list(data))
    if not leaves:
        raise TypeError("build_store needs the training examples after params.")
    sizes = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(
            f"build_store data must hold the examples along axis 0 of every leaf, "
            f"but got leading sizes {sorted(str(s) for s in sizes)}."
        )
    spec = [[list(np.shape(x)[1:]), str(jnp.result_type(x))] for x in leaves]
    return sizes.pop(), spec


@dataclasses.dataclass
class GradientStore:
    """A store made by `build_store` (or opened by `load_store`).

    Attributes:
      path: its folder.
      config: what its rows depend on (`config.json`): `n`, `width`, `dim`,
        `seed`, `method`, `damping`, the data's per-example shapes and dtypes,
        and the fingerprints of the parameters and the preconditioner.
      rows: the `(N, width)` float32 rows, a read-only memmap.

    Examples:
      >>> import tempfile
      >>> import jax.numpy as jnp
      >>> from chunkvmap import build_store
      >>> store = build_store(tempfile.mkdtemp(), lambda w, x: x @ w, jnp.ones(2),
      ...                     jnp.eye(2), dim=2)
      >>> len(store), store.config["width"]
      (2, 2)
    """

    path: pathlib.Path
    config: dict
    rows: np.ndarray

    def __len__(self) -> int:
        return int(self.config["n"])

    def query(
        self,
        loss: Callable[..., Any],
        params: Any,
        *queries: Any,
        k: int = 10,
        similarity: str = "dot",
        precondition: Any = None,
        read_size: int = 4096,
        per_position: bool = False,
        **options: Any,
    ) -> TopK:
        """Each query's `k` proponents and opponents among the store's examples.

        The queries (`loss`'s arguments after `params`, examples along axis 0)
        are projected as the store's rows were (the same `dim`, `seed`,
        `precondition=` and damping; `options` chunk that projection), then the
        store is read `read_size` rows at a time: `"dot"` scores are the rows'
        inner products (with whitened rows, influence), `"cosine"` the inner
        products over both norms. Raises where `params` or `precondition` are
        not those the store was built with, or the queries' shapes are not the
        training examples'.

        With `per_position=True` (per-token attribution), `loss` returns one
        loss per position of a query and each position is a query of its own
        (`per_example_grad_projections(per_position=True)`): the results are
        `(queries, *positions, k)`."""
        cfg = self.config
        self._check_query(params, queries, k=k, similarity=similarity,
                          precondition=precondition)  # fmt: skip
        method = "vmap" if per_position else cfg["method"]
        project = per_example_grad_projections(
            loss, dim=cfg["dim"], seed=cfg["seed"], method=method,
            per_position=per_position, **options,
        )  # fmt: skip
        extra = _precondition_kwargs(precondition, cfg)
        q = jnp.asarray(project(params, *queries, **extra), jnp.float32)
        lead = q.shape[:-1]
        q = q.reshape(-1, q.shape[-1])
        if q.shape[1] != cfg["width"]:
            raise ValueError(
                f"GradientStore.query projected the queries to {q.shape[1]} "
                f"columns, but the store's rows have {cfg['width']}: loss is not "
                f"the one the store was built with."
            )
        k = min(k, len(self))
        cosine = similarity == "cosine"
        if cosine:
            q = q / jnp.maximum(jnp.linalg.norm(q, axis=1, keepdims=True), 1e-30)
        best = _start(q.shape[0], k)
        for start in range(0, len(self), read_size):
            block = to_device(self.rows[start : start + read_size])
            best = _merge(best, block, q, jnp.int32(start), cosine)
        top, top_i, low, low_i = (
            np.asarray(a).reshape(*lead, k) for a in jax.device_get(best)
        )
        return TopK(top_i, top, low_i, -low)

    def _check_query(self, params, queries, *, k, similarity, precondition) -> None:
        """A query's options, and that it asks of the rows the store holds."""
        cfg = self.config
        if similarity not in ("dot", "cosine"):
            raise ValueError(
                f"GradientStore.query similarity must be 'dot' or 'cosine', but "
                f"got similarity={similarity!r}."
            )
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise TypeError(
                f"GradientStore.query k must be a positive int, but got k={k!r}."
            )
        if fingerprint(params) != cfg["params"]:
            raise ValueError(
                f"GradientStore.query got params that differ from those the store "
                f"at {self.path} was built with: its rows are the gradients at "
                f"those; build a new store for these parameters."
            )
        if _precondition_print(precondition) != cfg["precondition"]:
            raise ValueError(
                f"GradientStore.query got a precondition= that is not the one the "
                f"store at {self.path} was built with (its rows are whitened by "
                f"that one, or by none)."
            )
        _, spec = _data_spec(queries)
        if spec != cfg["data"]:
            raise ValueError(
                f"GradientStore.query got queries of per-example shapes and dtypes "
                f"{spec}, but the store's examples have {cfg['data']}."
            )


def to_device(block: np.ndarray) -> jax.Array:
    """One block of the store's rows on the default device (the only place rows
    are moved there)."""
    return jnp.asarray(np.asarray(block, np.float32))


def _start(n_q: int, k: int) -> tuple:
    inf = jnp.full((n_q, k), -jnp.inf, jnp.float32)
    none = jnp.full((n_q, k), -1, jnp.int32)
    return inf, none, inf, none


@functools.partial(jax.jit, static_argnums=4)
def _merge(best: tuple, block: jax.Array, q: jax.Array, start: Any, cosine: bool):
    """`best` (each query's `k` highest scores and their indices, and the `k`
    highest negated scores: the lowest) updated with `block`'s rows."""
    s = (block @ q.T).T  # (queries, rows)
    if cosine:
        norms = jnp.linalg.norm(block, axis=1)
        s = s / jnp.maximum(norms, 1e-30)[None, :]
    idx = jnp.broadcast_to(start + jnp.arange(block.shape[0], dtype=jnp.int32), s.shape)
    top, top_i, low, low_i = best
    k = top.shape[1]

    def keep(scores, indices, new):
        both = jnp.concatenate([scores, new], axis=1)
        where = jnp.concatenate([indices, idx], axis=1)
        vals, pos = jax.lax.top_k(both, k)
        return vals, jnp.take_along_axis(where, pos, axis=1)

    top, top_i = keep(top, top_i, s)
    low, low_i = keep(low, low_i, -s)
    return top, top_i, low, low_i


def _precondition_print(precondition: Any) -> str | None:
    return None if precondition is None else fingerprint(precondition)


def _precondition_kwargs(precondition: Any, cfg: dict) -> dict:
    if precondition is None:
        return {}
    return {"precondition": precondition, "damping": cfg["damping"]}


def build_store(
    path: str | os.PathLike,
    loss: Callable[..., Any],
    params: Any,
    *data: Any,
    dim: int,
    seed: int = 0,
    method: str = "vmap",
    precondition: Any = None,
    damping: float = 0.1,
    write_size: int = 4096,
    progress: Any = False,
    **options: Any,
) -> GradientStore:
    """The projected per-example gradients of a training set, written to disk
    block by block: `rows.npy` (`(N, width)` float32), `config.json`,
    `state.json` in the folder `path`.

    `loss(params, *example)` is one example's loss; `data` holds the `N`
    examples along axis 0 of every leaf. The examples are projected
    `write_size` at a time (`per_example_grad_projections(loss, dim=dim,
    seed=seed, method=method, **options)`, whitened by `precondition=` factors
    with `damping` where given; `options` chunk each block: `batch_size`,
    `shard`, `mesh`...), one program for the call's blocks (traced once per call, the
    loss's closure read then; compiled once per traced program, so that a build
    at new parameters compiles nothing), and each block's rows are
    written and flushed before the block is recorded as done, while the next
    block's projection runs. Called again on a
    folder that holds an unfinished store of the same configuration, it resumes
    after the last block recorded; on a finished one, it returns it. A folder
    holding a store of another configuration (other parameters, data shapes,
    `dim`, `seed`, method, preconditioner) is refused. `progress`: a bar over the
    blocks (as `batch_vmap`'s).

    Args:
      path: the store's folder (made if missing).
      loss: one example's loss, `loss(params, *example)`.
      params: the parameters the gradients are taken at.
      *data: the training examples, along axis 0.
      dim: the projection's size per axis (see `per_example_grad_projections`).
      seed: the projection's seed.
      method: "vmap" or "ghost" (see `per_example_grad_projections`).
      precondition: `kfac_factors`' or `ekfac_factors`' result, or None.
      damping: the whitening's damping (with `precondition`).
      write_size: examples projected and written per block.
      progress: True, False, a callable `(done, total)` or a tqdm-like bar.
      **options: chunking of each block's projection (`batch_size`, `shard`,
        `mesh`, `memory_limit`, `remat`).

    Returns:
      The `GradientStore`.

    Examples:
      >>> import tempfile
      >>> import jax.numpy as jnp
      >>> from chunkvmap import build_store
      >>> loss = lambda w, x, y: (x @ w - y) ** 2
      >>> x, y = jnp.eye(3), jnp.array([1.0, 0.0, -1.0])
      >>> store = build_store(tempfile.mkdtemp(), loss, jnp.zeros(3), x, y, dim=4)
      >>> store.rows.shape
      (3, 3)
      >>> store.query(loss, jnp.zeros(3), x[:1], y[:1], k=1).proponents
      array([[0]], dtype=int32)
    """
    _progress.check_progress("build_store", progress)
    if (
        isinstance(write_size, bool)
        or not isinstance(write_size, int)
        or write_size < 1
    ):
        raise TypeError(
            f"build_store write_size must be a positive int, but got "
            f"write_size={write_size!r}."
        )
    n, spec = _data_spec(data)
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "format": FORMAT, "n": n, "data": spec, "dim": dim, "seed": seed,
        "method": method, "params": fingerprint(params),
        "precondition": _precondition_print(precondition),
        "damping": float(damping) if precondition is not None else None,
    }  # fmt: skip
    projections = per_example_grad_projections(
        loss, dim=dim, seed=seed, method=method, **options
    )
    extra = _whitened(params, precondition, dim, seed, damping)
    project = _one_program(projections, params, extra)
    done = _resumed(path, config)
    if done is None:  # a new store: its width from the first block's rows' type
        first = jax.tree.map(lambda x: x[: min(write_size, n)], data)
        width = jax.eval_shape(lambda b: projections(params, *b, **extra), first)
        rows = _created(path, config, width.shape[1])
        done = 0
    else:
        rows = np.load(path / "rows.npy", mmap_mode="r+")
    report = _progress.reporter(progress)
    blocks = -(-n // write_size)
    starts = range(done, n, write_size)
    for b, (start, out) in enumerate(_dispatched(project, data, starts, write_size)):
        write_block(rows, start, out)
        _write_json(path / "state.json", {"done": min(start + write_size, n)})
        if report is not None:
            report(done // write_size + b, blocks)
    del rows
    return load_store(path)


def _dispatched(project: Callable[..., Any], data: Any, starts: range, size: int):
    """Each block's `(start, rows)`, the next block's projection dispatched before
    one is given: the device runs it while the rows given are written."""
    held = None
    for start in starts:
        block = jax.tree.map(lambda x: x[start : start + size], data)
        running = (start, project(block))
        if held is not None:
            yield held
        held = running
    if held is not None:
        yield held


def _whitened(params: Any, precondition: Any, dim: int, seed: int, damping) -> dict:
    """The blocks' `precondition=`: the whitening made once for the build, not by
    every block's program (its eigendecompositions)."""
    if precondition is None:
        return {}
    return {
        "precondition": prepared_whitening(
            "build_store", params, precondition, dim=dim, seed=seed, damping=damping
        )
    }


def _one_program(project: Callable[..., Any], params: Any, extra: dict) -> Any:
    """`block -> project(params, *block, **extra)`, traced once per call for its
    blocks of each size (an eager call would trace its chunk at every block) and
    compiled once per traced program (kept with the eager calls' programs: a later
    build of the same program, at other parameters or of another store, compiles
    nothing): the arrays of `params`, `extra` and the block are its arguments,
    their other leaves (a model's functions, Python numbers) held as they are for
    the call."""
    flat, tree = jax.tree.flatten((params, extra))
    dynamic = [i for i, x in enumerate(flat) if _axes.is_array(x)]
    arrays = [flat[i] for i in dynamic]
    made: dict[Any, Callable[..., Any]] = {}

    def program(block_tree: Any, *values: Any) -> Any:
        p, e = jax.tree.unflatten(tree, _axes.combine(flat, dynamic, values))
        return project(p, *jax.tree.unflatten(block_tree, values[len(arrays) :]), **e)

    def call(block: Any) -> Any:
        leaves, block_tree = jax.tree.flatten(block)
        values = [*arrays, *leaves]
        types = (
            block_tree,
            tuple(jax.typeof(v) for v in values),
            tuple(getattr(v, "sharding", None) for v in values),
            jax.sharding.get_abstract_mesh(),
        )
        if types not in made:  # (traced at this call's arrays, once per size)
            made[types] = _program.compiled_for(
                functools.partial(program, block_tree), values, _memory.PROGRAMS, types
            )
        return made[types](values)

    return call


def _created(path: pathlib.Path, config: dict, width: int) -> np.ndarray:
    """A new store's rows (zeros, on disk), its configuration and state."""
    config = {**config, "width": int(width)}
    rows = np.lib.format.open_memmap(
        path / "rows.npy", mode="w+", dtype=np.float32, shape=(config["n"], width)
    )
    _write_json(path / "config.json", config)
    _write_json(path / "state.json", {"done": 0})
    return rows


def write_block(rows: np.ndarray, start: int, block: Any) -> None:
    """One block's rows written at `start` and flushed to disk."""
    block = np.asarray(jax.device_get(block), np.float32)
    rows[start : start + len(block)] = block
    rows.flush()


def _write_json(file: pathlib.Path, value: dict) -> None:
    """`value` to `file`, replaced whole (never half written)."""
    tmp = file.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1, sort_keys=True))
    os.replace(tmp, file)


def _resumed(path: pathlib.Path, config: dict) -> int | None:
    """The examples already written to the store at `path` of this `config`, or
    None where the folder holds no store; a store of another configuration is
    refused."""
    file = path / "config.json"
    if not file.exists():
        return None
    held = json.loads(file.read_text())
    held_cmp = {k: v for k, v in held.items() if k != "width"}
    if held_cmp != config:
        differ = sorted(
            k for k in set(held_cmp) | set(config) if held_cmp.get(k) != config.get(k)
        )
        raise ValueError(
            f"build_store found a store of another configuration at {path} (it "
            f"differs in {', '.join(differ)}): pass another path, or remove that "
            f"store to build this one."
        )
    return int(json.loads((path / "state.json").read_text())["done"])


def load_store(path: str | os.PathLike) -> GradientStore:
    """The finished store at `path` (`build_store`'s folder), its rows a
    read-only memmap.

    Args:
      path: the store's folder.

    Returns:
      The `GradientStore`; a ValueError where the folder holds no store, or an
      unfinished one.

    Examples:
      >>> import tempfile
      >>> import jax.numpy as jnp
      >>> from chunkvmap import build_store, load_store
      >>> folder = tempfile.mkdtemp()
      >>> _ = build_store(folder, lambda w, x: x @ w, jnp.ones(2), jnp.eye(2), dim=2)
      >>> len(load_store(folder))
      2
    """
    path = pathlib.Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
        done = int(json.loads((path / "state.json").read_text())["done"])
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"load_store found no gradient store at {path}: {e}") from None
    if config.get("format") != FORMAT:
        raise ValueError(
            f"load_store: the store at {path} has format {config.get('format')!r}, "
            f"this chunkvmap reads {FORMAT}."
        )
    if done < config["n"]:
        raise ValueError(
            f"load_store: the store at {path} is unfinished ({done} of "
            f"{config['n']} examples written): call build_store again with its "
            f"arguments to resume."
        )
    rows = np.load(path / "rows.npy", mmap_mode="r")
    return GradientStore(path, config, rows)
