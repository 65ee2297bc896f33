"""Numeric claims of the seed documents (shared/seeds/) with a verdict each (data/seed_claims.json).

The seeds are marketing-grade Megatron-Core skill docs; several of their numbers are sparse peaks
taken as dense, MFUs that contradict their own TFLOP/s, or layouts attributed to runs that used
others. Each claim quotes the seed verbatim, restates what it asserts, and says why it holds or
not, with the corrected value where there is one. The arithmetic behind the verdicts is redone in
tests/knowledge/test_seed_claims.py.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Verdict = Literal["holds", "wrong", "unverifiable", "misleading"]


class SeedClaim(BaseModel):
    """One numeric claim of a seed document and its verdict."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(description="Stable identifier, e.g. 'h100-bf16-1979'.")
    seed_file: str = Field(description="First seed file (shared/seeds/) containing the quote.")
    also_in: list[str] = Field(default_factory=list, description="Other seed files with the same quote (the seeds repeat one another).")
    quote: str = Field(description="Verbatim text from the seed (whitespace may differ).")
    claim: str = Field(description="What the quote asserts, stated precisely.")
    verdict: Verdict = Field(description="'holds', 'wrong', 'misleading' (true in a narrow reading, wrong as used) or 'unverifiable'.")
    why: str = Field(description="Evidence: datasheet, paper table, published run (source key) or our measurement, with the arithmetic.")
    correct_value: str | None = Field(None, description="The corrected figure where the claim is wrong or misleading.")


@cache
def seed_claims() -> tuple[SeedClaim, ...]:
    """Every recorded seed claim (cached)."""
    raw = json.loads(resources.files(__package__).joinpath("data/seed_claims.json").read_text(encoding="utf-8"))
    return tuple(SeedClaim(**c) for c in raw["claims"])


@cache
def _by_id() -> dict[str, SeedClaim]:
    return {c.id: c for c in seed_claims()}


def seed_claim(claim_id: str) -> SeedClaim:
    """One claim by id; KeyError lists close ids."""
    try:
        return _by_id()[claim_id]
    except KeyError:
        import difflib

        close = difflib.get_close_matches(claim_id, list(_by_id()), n=5)
        raise KeyError(f"unknown seed claim {claim_id!r}; closest: {', '.join(close) or 'none'}") from None


def claims_for_seed(seed_file: str) -> tuple[SeedClaim, ...]:
    """Claims whose quote appears in `seed_file` (as first occurrence or in also_in)."""
    return tuple(c for c in seed_claims() if c.seed_file == seed_file or seed_file in c.also_in)
