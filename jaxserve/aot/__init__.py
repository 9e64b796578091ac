"""Compiling for TPUs this host does not have: the deviceless compile check.

chips.py names the TPU slices and their chips' facts, compile_check.py compiles a server's step
programs for one (libtpu, the `tpu` extra) and measures them, roofline.py turns the measurements
into a best-case throughput, command.py is `jaxserve tpu-compile-check`.
"""

# Which programs a check compiles: every (bucket, variant) pair; every bucket of the plain step
# and every variant at the smallest and largest bucket; every bucket of the plain step; or the
# plain step at the smallest and largest bucket.
SCOPES = ("all", "default", "plain", "quick")
