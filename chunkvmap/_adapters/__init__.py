"""What the Flax adapters (`chunkvmap.linen`, `chunkvmap.nnx`) share: Flax's lifted
transforms and stateful outputs. The public adapters are `chunkvmap.eqx`,
`chunkvmap.linen` and `chunkvmap.nnx`."""
