"""The front ends: `batch_vmap`, `batch_map`, `batch_vectorize`, the Jacobians and
`per_example_grads`. Each validates its inputs and traces the user's function, then
hands the traced chunk to the core (`chunkvmap._core`)."""
