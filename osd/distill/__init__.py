"""Distillation math, pure: how far the draft is from the logged target, and what it would accept.

Owns: the losses between a logged target distribution (top-m buckets) and the draft
(``losses``) and acceptance estimates computed from logged distributions without serving the
draft (``acceptance``). Imports torch and the record schema only; no I/O. The trainer trains and
judges with it; the demo builder pre-trains with it.
"""
