"""Plain-JAX forms of a chunk loop against `jax.vmap` on the default device: which
way of slicing chunks and stacking their outputs costs nothing on this backend.

  xs           `lax.scan` over the input reshaped to `(N/B, B, ...)` (chunkvmap's
               form where `B` divides `N`),
  slice        `lax.scan` over chunk indices, each chunk a `dynamic_slice`,
  slice+bar    the same with the slice behind `lax.optimization_barrier` (nothing
               hoisted out of the loop),
  fori+dus     a `fori_loop` writing each chunk's outputs in place,
  map          `lax.map` over the reshaped input,
  bits         `lax.scan` over the input's bits (`bitcast_convert_type` to an
               unsigned integer of its width), each chunk cast back in the body
               (no float operation reaches the input outside the loop),
  slice+bits   the same with each chunk a `dynamic_slice` of the bits,
  roundtrip    `lax.scan` over the reshaped input, each chunk's bits taken and cast
               back in the body,
  slice+xor    `slice` with each chunk read through its bits xor `i >> 31` (zero at
               run time, unknown to XLA: no float operation reaches the input
               outside the loop, and the bit casts cannot be folded away),
  fori+xor     `fori+dus` with each chunk read so,
  fori+hold    `fori+dus` with each chunk read through chunkvmap's `hold` (the
               same bits, chosen by a predicate false at run time, so that JAX
               differentiates it as the identity),
  fori+rp      `fori+dus` with each chunk through `lax.reduce_precision` at its own
               type's bits (an identity whose derivative is JAX's own),
  fori+bar     `fori+dus` with each chunk behind `lax.optimization_barrier`,
  fori+mul     `fori+dus` with each chunk chosen at run time against itself times
               a one XLA cannot see (`1 + (i >> 31)`),
               the last three linear (`jax.linear_transpose` passes through them,
               where a bit cast has no transpose rule),
  unrolled     `slice` with the scan unrolled whole (`unroll=K`),
  python       the chunks as a Python loop of static slices, concatenated.

    python benchmarks/probe_loop.py [--n N] [--chunks K] [--hlo DIR]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from _common import interleaved
from jax import lax

from chunkvmap._core._loop import hold


def mlp_forward(p, x):
    for layer in p[:-1]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return x @ p[-1]["w"] + p[-1]["b"]


def same_precision(x, i):
    info = jnp.finfo(x.dtype)
    return lax.reduce_precision(x, info.nexp, info.nmant)


def barrier(x, i):
    return lax.optimization_barrier(x)


def times_one(x, i):
    one = (1 + lax.shift_right_arithmetic(i, np.int32(31))).astype(x.dtype)
    never = lax.broadcast(i < 0, x.shape)
    return lax.select(never, x * one, x)


def forms(f, n, b):
    vf = jax.vmap(f, (None, 0))
    k = n // b

    def xs(p, x):
        _, ys = lax.scan(
            lambda c, xc: (c, vf(p, xc)), (), x.reshape(k, b, *x.shape[1:])
        )
        return ys.reshape(n, *ys.shape[2:])

    def sliced(p, x, barrier=False):
        def body(c, i):
            xc = lax.dynamic_slice_in_dim(x, i * b, b)
            if barrier:
                xc = lax.optimization_barrier(xc)
            return c, vf(p, xc)

        _, ys = lax.scan(body, (), jnp.arange(k, dtype=np.int32))
        return ys.reshape(n, *ys.shape[2:])

    def fori(p, x):
        out = jax.eval_shape(vf, p, x)
        buf = jnp.zeros(out.shape, out.dtype)

        def body(i, buf):
            y = vf(p, lax.dynamic_slice_in_dim(x, i * b, b))
            return lax.dynamic_update_slice_in_dim(buf, y, i * b, 0)

        return lax.fori_loop(0, k, body, buf)

    def mapped(p, x):
        ys = lax.map(lambda xc: vf(p, xc), x.reshape(k, b, *x.shape[1:]))
        return ys.reshape(n, *ys.shape[2:])

    def bits_of(x):
        return lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))

    def back(u, dtype):
        return lax.bitcast_convert_type(u, dtype)

    def bits(p, x):
        u = bits_of(x).reshape(k, b, *x.shape[1:])
        _, ys = lax.scan(lambda c, uc: (c, vf(p, back(uc, x.dtype))), (), u)
        return ys.reshape(n, *ys.shape[2:])

    def slice_bits(p, x):
        u = bits_of(x)

        def body(c, i):
            return c, vf(p, back(lax.dynamic_slice_in_dim(u, i * b, b), x.dtype))

        _, ys = lax.scan(body, (), jnp.arange(k, dtype=np.int32))
        return ys.reshape(n, *ys.shape[2:])

    def roundtrip(p, x):
        def body(c, xc):
            return c, vf(p, back(bits_of(xc), xc.dtype))

        _, ys = lax.scan(body, (), x.reshape(k, b, *x.shape[1:]))
        return ys.reshape(n, *ys.shape[2:])

    def kept(xc, i):
        z = lax.convert_element_type(lax.shift_right_arithmetic(i, np.int32(31)),
                                     bits_of(xc).dtype)  # fmt: skip
        return back(bits_of(xc) ^ z, xc.dtype)

    def slice_xor(p, x):
        def body(c, i):
            return c, vf(p, kept(lax.dynamic_slice_in_dim(x, i * b, b), i))

        _, ys = lax.scan(body, (), jnp.arange(k, dtype=np.int32))
        return ys.reshape(n, *ys.shape[2:])

    def fori_read(p, x, read):
        out = jax.eval_shape(vf, p, x)

        def body(i, buf):
            y = vf(p, read(lax.dynamic_slice_in_dim(x, i * b, b), i))
            return lax.dynamic_update_slice_in_dim(buf, y, i * b, 0)

        return lax.fori_loop(0, k, body, jnp.zeros(out.shape, out.dtype))

    def unrolled(p, x):
        def body(c, i):
            return c, vf(p, lax.dynamic_slice_in_dim(x, i * b, b))

        _, ys = lax.scan(body, (), jnp.arange(k, dtype=np.int32), unroll=k)
        return ys.reshape(n, *ys.shape[2:])

    def python(p, x):
        return jnp.concatenate([vf(p, x[i * b : (i + 1) * b]) for i in range(k)])

    return {
        "jax.vmap": vf,
        "slice+xor": slice_xor,
        "fori+xor": lambda p, x: fori_read(p, x, kept),
        "fori+hold": lambda p, x: fori_read(p, x, hold),
        "fori+rp": lambda p, x: fori_read(p, x, same_precision),
        "fori+bar": lambda p, x: fori_read(p, x, barrier),
        "fori+mul": lambda p, x: fori_read(p, x, times_one),
        "unrolled": unrolled,
        "python": python,
        "bits": bits,
        "slice+bits": slice_bits,
        "roundtrip": roundtrip,
        "xs": xs,
        "slice": sliced,
        "slice+bar": lambda p, x: sliced(p, x, True),
        "fori+dus": fori,
        "map": mapped,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=65536)
    parser.add_argument("--chunks", type=int, nargs="+", default=[16, 4])
    parser.add_argument(
        "--widths", type=int, nargs="+", default=[784, 1024, 1024, 1024, 10]
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--hlo", default=None)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    w = args.widths
    p = [
        {
            "w": jnp.asarray(rng.normal(size=(a, c)) / np.sqrt(a), jnp.float32),
            "b": jnp.zeros((c,), jnp.float32),
        }
        for a, c in zip(w[:-1], w[1:])
    ]
    x = jnp.asarray(rng.normal(size=(args.n, w[0])), jnp.float32)
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", dev.platform)
    print(f"# loop forms on {kind}, MLP {w}, N={args.n}")
    for k in args.chunks:
        fs = forms(mlp_forward, args.n, args.n // k)
        if args.hlo:
            os.makedirs(args.hlo, exist_ok=True)
            for name, f in fs.items():
                c = jax.jit(f).lower(p, x).compile()
                fname = f"{k}_{name.replace('+', '_').replace('.', '_')}.txt"
                with open(os.path.join(args.hlo, fname), "w") as fh:
                    fh.write(c.as_text())
                try:  # the layouts XLA gave the input and the output
                    lin = c.input_formats[0][1].layout.major_to_minor
                    lout = c.output_formats.layout.major_to_minor
                    print(f"  {name}: input layout {lin}, output layout {lout}")
                except AttributeError:
                    pass
        times, outs = interleaved(
            list(fs.values()), (p, x), args.repeats, values=len(fs)
        )
        ref = times[0]
        print(f"## {k} chunks of {args.n // k}")
        print("| form | ms | throughput / jax.vmap | max abs diff |")
        print("|---|---|---|---|")
        for (name, _), t, o in zip(fs.items(), times, outs):
            d = float(jnp.max(jnp.abs(o - outs[0])))
            print(f"| {name} | {1e3 * t:.3f} | {ref / t:.3f} | {d:.2e} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
