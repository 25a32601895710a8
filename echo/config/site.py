"""Where a job runs for weeks: failure rates, checkpoint storage, restart, power and price.

config/sites/{name}.yaml. A step time says how fast one iteration is; a site says what happens to
thousands of them: how often the job is interrupted (per GPU, per host, per network link, and
events that follow the job rather than a part), how long a checkpoint takes to write and read
back, how long a restart takes, what the machines draw besides their GPUs, the data centre's PUE
and what a GPU-hour costs. Every figure carries its own provenance (``Figure``): a published
measurement, a datasheet, a value derived from those by a stated rule, or an assumption.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from echo.config.figure import Figure

_STRICT = ConfigDict(frozen=True, extra="forbid", strict=True)


class Failures(BaseModel):
    """Interruptions of a synchronous job, as rates of independent (Poisson) events: one failed
    part stops every rank, so the job's rate is the sum over the parts it holds."""

    model_config = _STRICT
    per_gpu_hour: Figure = Field(description="GPU faults (the GPU itself, its HBM and SRAM, NVLink, its "
                                 "system processor, thermal, silent data corruption), per GPU-hour")
    per_host_hour: Figure = Field(description="faults of a server's other parts (CPU, memory, NIC, SSD, power "
                                  "supply, chassis) and its unplanned maintenance, per host-hour")
    per_link_hour: Figure = Field(description="network switch and cable faults, per NIC link-hour")
    per_gpu_hour_software: Figure = Field(description="software faults, dependencies and unattributed "
                                          "collective timeouts, per GPU-hour (they grow with the job's size)")
    planned_per_day: Figure = Field(description="planned interruptions of the job (maintenance, firmware, "
                                    "configuration changes), per day, independent of its size")


class Checkpointing(BaseModel):
    """Writing and reading the job's state (weights and optimizer state)."""

    model_config = _STRICT
    write_GBps: Figure = Field(description="aggregate write bandwidth the job's checkpoint reaches, GB/s")
    read_GBps: Figure = Field(description="aggregate read bandwidth when the job reloads it, GB/s")
    fixed_s: Figure = Field(description="fixed cost of one save beyond its bytes (barrier, metadata, the "
                            "device-to-host copy of an asynchronous save), s")
    blocking: bool = Field(True, description="training waits for the write; false: an asynchronous save "
                           "(only fixed_s stops training; the write overlaps the next steps)")


class Power(BaseModel):
    """What the machines and the building draw beyond the GPUs' own power."""

    model_config = _STRICT
    host_overhead_w: Figure = Field(description="one host's draw besides its GPUs (CPUs, memory, NICs, switches "
                                    "in the chassis, fans), W")
    pue: Figure = Field(description="data-centre power usage effectiveness (facility / IT energy)")


class Site(BaseModel):
    """config/sites/{name}.yaml"""

    model_config = _STRICT
    name: str
    description: str = ""
    failures: Failures
    checkpoint: Checkpointing
    restart_s: Figure = Field(description="from an interruption to training again, before the checkpoint is "
                              "read: detection, rescheduling the job (spares swapped in), process start and "
                              "communicator set-up, s")
    power: Power
    usd_per_gpu_hour: dict[str, Figure] = Field(
        default_factory=dict, description="price of one GPU-hour by hardware file name (the GPUs, their share "
        "of the hosts and the network); a hardware without a price is costed as unknown")
