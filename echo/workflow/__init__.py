"""workflow: the seams between Snakemake and the stages, each in one place, at the top of the
import order (the stages never import it; they are handed paths and config slices).

- ``paths``: every artifact path pattern (rules, CLI, audit views, sweeps, status);
- ``settings``: config/config.yaml, typed and checked (experiments, sweeps, simulate, measure, validate);
- ``params``: each rule's params and config checks, shared by workflow/rules/*.smk and ``status``;
- ``versions``: each stage's code version, the one table of stages;
- ``status``: ``python -m echo status``, Snakemake's dry run explained.
"""
