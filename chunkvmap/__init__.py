"""chunkvmap: `jax.vmap` that fits in memory.

Evaluate a vectorised function over N examples in chunks (`jax.vmap` inside
`lax.scan`), optionally folding the chunk results with a reduction instead of stacking
them.
"""

import importlib.metadata

from ._core._cache import last_batch_size as last_batch_size
from ._core._options import identity as identity
from ._quantities._choice import GhostFallbackWarning as GhostFallbackWarning
from ._quantities._clipping import (
    AuxiliaryOutput as AuxiliaryOutput,
    ClippedGrad as ClippedGrad,
    clipped_grad as clipped_grad,
    clipped_grad_sum as clipped_grad_sum,
)
from ._quantities._curvature import (
    Kronecker as Kronecker,
    ggn_diagonal as ggn_diagonal,
    kfac_factors as kfac_factors,
)
from ._quantities._ekfac import (
    EigenKronecker as EigenKronecker,
    ekfac_factors as ekfac_factors,
    multiply_inverse as multiply_inverse,
)
from ._quantities._projections import (
    per_example_grad_projections as per_example_grad_projections,
)
from ._quantities._statistics import (
    GradStats as GradStats,
    per_example_grad_gram as per_example_grad_gram,
    per_example_grad_norms as per_example_grad_norms,
    per_example_grad_stats as per_example_grad_stats,
)
from ._quantities._store import (
    GradientStore as GradientStore,
    TopK as TopK,
    build_store as build_store,
    load_store as load_store,
)
from ._quantities.ghost import GhostReport as GhostReport, ghost_report as ghost_report
from ._transforms._batch_map import batch_map as batch_map
from ._transforms._batch_vmap import batch_vmap as batch_vmap
from ._transforms._grads import per_example_grads as per_example_grads
from ._transforms._jacobians import (
    batch_jacfwd as batch_jacfwd,
    batch_jacrev as batch_jacrev,
)
from ._transforms._vectorize import batch_vectorize as batch_vectorize


try:
    __version__ = importlib.metadata.version("chunkvmap")
except importlib.metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "AuxiliaryOutput",
    "ClippedGrad",
    "EigenKronecker",
    "GhostFallbackWarning",
    "GhostReport",
    "GradStats",
    "GradientStore",
    "Kronecker",
    "TopK",
    "batch_jacfwd",
    "batch_jacrev",
    "batch_map",
    "batch_vectorize",
    "batch_vmap",
    "build_store",
    "clipped_grad",
    "clipped_grad_sum",
    "ekfac_factors",
    "ggn_diagonal",
    "ghost_report",
    "identity",
    "kfac_factors",
    "last_batch_size",
    "load_store",
    "multiply_inverse",
    "per_example_grad_gram",
    "per_example_grad_norms",
    "per_example_grad_projections",
    "per_example_grad_stats",
    "per_example_grads",
]
