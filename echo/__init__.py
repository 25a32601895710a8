"""Echo: simulate one iteration of large-scale distributed training without the cluster.

Glossary (see also ../DESIGN contracts):
- rank, world size: a process of the job and how many there are (tp x pp x dp x cp).
- group: a process group, given by its global ranks.
- class: the ranks whose traced graphs hash equal; representative: the rank traced for a class.
- chunk: the part of the model one pipeline rank runs for one virtual stage.
- micro-batch: the unit the pipeline schedule moves between stages.
- kernel key: op, input shapes, dtype and flags; the unit the profile stage times.
- hardware: the GPU model; topology: the network (node size, links, NICs, fabric).
- step time: the wall time of one optimizer iteration.
"""

__version__ = "0.1.0"
