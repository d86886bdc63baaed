"""The per-example quantities of gradients and curvature, each over the examples of
a call, chunked and sharded: the clipped sums and norms (`_clipping`), the moments
and Gram matrix (`_statistics`), the curvature (`_curvature`, `_ekfac`), the
projections and their store (`_projections`, `_store`), the ghost/vmap choice
(`_choice`), and ghost clipping's analysis and rules (`ghost`) that compute them
from each example's activations and cotangents; built on the front ends
(`chunkvmap._transforms`) and the core."""
