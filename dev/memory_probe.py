"""What XLA's compiled memory figures say against what the device held, per program.

Each program runs in its own process (the device's peak counter is a running maximum
per process). Printed: the compiled temp and peak figures, and the device's peak bytes
in use during the run less what the arguments held before it.

    python dev/memory_probe.py
"""

import json
import subprocess
import sys

CHILD = r"""
import json, sys
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp, numpy as np
import chunkvmap, _dp_models as m
name, n, b = sys.argv[1], int(sys.argv[2]), sys.argv[3]
b = None if b == "none" else int(b)
rng = np.random.default_rng(0)
if name.startswith("lm"):
    p = m.lm_params(rng); data = m.lm_batch(rng, n); loss = m.lm_loss
elif name.startswith("mlp"):
    p = m.mlp_params(rng); data = m.mlp_batch(rng, n); loss = m.mlp_loss
if name == "lm vmap-jax":
    def f(p, x, y):
        g = jax.vmap(jax.grad(loss), (None, 0, 0))(p, x, y)
        norms = jnp.sqrt(sum(jnp.sum(l.reshape(n, -1) ** 2, 1) for l in jax.tree.leaves(g)))
        c = jnp.minimum(1.0, 1.0 / norms)
        return jax.tree.map(lambda l: jnp.tensordot(c, l, 1), g)
elif name in ("lm ghost", "lm vmap"):
    f = chunkvmap.clipped_grad_sum(loss, l2_clip_norm=1.0, method=name.split()[1], batch_size=b)
elif name == "mlp pe-grads":
    f = chunkvmap.per_example_grads(loss, batch_size=b)
elif name == "ensemble":
    x = jnp.asarray(rng.normal(size=(256, 784)), jnp.float32)
    ps = [m.mlp_params(rng) for _ in range(n)]
    p = jax.tree.map(lambda *a: jnp.stack(a), *ps); data = (x,)
    def one(q, x):
        for l in q[:-1]:
            x = jnp.tanh(x @ l["w"] + l["b"])
        return x @ q[-1]["w"]
    f = chunkvmap.batch_vmap(one, in_axes=(0, None), batch_size=b)
dev = jax.devices()[0]
jax.block_until_ready((p, data))
before = (dev.memory_stats() or {}).get("bytes_in_use")
out = {"name": name, "n": n, "b": b}
try:
    c = jax.jit(f).lower(p, *data).compile()
    a = c.memory_analysis()
    out.update(temp=a.temp_size_in_bytes, peak=getattr(a, "peak_memory_in_bytes", None),
               args=a.argument_size_in_bytes, outs=a.output_size_in_bytes)
    jax.block_until_ready(c(p, *data))
    s = dev.memory_stats() or {}
    out.update(before=before, device_peak=s.get("peak_bytes_in_use"), limit=s.get("bytes_limit"))
except Exception as e:
    out["error"] = str(e).splitlines()[0][:160]
print("RESULT " + json.dumps(out))
"""

RUNS = [
    ("lm vmap-jax", 256, "none"), ("lm vmap-jax", 1024, "none"),
    ("lm vmap", 1024, "256"), ("lm vmap", 4096, "1024"),
    ("lm ghost", 1024, "256"), ("lm ghost", 4096, "1024"), ("lm ghost", 16384, "4096"),
    ("mlp pe-grads", 64, "none"), ("mlp pe-grads", 256, "64"), ("mlp pe-grads", 1024, "256"),
    ("ensemble", 64, "none"), ("ensemble", 64, "16"),
]


def main():
    for name, n, b in RUNS:
        p = subprocess.run([sys.executable, "-c", CHILD, name, str(n), b],
                           capture_output=True, text=True, timeout=240)
        line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
        if not line:
            print(name, n, b, "failed:", p.stderr[-400:], flush=True)
            continue
        r = json.loads(line[0][7:])
        mib = lambda x: None if x is None else round(x / 2**20, 1)
        held = None if r.get("device_peak") is None else r["device_peak"] - (r["before"] or 0)
        print(f"{name:14s} N={n:6d} B={b:5s} temp={mib(r.get('temp'))} MiB "
              f"peak(compiled)={mib(r.get('peak'))} args={mib(r.get('args'))} "
              f"out={mib(r.get('outs'))} device-held={mib(held)} MiB "
              f"{r.get('error', '')}", flush=True)


main()
