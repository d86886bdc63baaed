"""Differential privacy: the clipped gradient sums (`clipped_grad`,
`clipped_grad_sum`) and ghost clipping's analysis and rules, built on the front ends
(`chunkvmap._transforms`) and the core."""
