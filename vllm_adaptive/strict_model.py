"""Base for every config schema: unknown keys, wrong types and coercions are errors."""

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
