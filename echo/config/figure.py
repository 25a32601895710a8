"""A figure with its provenance: the unit of every sourced number in a config file."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat


class Figure(BaseModel):
    """One number and where it comes from."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)
    value: NonNegativeFloat = Field(description="the figure, in the unit its key names")
    status: Literal["published", "datasheet", "derived", "fitted", "assumed"] = Field(
        description="published: measured in a cited report; datasheet: a vendor spec; derived: computed from "
                    "cited figures by the rule in basis; fitted: by the fit named in basis, on declared fit rows; "
                    "assumed: a judgement, said why")
    basis: str = Field(min_length=1, description="the source (report, table, page) or the reasoning")
