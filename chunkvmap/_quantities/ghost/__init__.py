"""Ghost clipping: clipped per-example gradient sums without per-example gradients.

`method="ghost"` of `clipped_grad` and `clipped_grad_sum`. The loss of one example is
traced once to a jaxpr; `Plan` walks it (into `jit`, `checkpoint`, `scan` and `cond`
bodies) and finds every *use* of each differentiated leaf: an equation that a rule of
`_rules` covers (contractions, convolutions, embedding lookups, elementwise and
other linear operations), with the leaf reached through example-independent linear
steps (the chain). A leaf with any other use (a nonlinearity applied to it, a
`custom_jvp`/`custom_vjp` function or `while` loop it enters, a scan carry) is a
*per-example* leaf: its exact gradient is computed per example, as with
`method="vmap"`.

`Plan.run` evaluates the jaxpr with a zero *probe* added to the output of every use
and returns the operands each rule records (activations, indices): the
instrumentation recurses into sub-jaxprs, so that a scan takes its probes as extra
`xs` and returns its records as extra `ys`, a checkpoint keeps its policy, and a cond
returns zeros for the branch not taken. `jax.grad` with respect to the probes (and
the per-example leaves) gives every use's cotangent in one backward pass per example.
From records and cotangents each leaf gets its squared norm (`sq_norm`: the ghost norm
or the instantiated gradient, by the mixed rule), and each chunk its clipped sum
(`chunk_sum`: one transpose per use over the chunk's examples): a chunk holds
activations and cotangents, never `batch_size x parameters`. A use can instead be
*tapped* (`Plan.tap`): its leaf's squared norm is taken inside the backward pass, one
scan iteration at a time, and nothing of it is recorded (norms alone, and a scanned
layer stack's clipping, whose sum is then a second backward pass).

The package: `_context` (binding in the current mesh context), `_chains` (linear
steps between a leaf and its use), `_forms` (ghost forms and their cross terms),
`_rules` (uses and the first-order rules, by primitive), `_plan` (the analysis and
the instrumented evaluation), `_traced` (one example's loss traced, with its plans)
and `_report` (`ghost_report`).
"""

from ._context import explicit_spec as explicit_spec
from ._forms import all_finite as all_finite
from ._plan import (
    GHOST as GHOST,
    INSTANTIATED as INSTANTIATED,
    PER_EXAMPLE as PER_EXAMPLE,
    UNUSED as UNUSED,
    LeafRule as LeafRule,
    Method as Method,
    Plan as Plan,
    Record as Record,
    accumulation_dtype as accumulation_dtype,
    total as total,
)
from ._report import (
    GhostReport as GhostReport,
    ghost_report as ghost_report,
    report_of as report_of,
)
from ._traced import (
    Traced as Traced,
    check_scalar_loss as check_scalar_loss,
    shown_types as shown_types,
    traced_loss as traced_loss,
)
