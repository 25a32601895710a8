"""config/config.yaml (and ``--config``), typed and checked once, when the Snakefile is read:
``Settings.from_config(config)``; a bad entry is a ConfigError naming the key, e.g.
``config/config.yaml: simulate.mode: expected one of 'symmetric' or 'full'; got 'fast'``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

from echo.errors import ConfigError
from echo.validate.measure import PRIORITY

CONFIG_FILE = "config/config.yaml"
# `--config measure={iters: 3}` hands nested values over as text: read it as YAML where the
# field is not text itself
_Text = BeforeValidator(lambda v: yaml.safe_load(v) if isinstance(v, str) else v)
# pydantic's words for YAML's shapes
_SAID = {"tuple_type": "expected a list", "model_type": "expected a mapping"}


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)
    unknown: ClassVar[str] = "unknown key"  # what an extra key is called in errors


class Experiment(_Section):
    """One default experiment (``rule all`` simulates it)."""

    workload: StrictStr = Field(description="a config/workloads/ file's name")
    hardware: StrictStr = Field(description="a config/hardware/ file's name")
    topology: StrictStr = Field(description="a config/topologies/ file's name")

    @model_validator(mode="before")
    @classmethod
    def _exact_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict) or set(data) != set(cls.model_fields):
            raise PydanticCustomError("keys", "expected exactly the keys workload, hardware, topology; got {got}",
                                      {"got": repr(data)})
        return data

    @property
    def names(self) -> tuple[str, str, str]:
        return self.workload, self.hardware, self.topology


class Simulate(_Section):
    """``simulate:``, e.g. ``--config 'simulate={mode: full}'``."""

    unknown: ClassVar[str] = "unknown option"
    mode: Literal["symmetric", "full"] = Field(
        "symmetric", description="symmetric: one timeline per pipeline stage; full: every rank")
    overlap_grad_reduce: Annotated[Literal[None, False, True], _Text] = Field(
        None, description="gradient buckets overlap the last backward (Megatron-LM's flag); null: as the "
                          "workload's parallel.overlap_grad_reduce says")


class Measure(_Section):
    """``measure:``: how the measure stage trains a workload for real (echo.validate.run_measure)."""

    warmup: Annotated[StrictInt, _Text, Field(ge=0)] = Field(3, description="untimed steps first")
    iters: Annotated[StrictInt, _Text, Field(ge=1)] = Field(20, description="timed steps")
    profile: Annotated[StrictBool, _Text] = Field(True, description="profile one more step (ops vs collectives)")
    priority: Literal["rt", "nice", "none"] = Field(
        PRIORITY, description="scheduling of the rank processes (echo.launch.prioritize); also the local gloo "
                              "benchmark's, which predicts their collectives")


class Validate(_Section):
    """``validate:``: what `make validate` compares with reality."""

    local: Annotated[tuple[StrictStr, ...], _Text] = Field(
        ("tiny-dp2", "tiny-tp2", "tiny-pp2", "tiny-dp2-zero1", "tiny-dp2-recompute", "tiny-pp2-interleaved",
         "tiny-tp2pp2"), description="workloads measured here and compared on local-cpu/local-gloo (the three "
                                     "tiny layouts of the acceptance check first)")
    published: Annotated[Literal[True] | tuple[StrictStr, ...], _Text] = Field(
        True, description="the published rows to simulate: true for every row of both tables, or their names")
    reference_dir: Path | None = Field(None, description="the reference folder (echo.reference.reference_root)")


class PlanSettings(_Section):
    """``plan:``: the run each experiment is planned for (echo.plan: interruptions, goodput, cost,
    energy; the report's summaries gain the columns), e.g. ``--config 'plan={tokens: 15e12}'``."""

    tokens: Annotated[float, _Text, Field(gt=0)] = Field(
        3.0e11, description="tokens to train on (default 300B, GPT-3's run: Brown et al. 2020; SC21's estimate)")
    site: StrictStr = Field("meta-llama3-h100", description="a config/sites/ file: failure rates, storage, restart, "
                                                            "power, prices")


class Settings(_Section):
    """The whole of config/config.yaml; a section left out (or empty) takes its defaults."""

    experiments: tuple[Experiment, ...] = Field((), description="the default experiments of rule all")
    sweeps: Annotated[tuple[StrictStr, ...], BeforeValidator(lambda v: [v] if isinstance(v, str) else v)] = Field(
        (), description="the sweeps the report shows (each also runs alone: results/sweep/{sweep}/ranking.parquet)")
    searches: Annotated[tuple[StrictStr, ...], BeforeValidator(lambda v: [v] if isinstance(v, str) else v)] = Field(
        (), description="the searches whose time-to-train against GPU count the report shows (each config/sweeps/ "
                        "search file lists several gpus; each also runs alone: results/search/{search}/ranking.parquet)")
    plan: PlanSettings = Field(PlanSettings(), description="the run each experiment and search is planned for")
    simulate: Simulate = Field(Simulate(), description="how the simulate rule replays an iteration")
    measure: Measure = Field(Measure(), description="how the measure rule trains a workload for real")
    # named `validate` in the file; the attribute would shadow pydantic's BaseModel.validate
    validation: Validate = Field(Validate(), alias="validate", description="what `make validate` compares")

    @classmethod
    def from_config(cls, config: Mapping) -> Settings:
        """Snakemake's ``config``, checked; the first problem is a ConfigError naming its key."""
        try:
            return cls.model_validate({k: v for k, v in config.items() if v is not None})
        except ValidationError as exc:
            raise _config_error(exc.errors()[0]) from None


def _config_error(err: dict) -> ConfigError:
    """A pydantic error as the ConfigError of its key: the field names and list indices of its
    location (without the union members pydantic adds to it)."""
    model: type[BaseModel] | None = Settings
    fields: dict = {}
    keys: list[str] = []
    for part in err["loc"]:
        if isinstance(part, int):  # an index into a list of entries
            keys.append(str(part))
            continue
        fields = {f.alias or name: f for name, f in model.model_fields.items()} if model else {}
        if part in fields or err["type"] == "extra_forbidden":
            keys.append(part)
        if part not in fields:
            break
        model = next((a for a in (fields[part].annotation, *getattr(fields[part].annotation, "__args__", ()))
                      if isinstance(a, type) and issubclass(a, BaseModel)), None)
    if err["type"] == "extra_forbidden":
        reason = f"{model.unknown}; allowed: {', '.join(fields)}"
    elif err["type"] == "literal_error":
        reason = f"expected one of {err['ctx']['expected']}; got {err['input']!r}"
    elif err["type"] in _SAID:
        reason = f"{_SAID[err['type']]}; got {err['input']!r}"
    elif err["type"] == "keys":
        reason = err["msg"]
    else:
        reason = f"{err['msg']}; got {err['input']!r}"
    return ConfigError(CONFIG_FILE, ".".join(keys) or "-", reason)
