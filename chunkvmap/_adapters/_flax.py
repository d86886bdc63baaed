"""The Flax internals that the Flax adapters use: the one place they leave Flax's API.

`chunkvmap.linen` and `chunkvmap.nnx` import every name they can from Flax's public
namespaces (`flax.linen`, `flax.nnx`, `flax.typing`) directly. The few they need that
Flax does not re-export publicly are imported here, each with the reason no public
name serves, so that a Flax release that moves or changes one of them breaks this
module, and only this module, with an error that says so.

Imported by the adapters only (never by `chunkvmap/__init__.py`: `import chunkvmap`
needs JAX alone). The adapters import Flax's public modules first, so a missing Flax
is reported by them, with the install hint, before this module is reached.
"""

from __future__ import annotations

import flax


try:
    # linen: runs our body on a scope's collections and RNGs; no public lifting API
    from flax.core.lift import pack

    # linen: makes that body a Module/method transform (Vmap<Name>); not in flax.linen
    from flax.linen.transforms import lift_transform

    # nnx: keeps the graph nodes of f's args after f, as nnx.vmap; no public equivalent
    from flax.nnx.extract import clear_non_graph_nodes

    # nnx: spots bound methods of graph nodes; not in flax.nnx (nnx.graph is a shim)
    from flax.nnx.graphlib import is_graph_node
except ImportError as e:  # pragma: no cover - only with an incompatible Flax
    raise ImportError(
        "chunkvmap's Flax adapters need Flax internals (listed in "
        f"chunkvmap/_adapters/_flax.py) "
        f"that Flax {getattr(flax, '__version__', '?')} does not provide: {e}. "
        f"They were written against flax 0.12."
    ) from e


__all__ = ["clear_non_graph_nodes", "is_graph_node", "lift_transform", "pack"]
