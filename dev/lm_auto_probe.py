import logging, sys
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
logging.getLogger("jax").setLevel(logging.WARNING)
sys.path.insert(0, "benchmarks")
import jax, numpy as np, chunkvmap, _dp_models as m
rng = np.random.default_rng(0)
p = m.lm_params(rng); t, y = m.lm_batch(rng, 4096)
f = chunkvmap.clipped_grad_sum(m.lm_loss, 1.0, method="ghost", batch_size="auto")
print(jax.jit(f)(p, t, y)[1])
