"""The base every config section shares (`_Section`): unknown keys refused, non-finite numbers refused, only
true/false in a true/false field and never in a number field, text bounded by MAX_TEXT. The sections themselves are
`vlmrl.config.sections` and `vlmrl.config.train_section`.
"""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, field_validator

from vlmrl.config.load import clip, quoted  # the loading side never imports the sections: no cycle

MAX_TEXT = 4096  # characters of a text field: a path (PATH_MAX on Linux), a hub id, a name


class _Section(BaseModel):
    # inf/nan pass `gt=0` checks (a learning rate of .inf is "positive") and fail only hours later
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _exact_in_float_fields(cls, value: Any, info: Any) -> Any:
        """An integer given to a float field arrives unchanged or is refused: pydantic would store 2**53 + 1 as
        2**53 (found by tests/test_fuzz_config.py). A true/false field takes only true or false, and a number
        field never does: pydantic would read `"off"` as false and `true` as 1. Text is bounded (MAX_TEXT)."""
        annotation = cls.model_fields[info.field_name].annotation
        if _takes_float(annotation):
            _exact_float(value)
        if annotation in (bool, bool | None) and not isinstance(value, bool) and value is not None:
            raise ValueError(f"{quoted(value)} is not true or false; write true or false")
        if isinstance(value, bool) and _takes_number(annotation):
            raise ValueError(f"{str(value).lower()} is not a number; write the number you mean")
        if isinstance(value, str) and (len(value) > MAX_TEXT or "\0" in value):
            raise ValueError(f"{len(value)} characters; at most {MAX_TEXT}" if len(value) > MAX_TEXT
                             else "holds a NUL character (\\0)")
        return value


def _exact_float(value: Any) -> None:
    """Refuse an integer a float cannot hold exactly (anything else passes to the type check)."""
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            exact = float(value) == value
        except OverflowError:
            exact = False
        if not exact:
            raise ValueError(f"{clip(str(value), 40)} has no exact floating-point value; write the number you mean "
                             "as a float")


def _takes_float(annotation: Any) -> bool:
    """True when a type is float, alone or in a union (float | None)."""
    return annotation is float or float in get_args(annotation)


def _takes_number(annotation: Any) -> bool:
    """True when a type is int or float, alone or in a union, and not also bool."""
    types = {annotation, *get_args(annotation)}
    return bool(types & {int, float}) and bool not in types
