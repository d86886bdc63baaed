"""A griffe extension for the API pages: a function's parameters as it declares
them in `__signature__`.

`_options.takes` gives each entry point a `__signature__` listing the chunking
keywords it accepts through `**options`, and keeps `__wrapped__` (so that
`inspect.getsource` and `inspect.unwrap` reach the function's own code). griffe's
inspection unwraps `__wrapped__` past the declared signature to the wrapped
function's `**options`; this puts the declared parameters back, as
`inspect.signature` gives them.
"""

from __future__ import annotations

import inspect
from typing import Any

import griffe


_KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: griffe.ParameterKind.positional_only,
    inspect.Parameter.POSITIONAL_OR_KEYWORD: griffe.ParameterKind.positional_or_keyword,
    inspect.Parameter.VAR_POSITIONAL: griffe.ParameterKind.var_positional,
    inspect.Parameter.KEYWORD_ONLY: griffe.ParameterKind.keyword_only,
    inspect.Parameter.VAR_KEYWORD: griffe.ParameterKind.var_keyword,
}


class DeclaredSignatures(griffe.Extension):
    """Parameters from `__signature__` where a function declares one."""

    def on_function_instance(self, *, node: Any, func: Any, **kwargs: Any) -> None:
        # (the node holds the unwrapped function; its owner holds it as declared)
        owner = getattr(getattr(node, "parent", None), "obj", None)
        declared = getattr(owner, getattr(node, "name", ""), None)
        signature = getattr(declared, "__signature__", None)
        if not isinstance(signature, inspect.Signature):
            return
        func.parameters = griffe.Parameters(
            *(
                griffe.Parameter(
                    p.name,
                    kind=_KINDS[p.kind],
                    annotation=None if p.annotation is p.empty else str(p.annotation),
                    default=None if p.default is p.empty else repr(p.default),
                )
                for p in signature.parameters.values()
            )
        )
